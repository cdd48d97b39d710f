// Additive-codebook (AQLM) GEMV, one activation row: deterministic CUDA kernels for 2x8 and 1x16.
//
//   y[r] = scale[r] * sum_g x[8g:8g+8] . (sum_m C_m[codes[r, g, m]])  (+ bias[r]) (+ residual[r])
//
// Canonical layout read as stored: codes [N, G, M] (int8 for 2x8, int16 for 1x16; the raw bits are
// the unsigned index), codebooks fp16 [M, K, 1, 8], scales fp16 [N]. fp32 accumulation, sums in a
// fixed order, no atomics in any sum: bitwise reproducible, CUDA-graph capturable.
//
// ---- 2x8 (M = 2 codebooks of 256 entries): shared-memory lookup tables, conflict-free lookups
// Work = (slice of 32 input groups) x (octet of 8 rows). A block takes a contiguous range of
// (slice, octet) units (slice-major, so a range covers one or two slices), builds the slice's table
//     lut[k][col] = x_g . C_m[k]   (fp32, 256 entries x 64 columns, one column per (group, codebook))
// in shared memory (64 KB) with mma.sync m16n8k8 (x is A, the codebooks are B), then streams codes:
// a warp's unit is 8 rows x 64 code bytes (16 B per lane: lane = 4 * row + chunk, chunk = 8 groups x
// 2 codebooks), copied by cp.async into a per-warp shared-memory ring (12 units in flight per warp)
// and read back by each lane (its own 16 bytes). Each lane turns a code byte into a table address with one PRMT
// ((code << 8) | 4 * column), loads the entry (LDS [R + UR]: the table base folds in) and adds it.
// Bank-conflict freedom: the column of byte p of chunk j is tab_col(j, p) = 16 j + (p ^ 8 (j >> 1)),
// so the bank (= column mod 32, whatever the code) is fixed by (chunk, byte); at step s lane (r, j)
// takes byte 4 ((s >> 2) ^ (r >> 2)) + ((s + r) & 3) (a per-lane rotation: runtime PRMT selector, and
// rows 4..7 swap their code words pairwise), which gives the 32 lanes 32 distinct banks at every
// step (tests/cuda/additive_2x8_host_check.cu runs these lane maps on the CPU and checks it). With
// random codes and one shared table instead, a warp's LDS costs ~3.2-3.5 wavefronts.
// Partial sums per (slice, row) go to a workspace; a second, small kernel adds each row's partials in
// a fixed order and applies scale, bias and residual (deterministic; no atomics, no fences). (The first
// version let the block finishing an octet's last slice add its partials: the blocks that finished last
// did most of those sums one row per thread, a tail of ~10-30 us at the big shapes.)
// Codes: the kernel reads any (row stride, slice stride) layout; the engine packs them once into the
// "slices" layout ([slice][row][64 B]) so that each block streams one contiguous range. One launch can
// cover up to 4 projections sharing x (q/k/v, gate/up), each with its own codebooks.
//
// Budget per 8 weights (one group, two codes), per SM:
//   DRAM: 2 code bytes (0.25 B/weight; cuBLAS fp16 reads 2 B/weight: 8x fewer bytes).
//   L1/shared wavefronts: 2 lookups x 1/32 + 2 code bytes x 8 lines / 512 B = 0.094 (0.0117 per
//     weight). At 4 TB/s an SM must take 16.8 code bytes/cycle: 0.79 wavefronts/cycle (of 1).
//   Issue: per code PRMT + LDS + FADD, plus per 16 codes ~30 (LDG, 4 SEL, 2 SHFL, partial store,
//     loop; SASS of sm_90: 48 + ~30 per chunk): ~5 per code, 2.6 of 4 warp-instructions/cycle per
//     SM at 4 TB/s.
//   Table build per slice: 128 mma, 64 KB of conflict-free STS (512 wavefronts), 128 x 32-bit B
//     loads: ~0.5 us, amortised over the block's rows (a block covers >= ~500 rows of a slice at
//     the benchmark shapes).
//   So the main loop should run near DRAM speed; expected 8192x28672: 58.7 MB of codes, ~17 us at
//   3.5 TB/s + ~2-3 us build/launch/reduction tail (cuBLAS fp16: ~110 us).
//   Measured (H200, session 3, NOTES-additive.md): 30.0 us, main kernel ~26.5 us at 48% of DRAM peak,
//   bound by LDS latency with 16 warps per SM (issue active 63%).
//
// ---- 1x16 (one codebook of 65,536 entries = 1 MiB, stays in L2/L1): gathers
// A warp owns 4 rows and a share of the input groups (lane l takes group 32 c + l of chunk c, so
// x loads are coalesced and reused by the 4 rows); per group it gathers the 16-byte entry
// (LDG.128 through L1) and does 8 fp32 FMAs. Warps of a block split the groups when there are few
// rows (k-split, partials added in warp order). Budget per 8 weights: one 16-byte gather = one L1
// wavefront (a random 128-B line per lane), + 1/32 for the code load and 1/32 for x: the L1 pipe
// caps the kernel near 132 SMs x 1.8 GHz x 8 / 1.06 = 1.8e12 weights/s, about 0.85x of cuBLAS fp16
// at 4.3 TB/s. Measured (ncu, H200): the L2 is the limit first - each 16-byte gather costs a 32-byte
// L2 sector (L1 hit rate 16%), 85% of L2 peak at ~0.56-0.78x cuBLAS.
#include "pdl.cuh"
#include <cuda_fp16.h>
#include <stdint.h>

// Dynamic shared memory: the 2x8 lookup table (named at file scope so its address is a constant).
extern __shared__ __align__(16) uint32_t trapetum_aqlm_smem[];

namespace trapetum_aqlm {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// ----------------------------------------------------------------------------- 2x8 lane maps
// (host + device: tests/cuda/additive_2x8_host_check.cu runs these same functions on the CPU)
constexpr int kSlice = 32;                   // input groups per slice
constexpr int kSliceBytes = 2 * kSlice;      // code bytes of one row in one slice
constexpr int kCols = 2 * kSlice;            // table columns: one per (group, codebook)
constexpr int kTabBytes = 256 * kCols * 4;   // 64 KB
// Code chunks in flight per warp: a shared-memory ring filled by cp.async (no registers held), 12 x 512 B
// per warp = 48 KB per block, 96 KB per SM (2 blocks): enough bytes in flight for DRAM bandwidth. (Held
// in registers, 5 chunks per warp = 40 KB per SM was the most that fit: the kernel stalled on them.)
constexpr int kStage = 12;
constexpr int kRingBytes = kWarps * kStage * 512;
constexpr int kSmemBytes = kTabBytes + kRingBytes;  // 112 KB: two blocks per SM
constexpr int kTiles = 2 * 256 / 8;          // mma n-tiles per slice (8 (codebook, entry) columns each)

// Column of code byte p (0..15) of chunk j (0..3); chunk j = groups 8j..8j+7, byte p = 2 (g - 8j) + m.
__host__ __device__ constexpr int tab_col(int j, int p) { return 16 * j + (p ^ (8 * (j >> 1))); }
__host__ __device__ constexpr int tab_col_of(int gl, int m) { return tab_col(gl >> 3, 2 * (gl & 7) + m); }
// Code byte that lane (row r, chunk j) looks up at step s (0..15).
__host__ __device__ constexpr int step_byte(int r, int s) { return 4 * ((s >> 2) ^ (r >> 2)) + ((s + r) & 3); }
// PRMT operand of step s, used as both the selector and the second source: selector (low 16 bits)
// = result byte 0 <- this word's byte 2 (4 * column < 256), byte 1 <- code byte (s + r) & 3 of the
// (row-swapped) word s >> 2, bytes 2, 3 <- this word's byte 3 (0). Result: (code << 8) | 4 * column.
__host__ __device__ constexpr uint32_t step_word(int lane, int s) {
  return 0x7706u | (uint32_t((s + (lane >> 2)) & 3) << 4) |
         (4u * uint32_t(tab_col(lane & 3, step_byte(lane >> 2, s))) << 16);
}
// Table build, mma n-tile q: B column c (0..7) holds codebook bcol_m(c), entry bcol_k(q, c).
__host__ __device__ constexpr int bcol_m(int c) { return (c >> 1) & 1; }
__host__ __device__ constexpr int bcol_k(int q, int c) { return 4 * q + 2 * (c >> 2) + (c & 1); }
// Word offset in the table of the build store `second` (0/1) of C column 2t+e, m-tile mt, for lane:
// lanes with t >= 2 store their row-gid+8 value first, so each store hits 32 distinct banks.
__host__ __device__ constexpr int build_word(int q, int mt, int lane, int e, int second) {
  const int gid = lane >> 2, t = lane & 3, h = (t >> 1) ^ second;
  return bcol_k(q, 2 * t + e) * kCols + tab_col_of(16 * mt + gid + 8 * h, bcol_m(2 * t + e));
}
// ----------------------------------------------------------------------------- 2x8 work layout
// One launch computes up to kMaxParts projections that share the input x (q, k, v; gate, up), each
// with its own codebooks, rows and code layout. Part q's units are (slice, octet) pairs numbered
// slice-major from units0; a byte of row r, slice s sits at codes + s * slice_stride + r * row_stride:
//   "slices" layout (the kernel's, packed once at load): [slice][row (padded to 8)][64 bytes],
//     row_stride = 64, slice_stride = 64 * 8 * octets: a block's unit range is one contiguous stream;
//   canonical layout [row][group][2]: row_stride = 2 G, slice_stride = 64 (64-byte pieces, 2 G apart).
// Partial sums of part q: partial[partial0 + slice * N + row] (added by aqlm_2x8_reduce_kernel);
// outputs, scales, bias and residual: index row0 + row.
constexpr int kMaxParts = 4;
struct Part2x8 {
  const uint8_t* codes;
  const void* cb;          // fp16 [2, 256, 8]
  long long row_stride;    // bytes
  long long slice_stride;  // bytes
  long long units0;        // first unit of this part
  long long partial0;      // first partial float of this part
  int N, row0, octets;
};

// The part that owns unit u (parts are few: a select chain, no dynamic indexing of the parameter).
__host__ __device__ inline Part2x8 part_of(const Part2x8 (&parts)[kMaxParts], int nparts, long long u) {
  Part2x8 P = parts[0];
#pragma unroll
  for (int q = 1; q < kMaxParts; ++q)
    if (q < nparts && u >= parts[q].units0) P = parts[q];
  return P;
}
// Units [u, u1) of part P: the next segment (one slice of one part, octets [oa, ob)).
__host__ __device__ inline void next_segment(const Part2x8& P, long long u, long long u1, int* slice, int* oa, int* ob) {
  const long long lu = u - P.units0;
  *slice = int(lu / P.octets);
  *oa = int(lu - (long long)(*slice) * P.octets);
  const long long end = P.units0 + (long long)(*slice) * P.octets + P.octets;
  *ob = int((u1 < end ? u1 : end) - P.units0 - (long long)(*slice) * P.octets);
}

// Totals of a launch's parts (filled by fill_parts).
struct PartTotals {
  long long units = 0, rows = 0, floats = 0;
};
// Host: part q from meta row (rows N, byte offset into codes[q], row stride, slice stride); unused slots
// never own a unit.
inline PartTotals fill_parts(Part2x8 (&parts)[kMaxParts], int nparts, const long long* meta,
                             const uint8_t* const* codes, const void* cb, int nslices) {
  PartTotals t;
  for (int q = 0; q < kMaxParts; ++q) {
    Part2x8& P = parts[q];
    if (q >= nparts) {
      P = parts[0];
      P.units0 = (long long)1 << 62;
      continue;
    }
    P.N = (int)meta[4 * q];
    P.codes = codes[q] + meta[4 * q + 1];
    P.row_stride = meta[4 * q + 2];
    P.slice_stride = meta[4 * q + 3];
    P.cb = static_cast<const uint16_t*>(cb) + (size_t)q * 2 * 256 * 8;
    P.units0 = t.units;
    P.partial0 = t.floats;
    P.row0 = (int)t.rows;
    P.octets = (P.N + 7) / 8;
    t.units += (long long)nslices * P.octets;
    t.floats += (long long)nslices * P.N;
    t.rows += P.N;
  }
  return t;
}

// Second kernel: y[row] = epilogue(sum over slices of partial[slice][row]) for the rows of every
// part, 64 rows per block: thread (row, q) adds slices q, q + 4, q + 8, .. in order, then the four
// quarter sums are added as (s0 + s1) + (s2 + s3): a fixed order whatever the grid of the first kernel.
constexpr int kReduceRows = kThreads / 4;
__host__ __device__ inline Part2x8 part_of_row(const Part2x8 (&parts)[kMaxParts], int nparts, long long row) {
  Part2x8 P = parts[0];
#pragma unroll
  for (int q = 1; q < kMaxParts; ++q)
    if (q < nparts && row >= parts[q].row0) P = parts[q];
  return P;
}

#ifdef __CUDACC__
// ----------------------------------------------------------------------------- device helpers
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
// 16 bytes global -> shared, asynchronous, L2 only, evict-first; src_bytes 0 writes zeros (nothing read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes, uint64_t pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
               :: "r"(dst), "l"(src), "r"(src_bytes), "l"(pol) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts_f32(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;" :: "r"(addr), "f"(v));
}
__device__ __forceinline__ void mma16808(float* c, uint32_t a0, uint32_t a1, uint32_t b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(b0));
}

// Epilogue of one output row: y = acc * scale (+ bias) (+ residual), rounded once to fp16. The
// inputs are loaded first (Epi::load) so that their latency overlaps the accumulation.
struct Epi {
  float scale, bias, res;
  __device__ __forceinline__ static Epi load(const half* __restrict__ scales, const half* __restrict__ bias,
                                             const half* __restrict__ res, int row, int has_bias, int has_res) {
    return {__half2float(scales[row]), has_bias ? __half2float(bias[row]) : 0.f,
            has_res ? trapetum_pdl::ld_input_half(res + row) : 0.f};
  }
  __device__ __forceinline__ void store(half* __restrict__ y, int row, float acc, int has_bias, int has_res) const {
    float v = acc * scale;
    if (has_bias) v += bias;
    if (has_res) v += res;
    y[row] = __float2half_rn(v);
  }
};

// ----------------------------------------------------------------------------- 2x8 kernel
struct Params2x8 {
  const half* x;          // [G * 8]
  const half* scales;     // [rows of all parts]
  const half* bias;       // [rows] or unused
  const half* res;        // [rows] or unused
  half* y;                // [rows]
  float* partial;         // per part [nslices, N]
  Part2x8 part[kMaxParts];
  int nparts, G, nslices, has_bias, has_res;
  long long units;        // all parts
};

// lut[k][col] for the 32 groups of `slice` (groups >= G get x = 0, hence zero entries).
__device__ void build_table(const Params2x8& p, const half* cb, uint32_t tab, int slice, int warp, int lane) {
  const int gid = lane >> 2, t = lane & 3;
  uint32_t a[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int g = slice * kSlice + 16 * mt + 8 * hh + gid;
      a[mt][hh] = g < p.G ? trapetum_pdl::ld_input(reinterpret_cast<const uint32_t*>(p.x + (size_t)g * 8 + 2 * t)) : 0u;
    }
  uint32_t b[kTiles / kWarps];  // all B fragments in flight at once (the codebooks sit in L2)
#pragma unroll
  for (int i = 0; i < kTiles / kWarps; ++i) {
    const int q = warp + i * kWarps;
    b[i] = __ldg(reinterpret_cast<const uint32_t*>(cb + (bcol_m(gid) * 256 + bcol_k(q, gid)) * 8 + 2 * t));
  }
#pragma unroll
  for (int i = 0; i < kTiles / kWarps; ++i) {
    const int q = warp + i * kWarps;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      mma16808(c, a[mt][0], a[mt][1], b[i]);
      const bool hi_first = t >= 2;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sts_f32(tab + 4 * build_word(q, mt, lane, e, 0), hi_first ? c[2 + e] : c[e]);
        sts_f32(tab + 4 * build_word(q, mt, lane, e, 1), hi_first ? c[e] : c[2 + e]);
      }
    }
  }
}

// Per-segment state of one lane: where its code chunks and row partials live.
struct Lane2x8 {
  const uint8_t* codes;  // chunk j of row r of octet 0 of this slice (octet o: + 8 o row_stride)
  float* partial;        // this part's partial[slice][0]
  long long octet_stride;
  int N;
  bool chunk_ok;         // the chunk lies inside the G groups
};

// Start copying the 16 code bytes of lane (r, j) for octet o into its ring slot (zeros for an octet
// past ob, a row past N or a chunk past G); one commit group per call.
__device__ __forceinline__ void copy_chunk(uint32_t slot, const Lane2x8& l, int o, int ob, int r, uint64_t pol) {
  const bool ok = o < ob && 8 * o + r < l.N && l.chunk_ok;
  cp_async16(slot, ok ? l.codes + o * l.octet_stride : l.codes, ok ? 16u : 0u, pol);
  cp_async_commit();
}

// The row partial of one chunk (16 lookups), summed over the 4 lanes of the row in a fixed order.
__device__ __forceinline__ float lookup_chunk(uint4 c, uint32_t tab, const uint32_t (&sw)[16], bool swap) {
  const uint32_t w[4] = {swap ? c.y : c.x, swap ? c.x : c.y, swap ? c.w : c.z, swap ? c.z : c.w};
  float acc[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) acc[s] = lds_f32(tab + prmt(w[0], sw[s], sw[s]));
#pragma unroll
  for (int s = 4; s < 16; ++s) acc[s & 3] += lds_f32(tab + prmt(w[s >> 2], sw[s], sw[s]));
  float v = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}

__global__ void __launch_bounds__(kThreads, 2) aqlm_2x8_kernel(const Params2x8 p) {
  trapetum_pdl::allow_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, j = lane & 3;
  const uint32_t tab = static_cast<uint32_t>(__cvta_generic_to_shared(trapetum_aqlm_smem));
  const uint32_t ring = tab + kTabBytes + (warp * kStage) * 512 + lane * 16;
  const uint64_t pol = evict_first_policy();
  uint32_t sw[16];
#pragma unroll
  for (int s = 0; s < 16; ++s) sw[s] = step_word(lane, s);
  const long long u1 = (long long)(blockIdx.x + 1) * p.units / gridDim.x;
  for (long long u = (long long)blockIdx.x * p.units / gridDim.x; u < u1;) {
    const Part2x8 P = part_of(p.part, p.nparts, u);
    int slice, oa, ob;
    next_segment(P, u, u1, &slice, &oa, &ob);
    u += ob - oa;
    const Lane2x8 l = {P.codes + slice * P.slice_stride + r * P.row_stride + 16 * j,
                       p.partial + P.partial0 + (size_t)slice * P.N, 8 * P.row_stride, P.N,
                       slice * kSlice + 8 * j < p.G};
    // ring slots of this lane: ring + d * 512 (each lane reads back only the 16 bytes it copied)
#pragma unroll
    for (int d = 0; d < kStage; ++d) copy_chunk(ring + d * 512, l, oa + warp + d * kWarps, ob, r, pol);
    __syncthreads();  // the previous segment's lookups are done: the table may be overwritten
    // the ring copies above read codes only (PDL: they may overlap the previous kernel); the table
    // needs x, and the partial sums may still be read by the previous GEMV's reduction until it ends
    trapetum_pdl::wait_inputs();
    build_table(p, reinterpret_cast<const half*>(P.cb), tab, slice, warp, lane);
    __syncthreads();
    int d = 0;
    int o = oa + warp;
    // two units per step: their 32 lookups and two shuffle trees are independent, which doubles the
    // loads in flight per warp (one unit per step left the kernel LDS-latency-bound at 16 warps per SM)
    for (; o + kWarps < ob; o += 2 * kWarps) {
      cp_async_wait<kStage - 2>();  // the two oldest groups (these slots) have landed
      const int d1 = d + 1 == kStage ? 0 : d + 1;
      const uint4 c0 = lds128(ring + d * 512), c1 = lds128(ring + d1 * 512);
      const float v0 = lookup_chunk(c0, tab, sw, r >= 4);
      const float v1 = lookup_chunk(c1, tab, sw, r >= 4);
      if (j == 0 && 8 * o + r < P.N) l.partial[8 * o + r] = v0;
      if (j == 0 && 8 * (o + kWarps) + r < P.N) l.partial[8 * (o + kWarps) + r] = v1;
      copy_chunk(ring + d * 512, l, o + kStage * kWarps, ob, r, pol);  // c0, c1 were consumed above
      copy_chunk(ring + d1 * 512, l, o + (kStage + 1) * kWarps, ob, r, pol);
      d = d1 + 1 == kStage ? 0 : d1 + 1;
    }
    if (o < ob) {  // an odd unit left
      cp_async_wait<kStage - 1>();
      const float v = lookup_chunk(lds128(ring + d * 512), tab, sw, r >= 4);
      if (j == 0 && 8 * o + r < P.N) l.partial[8 * o + r] = v;
    }
    cp_async_wait<0>();
  }
}

__global__ void __launch_bounds__(kThreads) aqlm_2x8_reduce_kernel(const Params2x8 p) {
  __shared__ float part_sums[4][kReduceRows];
  trapetum_pdl::allow_dependents();
  trapetum_pdl::wait_inputs();  // the partial sums of aqlm_2x8_kernel
  const int rl = threadIdx.x % kReduceRows, q = threadIdx.x / kReduceRows;
  const long long grow = (long long)blockIdx.x * kReduceRows + rl;
  const Part2x8 P = part_of_row(p.part, p.nparts, grow);
  const int row = int(grow - P.row0);
  const bool ok = row < P.N;
  const float* src = p.partial + P.partial0 + row;
  float acc = 0.f;
  if (ok) {
#pragma unroll 16
    for (int sl = q; sl < p.nslices; sl += 4) acc += __ldcg(src + (size_t)sl * P.N);
  }
  part_sums[q][rl] = acc;
  __syncthreads();
  if (q == 0 && ok) {
    const float v = (part_sums[0][rl] + part_sums[1][rl]) + (part_sums[2][rl] + part_sums[3][rl]);
    Epi::load(p.scales, p.bias, p.res, (int)grow, p.has_bias, p.has_res).store(p.y, (int)grow, v, p.has_bias, p.has_res);
  }
}

// ----------------------------------------------------------------------------- 1x16 kernel
constexpr int kRows16 = 4;  // rows per warp: one x load serves 4 gathers

struct Params1x16 {
  const half* x;          // [G * 8]
  const uint16_t* codes;  // [N, G]
  const uint4* cb;        // [65536] entries of 8 fp16
  const half* scales;
  const half* bias;
  const half* res;
  half* y;
  int N, G, ks_log2, has_bias, has_res;
};

__device__ __forceinline__ float dot8(uint4 e, const float (&xf)[8], float acc) {
  const uint32_t w[4] = {e.x, e.y, e.z, e.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    acc = fmaf(f.x, xf[2 * i], acc);
    acc = fmaf(f.y, xf[2 * i + 1], acc);
  }
  return acc;
}

// Sum over the 32 lanes (xor butterfly: every lane ends with the same, fixed-order sum).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

__global__ void __launch_bounds__(kThreads) aqlm_1x16_kernel(const Params1x16 p) {
  __shared__ float red[kWarps][kRows16];
  trapetum_pdl::allow_dependents();
  trapetum_pdl::wait_inputs();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ks = 1 << p.ks_log2, rs = warp >> p.ks_log2, kq = warp & (ks - 1);
  const int rows_per_block = kRows16 * (kWarps >> p.ks_log2);
  const int row0 = blockIdx.x * rows_per_block + rs * kRows16;
  const int nch = (p.G + 31) / 32;
  const uint16_t* crow[kRows16];
#pragma unroll
  for (int r = 0; r < kRows16; ++r) crow[r] = p.codes + (size_t)min(row0 + r, p.N - 1) * p.G;
  float acc[kRows16];
  uint32_t nxt[kRows16];
#pragma unroll
  for (int r = 0; r < kRows16; ++r) {
    acc[r] = 0.f;
    nxt[r] = (kq * 32 + lane < p.G) ? __ldcs(crow[r] + kq * 32 + lane) : 0u;
  }
  for (int c = kq; c < nch; c += ks) {
    const int g = c * 32 + lane, gn = g + 32 * ks;
    uint32_t cur[kRows16];
#pragma unroll
    for (int r = 0; r < kRows16; ++r) {
      cur[r] = nxt[r];
      nxt[r] = gn < p.G ? __ldcs(crow[r] + gn) : 0u;
    }
    if (g < p.G) {
      uint4 e[kRows16];
#pragma unroll
      for (int r = 0; r < kRows16; ++r) e[r] = __ldg(p.cb + cur[r]);
      const uint4 xv = trapetum_pdl::ld_input(reinterpret_cast<const uint4*>(p.x) + g);
      const uint32_t xw[4] = {xv.x, xv.y, xv.z, xv.w};
      float xf[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&xw[i]));
        xf[2 * i] = f.x;
        xf[2 * i + 1] = f.y;
      }
#pragma unroll
      for (int r = 0; r < kRows16; ++r) acc[r] = dot8(e[r], xf, acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows16; ++r) acc[r] = warp_sum(acc[r]);
  if (ks == 1) {
#pragma unroll
    for (int r = 0; r < kRows16; ++r)
      if (lane == r && row0 + r < p.N)
        Epi::load(p.scales, p.bias, p.res, row0 + r, p.has_bias, p.has_res).store(p.y, row0 + r, acc[r], p.has_bias,
                                                                                 p.has_res);
    return;
  }
  if (lane == 0)
#pragma unroll
    for (int r = 0; r < kRows16; ++r) red[warp][r] = acc[r];
  __syncthreads();
  if (threadIdx.x < rows_per_block) {
    const int rs2 = threadIdx.x / kRows16, r = threadIdx.x % kRows16;
    const int row = blockIdx.x * rows_per_block + threadIdx.x;
    float v = 0.f;
    for (int k = 0; k < ks; ++k) v += red[rs2 * ks + k][r];
    if (row < p.N)
      Epi::load(p.scales, p.bias, p.res, row, p.has_bias, p.has_res).store(p.y, row, v, p.has_bias, p.has_res);
  }
}
#endif  // __CUDACC__
}  // namespace trapetum_aqlm

#ifdef TRAPETUM_TORCH_LAUNCHER
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace trapetum_aqlm {
constexpr int kMaxDevices = 64;

static int sm_count(int dev) {
  static int cached[kMaxDevices] = {0};
  if (cached[dev] == 0) C10_CUDA_CHECK(cudaDeviceGetAttribute(&cached[dev], cudaDevAttrMultiProcessorCount, dev));
  return cached[dev];
}

// Resident 2x8 blocks per SM (shared memory and registers), after the one-time attribute setup.
static int max_blocks_2x8(int dev) {
  static int cached[kMaxDevices] = {0};
  if (cached[dev] == 0) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(aqlm_2x8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    C10_CUDA_CHECK(cudaFuncSetAttribute(aqlm_2x8_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&cached[dev], aqlm_2x8_kernel, kThreads, kSmemBytes));
    TORCH_CHECK(cached[dev] > 0, "aqlm 2x8: kernel does not fit on an SM");
  }
  return cached[dev];
}

static void set_1x16_attributes(int dev) {
  static bool done[kMaxDevices] = {false};
  if (!done[dev]) {  // as much L1 as possible for the codebook
    C10_CUDA_CHECK(cudaFuncSetAttribute(aqlm_1x16_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 0));
    done[dev] = true;
  }
}

static bool half_vec(const torch::Tensor& t, int64_t n) {
  return t.scalar_type() == at::kHalf && t.is_contiguous() && t.numel() == n;
}
static bool aligned(const torch::Tensor& t, int bytes) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0;
}

static void check_common(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& cb,
                         const torch::Tensor& scales, const torch::Tensor& bias, const torch::Tensor& res,
                         const torch::Tensor& y, int64_t has_bias, int64_t has_res) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 1 && half_vec(x, x.numel()), "x: contiguous fp16 [in]");
  TORCH_CHECK(codes.device() == x.device() && codes.is_contiguous() && codes.dim() == 3, "codes: [N, G, M]");
  TORCH_CHECK(cb.device() == x.device() && half_vec(cb, cb.numel()), "codebooks: contiguous fp16");
  const int64_t N = codes.size(0), G = codes.size(1);
  TORCH_CHECK(N >= 1 && G >= 1 && x.numel() == G * 8, "x: in_features != 8 * groups");
  TORCH_CHECK(half_vec(scales, N), "scales: fp16 [N]");
  TORCH_CHECK(half_vec(y, N), "y: contiguous fp16 [N]");
  TORCH_CHECK(!has_bias || half_vec(bias, N), "bias: fp16 [N]");
  TORCH_CHECK(!has_res || half_vec(res, N), "residual: fp16 [N]");
  TORCH_CHECK(N < (1LL << 31) / 8 && G < (1 << 24), "shape too large");
}
}  // namespace trapetum_aqlm

// meta: CPU int64 [P, 4], one row per part: (rows N, byte offset in codes[q], row stride, slice stride).
// codes: one byte buffer per part; cb: fp16 [P, 2, 256, 8]; scales, bias, res, y: [sum N].
void aqlm_gemv_2x8(torch::Tensor x, std::vector<torch::Tensor> codes, torch::Tensor cb, torch::Tensor scales, torch::Tensor bias,
                   torch::Tensor res, torch::Tensor y, torch::Tensor partial, torch::Tensor meta,
                   int64_t has_bias, int64_t has_res, int64_t blocks_per_sm) {
  using namespace trapetum_aqlm;
  TORCH_CHECK(x.is_cuda() && x.dim() == 1 && half_vec(x, x.numel()), "x: contiguous fp16 [in]");
  TORCH_CHECK(meta.device().is_cpu() && meta.scalar_type() == at::kLong && meta.is_contiguous() && meta.dim() == 2 &&
              meta.size(1) == 4 && meta.size(0) >= 1 && meta.size(0) <= kMaxParts, "meta: int64 [parts <= 4, 4] on the CPU");
  const int P = meta.size(0);
  const int64_t G = x.numel() / 8;
  TORCH_CHECK(x.numel() == G * 8 && G >= 1 && G % 8 == 0 && G < (1 << 24), "x: in_features must be a multiple of 64");
  TORCH_CHECK((int)codes.size() == P, "codes: one buffer per part");
  const uint8_t* cptr[kMaxParts];
  for (int q = 0; q < P; ++q) {
    TORCH_CHECK(codes[q].device() == x.device() && codes[q].is_contiguous() && codes[q].element_size() == 1 &&
                aligned(codes[q], 16), "codes: 16-byte aligned contiguous byte buffers on x's device");
    cptr[q] = reinterpret_cast<const uint8_t*>(codes[q].data_ptr());
  }
  TORCH_CHECK(cb.device() == x.device() && half_vec(cb, (int64_t)P * 2 * 256 * 8), "codebooks: fp16 [P, 2, 256, 8]");
  TORCH_CHECK(aligned(x, 4) && aligned(cb, 4), "alignment");
  const int64_t* m = meta.data_ptr<int64_t>();
  const int nslices = (int)((G + kSlice - 1) / kSlice);
  for (int q = 0; q < P; ++q) {
    const int64_t N = m[4 * q], off = m[4 * q + 1], rs = m[4 * q + 2], ss = m[4 * q + 3];
    TORCH_CHECK(N >= 1 && N < (1LL << 31) / 8, "meta: part rows");
    TORCH_CHECK(off >= 0 && off % 16 == 0 && rs > 0 && rs % 16 == 0 && ss > 0 && ss % 16 == 0, "meta: offsets and strides");
    const int64_t last_chunk = std::min<int64_t>(3, (G - 1 - (int64_t)(nslices - 1) * kSlice) / 8);
    const int64_t extent = off + (nslices - 1) * ss + (N - 1) * rs + 16 * last_chunk + 16;
    TORCH_CHECK(extent <= codes[q].numel(), "meta: part ", q, " reads past its codes buffer");
  }
  Params2x8 p;
  const PartTotals tot = fill_parts(p.part, P, reinterpret_cast<const long long*>(m), cptr, cb.data_ptr(), nslices);
  const int64_t rows = tot.rows, floats = tot.floats;
  TORCH_CHECK(rows < (1LL << 31), "too many rows");
  TORCH_CHECK(half_vec(scales, rows), "scales: fp16 [rows of all parts]");
  TORCH_CHECK(y.device() == x.device() && half_vec(y, rows), "y: contiguous fp16 [rows]");
  TORCH_CHECK(!has_bias || half_vec(bias, rows), "bias: fp16 [rows]");
  TORCH_CHECK(!has_res || half_vec(res, rows), "residual: fp16 [rows]");
  TORCH_CHECK(partial.scalar_type() == at::kFloat && partial.is_contiguous() && partial.numel() >= floats, "partial");
  const c10::cuda::CUDAGuard guard(x.device());
  const int dev = x.get_device();
  TORCH_CHECK(dev >= 0 && dev < kMaxDevices, "device index");
  const int bps = std::max(1, std::min<int>((int)blocks_per_sm, max_blocks_2x8(dev)));
  p.x = reinterpret_cast<const half*>(x.data_ptr<at::Half>());
  p.scales = reinterpret_cast<const half*>(scales.data_ptr<at::Half>());
  p.bias = has_bias ? reinterpret_cast<const half*>(bias.data_ptr<at::Half>()) : nullptr;
  p.res = has_res ? reinterpret_cast<const half*>(res.data_ptr<at::Half>()) : nullptr;
  p.y = reinterpret_cast<half*>(y.data_ptr<at::Half>());
  p.partial = partial.data_ptr<float>();
  p.nparts = P;
  p.G = (int)G;
  p.nslices = nslices;
  p.has_bias = (int)has_bias;
  p.has_res = (int)has_res;
  p.units = tot.units;
  const long long grid = std::min<long long>(p.units, (long long)bps * sm_count(dev));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  C10_CUDA_CHECK(trapetum_pdl::launch(aqlm_2x8_kernel, (unsigned)grid, kThreads, kSmemBytes, stream, p));
  C10_CUDA_CHECK(trapetum_pdl::launch(aqlm_2x8_reduce_kernel, (unsigned)((rows + kReduceRows - 1) / kReduceRows),
                                      kThreads, 0, stream, p));
}

// ks_log2 < 0: pick the k-split from the shape (enough warps to fill the GPU, >= 2 chunks per warp).
void aqlm_gemv_1x16(torch::Tensor x, torch::Tensor codes, torch::Tensor cb, torch::Tensor scales, torch::Tensor bias,
                    torch::Tensor res, torch::Tensor y, int64_t has_bias, int64_t has_res, int64_t ks_log2) {
  using namespace trapetum_aqlm;
  check_common(x, codes, cb, scales, bias, res, y, has_bias, has_res);
  const int N = codes.size(0), G = codes.size(1);
  TORCH_CHECK(codes.scalar_type() == at::kShort && codes.size(2) == 1 && cb.numel() == 65536 * 8, "1x16 layout");
  TORCH_CHECK(aligned(x, 16) && aligned(cb, 16), "x, codebook: 16-byte aligned");
  TORCH_CHECK(ks_log2 <= 3, "ks_log2");
  const c10::cuda::CUDAGuard guard(x.device());
  const int dev = x.get_device();
  TORCH_CHECK(dev >= 0 && dev < kMaxDevices, "device index");
  set_1x16_attributes(dev);
  int ks = (int)ks_log2;
  if (ks < 0) {
    const long long rowsets = (N + kRows16 - 1) / kRows16, want = 32LL * sm_count(dev);
    const int nch = (G + 31) / 32;
    ks = 0;
    while (ks < 3 && (rowsets << ks) < want && nch >= (4 << ks)) ++ks;
  }
  Params1x16 p;
  p.x = reinterpret_cast<const half*>(x.data_ptr<at::Half>());
  p.codes = reinterpret_cast<const uint16_t*>(codes.data_ptr());
  p.cb = reinterpret_cast<const uint4*>(cb.data_ptr<at::Half>());
  p.scales = reinterpret_cast<const half*>(scales.data_ptr<at::Half>());
  p.bias = has_bias ? reinterpret_cast<const half*>(bias.data_ptr<at::Half>()) : nullptr;
  p.res = has_res ? reinterpret_cast<const half*>(res.data_ptr<at::Half>()) : nullptr;
  p.y = reinterpret_cast<half*>(y.data_ptr<at::Half>());
  p.N = N;
  p.G = G;
  p.ks_log2 = ks;
  p.has_bias = (int)has_bias;
  p.has_res = (int)has_res;
  const int rows_per_block = kRows16 * (kWarps >> ks);
  const int grid = (N + rows_per_block - 1) / rows_per_block;
  C10_CUDA_CHECK(trapetum_pdl::launch(aqlm_1x16_kernel, grid, kThreads, 0, c10::cuda::getCurrentCUDAStream().stream(), p));
}
#endif  // TRAPETUM_TORCH_LAUNCHER
