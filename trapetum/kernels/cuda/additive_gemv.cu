// Additive-codebook (AQLM) GEMV for 1..16 activation rows: deterministic CUDA kernels for 2x8 and 1x16.
//
//   y[t, r] = scale[r] * sum_g x[t, 8g:8g+8] . (sum_m C_m[codes[r, g, m]])  (+ bias[r]) (+ residual[t, r])
//
// Canonical layout read as stored: codes [N, G, M] (int8 for 2x8, int16 for 1x16; the raw bits are
// the unsigned index), codebooks fp16 [M, K, 1, 8], scales fp16 [N]; x, y, residual [rows, *] contiguous.
// fp32 accumulation, sums in a fixed order, no atomics in any sum: bitwise reproducible, CUDA-graph
// capturable. Batch invariance: each activation row t of a launch gets exactly the bits a launch with
// that row alone gives, whatever the other rows hold (the 2x8 and 1x16 sections below say why).
//
// ---- 2x8 (M = 2 codebooks of 256 entries): shared-memory lookup tables, conflict-free lookups
// Work = (slice of 32 input groups) x (16 rows): a unit, 1 KB of codes. A block takes a contiguous
// range of units (slice-major, so a range covers one or two slices), builds the slice's table
//     lut[k][col] = x_g . C_m[k]   (fp32, 256 entries x 64 columns, one column per (group, codebook))
// in shared memory (64 KB) with mma.sync m16n8k8 (x is A, the codebooks are B), then streams codes:
// lane (r, j) = 4 r + j of a warp takes 16-byte chunk j (8 groups x 2 codebooks) of rows r and r + 8
// of its unit, copied by cp.async into a per-warp shared-memory ring (6 units in flight per warp, two
// 512-byte slots each) and read back by the lane that copied it. Each lane turns a code byte into a
// table address with one PRMT ((code << 8) | 4 * column), loads the entry (LDS [R + UR]: the table base
// folds in) and adds it: per code PRMT + LDS + FADD.
// Bank-conflict freedom: the column of byte p of chunk j is tab_col(j, p) = 16 j + (p ^ 4 (j >> 1)),
// so the bank (= column mod 32, whatever the code) is fixed by (chunk, byte); at step s lane (r, j)
// takes byte 4 ((s >> 2) ^ 2 half_swap(r)) + ((s + r) & 3) (a per-lane rotation: runtime PRMT selector;
// rows 2..5 hold their chunk's 8-byte halves swapped), which gives the 32 lanes 32 distinct banks at
// every step (tests/cuda/additive_2x8_host_check.cu checks every lane and step, and runs the kernels
// on the CPU). With random codes and one shared table instead, a warp's LDS costs ~3.2-3.5 wavefronts.
// The row sums: after its 16 lookups per chunk a lane holds chunk sums of rows r and r + 8; a
// transpose-reduce (one SHFL: even lanes keep row r and send row r + 8, odd lanes the reverse) and a
// butterfly (one SHFL) leave row r in lane j = 0 and row r + 8 in lane j = 1, summed in the same
// fixed order (v(0) + v(1)) + (v(2) + v(3)) for every row and layout.
// Partial sums per (slice, row) go to a workspace (rows padded to units, stored unconditionally); a
// second, small kernel adds each row's partials in a fixed order and applies scale, bias and residual,
// or for a gate/up pair writes act(gate) * up (act.cuh; one launch fewer than a separate activation kernel)
// (deterministic; no atomics, no fences: a block-tail reduction would leave the last blocks a long tail).
// Codes: two kernel instances. kPacked: the engine's "slices" layout, packed once at load (pack_2x8):
// [slice][row padded to 16][64 B], so that each block streams one contiguous range, with each unit's
// bytes permuted (packed_pos) so that a lane's 16 bytes per slot are already in the order its lookups
// and the transpose-reduce want: one LDS.128 per slot, no select, no predicate, constant strides.
// Canonical: any (row stride, slice stride) layout read as stored (two LDS.64 per slot, 2 FSEL, rows
// past N and chunks past G not copied). One launch can cover up to 4 projections sharing x (q/k/v,
// gate/up), each with its own codebooks. Main loop: a steady state of 3 units per iteration whose
// refills lie inside the segment (ring, code and partial offsets are immediates, the trip count is
// warp-uniform: no divergence checks around the shuffles), then the segment's last units with
// checked refills.
//
// Budget per unit (1,024 codes = 8,192 weights, 1 KB of codes), per SM:
//   DRAM: 1 KB (0.25 B/weight; cuBLAS fp16 reads 2 B/weight: 8x fewer bytes). At 4 TB/s an SM must
//     take 16.8 code bytes/cycle: a unit per ~61 cycles.
//   Shared-memory wavefronts: 32 lookups (1 each) + 2 LDS.128 ring reads (4 each) + 1 KB of cp.async
//     writes (8) = 48: 0.79 wavefronts/cycle (of 1) at 4 TB/s.
//   Issue (SASS, sm_90, NOTES-additive.md): the packed steady loop takes ~110 instructions per unit
//     (94 of them the lookups' PRMT + LDS + FADD; the rest: 2 LDS.128, 2 SHFL + 2 FADD, 1 STG, 2 LDGSTS
//     + 2 cp.async group instructions, addresses and loop): 1.8 of 4 warp-instructions/cycle at 4 TB/s.
//     ~128 registers, no spills, 2 blocks (16 warps) per SM.
//   Table build per slice: 128 mma, 64 KB of conflict-free STS (512 wavefronts), 128 x 32-bit B
//     loads, amortised over the block's rows (a block covers >= ~500 rows of a slice at large shapes).
// Several activation rows (verify): block i of the launch takes code range b = i / rows for activation
// row t = i % rows (t fastest, so the blocks reading one code range run together and all but the first
// find its codes in L2); ranges split the units as a launch of one row does, each block builds its own
// row's table. A block of row t therefore runs exactly the instructions, on exactly the data, that the
// same range's block of a one-row launch runs on x[t] (the partial sums do not depend on the split
// anyway), and the reduction kernel runs per (row block, t): every row's bits are the one-row launch's.
// Cost: rows x the one-row lookups (the shared-memory floor is 32 lookups per unit per activation row;
// NOTES-additive.md has the floor of any exact multi-row design and what a faster one needs).
//
// ---- 1x16 (one codebook of 65,536 entries = 1 MiB, stays in L2/L1): gathers
// A warp owns 4 rows and a share of the input groups (lane l takes group 32 c + l of chunk c, so
// x loads are coalesced and reused by the 4 rows); per group it gathers the 16-byte entry
// (LDG.128 through L1) and does 8 fp32 FMAs. Warps of a block split the groups when there are few
// rows (k-split, partials added in warp order). Budget per 8 weights: one 16-byte gather = one L1
// wavefront (a random 128-B line per lane), + 1/32 for the code load and 1/32 for x: the L1 pipe
// caps the kernel near 132 SMs x 1.8 GHz x 8 / 1.06 = 1.8e12 weights/s, about 0.85x of cuBLAS fp16
// at 4.3 TB/s; the L2 is the limit first (each 16-byte gather costs a 32-byte L2 sector).
// Several activation rows: a template on the row bucket kM (1, 2, 4, 8, 16; rows past the call's are
// computed on its last row and not stored): each gathered entry is used for all rows (x loads: kM per
// group, from L1). Per (row, activation row) a lane adds its groups in the same order with the same
// fmaf chain, the warp and k-split sums are the same, the k-split depends on the shape only: every
// activation row gets the one-row bits (fp32 sums written with explicit fmaf / __fadd_rn / __fmul_rn,
// so that no instance contracts differently).
#include "pdl.cuh"
#include "act.cuh"
#include <cuda_fp16.h>
#include <stdint.h>

// Dynamic shared memory: the 2x8 lookup table (named at file scope so its address is a constant).
// TRAPETUM_AQLM_EMU: tests/cuda/additive_2x8_host_check.cu runs the 2x8 kernels on the CPU, one
// coroutine per thread, with its own versions of this array and of the device helpers below.
#ifndef TRAPETUM_AQLM_EMU
extern __shared__ __align__(16) uint32_t trapetum_aqlm_smem[];
#endif

namespace trapetum_aqlm {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// ----------------------------------------------------------------------------- 2x8 lane maps
// (host + device: tests/cuda/additive_2x8_host_check.cu runs these same functions on the CPU)
constexpr int kSlice = 32;                   // input groups per slice
constexpr int kSliceBytes = 2 * kSlice;      // code bytes of one row in one slice
constexpr int kCols = 2 * kSlice;            // table columns: one per (group, codebook)
constexpr int kTabBytes = 256 * kCols * 4;   // 64 KB
// A unit of work = 16 rows of one slice (1 KB of codes), one loop step of a warp: lane (r, j) = lane
// 4 r + j (r = 0..7, j = 0..3) takes 16-byte chunk j (groups 8j..8j+7) of rows r and r + 8, each
// copied by cp.async into one of the unit's two 512-byte ring slots (lane l's bytes at 16 l of a slot)
// and read back by the lane that copied it.
constexpr int kUnitRows = 16;
constexpr int kUnitBytes = kUnitRows * kSliceBytes;
// Units in flight per warp: a shared-memory ring filled by cp.async (no registers held), 6 x 1 KB per
// warp = 48 KB per block, 96 KB per SM (2 blocks): enough bytes in flight for DRAM bandwidth.
constexpr int kRing = 6;
constexpr int kRingBytes = kWarps * kRing * kUnitBytes;
constexpr int kSmemBytes = kTabBytes + kRingBytes;  // 112 KB: two blocks per SM
constexpr int kTiles = 2 * 256 / 8;          // mma n-tiles per slice (8 (codebook, entry) columns each)

// Column of code byte p (0..15) of chunk j (0..3); chunk j = groups 8j..8j+7, byte p = 2 (g - 8j) + m.
__host__ __device__ constexpr int tab_col(int j, int p) { return 16 * j + (p ^ (4 * (j >> 1))); }
__host__ __device__ constexpr int tab_col_of(int gl, int m) { return tab_col(gl >> 3, 2 * (gl & 7) + m); }
// Lanes of rows r = 2..5 hold their chunks with the two 8-byte halves swapped (words 2, 3, 0, 1).
// Why: rows r and r + 4 look up the same byte of a word at every step, so they must differ here (bank
// freedom, below); rows r and r + 2 differ too, so that the canonical layout's two LDS.64 per slot
// (ring_half) give each half-warp (rows 0..3 or 4..7) 16 distinct 8-byte bank pairs.
__host__ __device__ constexpr int half_swap(int r) { return ((r >> 1) ^ (r >> 2)) & 1; }
// Byte offset, in lane l's 16 bytes of a ring slot, of the 8 bytes that are its words 2h, 2h + 1 (h = 0, 1)
// when the slot holds the chunk as stored in the canonical layout.
__host__ __device__ constexpr int ring_half(int lane, int h) { return 8 * (h ^ half_swap(lane >> 2)); }
// Code byte that lane (row r, chunk j) looks up at step s (0..15): byte (s + r) & 3 of its word s >> 2,
// which holds chunk word (s >> 2) ^ 2 half_swap(r).
__host__ __device__ constexpr int step_byte(int r, int s) {
  return 4 * ((s >> 2) ^ (2 * half_swap(r))) + ((s + r) & 3);
}
// Bank freedom of a lookup step (the host check tests every step): the bank of a lookup is tab_col mod
// 32 = 16 (j & 1) + (p ^ 4 (j >> 1)), whatever the code. Lanes j and j + 2 share a 16-bank half and
// differ by the XOR with 4, so the 8 rows must give 8 distinct (p >> 3, p & 3), p = 4 word + byte:
// rows r and r + 4 (the same byte (s + r) & 3) take words that differ in bit 1 (half_swap).
// PRMT operand of step s, used as both the selector and the second source: selector (low 16 bits)
// = result byte 0 <- this word's byte 2 (4 * column < 256), byte 1 <- code byte (s + r) & 3 of the
// lane's word s >> 2, bytes 2, 3 <- this word's byte 3 (0). Result: (code << 8) | 4 * column.
__host__ __device__ constexpr uint32_t step_word(int lane, int s) {
  return 0x7706u | (uint32_t((s + (lane >> 2)) & 3) << 4) |
         (4u * uint32_t(tab_col(lane & 3, step_byte(lane >> 2, s))) << 16);
}
// The packed ("slices") layout of a unit: byte b (0..63) of unit row rr (0..15) is stored at byte
// packed_pos(rr, b) of the unit's 1 KB, which is what lane (r, j) copies into ring slot e as 16 bytes:
//   slot e = (rr >> 3) ^ (j & 1): odd chunks of rows r and r + 8 trade places, so that odd lanes find
//     row r + 8 in slot 0 and row r in slot 1 (the transpose-reduce of unit_sums needs no select);
//   within the chunk, halves swapped for rows 2..5 (half_swap): one LDS.128 gives the lane's words.
__host__ __device__ constexpr int packed_pos(int rr, int b) {
  return 512 * ((rr >> 3) ^ ((b >> 4) & 1)) + 64 * (rr & 7) + 16 * (b >> 4) + ((b & 15) ^ (8 * half_swap(rr & 7)));
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
// with its own codebooks, rows and code layout. Part q's units are (slice, 16-row group) pairs numbered
// slice-major from units0; a byte of row r, slice s sits at codes + s * slice_stride + r * row_stride:
//   "slices" layout (the kernel's, packed once at load; kernel instance kPacked = true): [slice][row
//     (padded to 16)][64 bytes] with each unit's bytes permuted by packed_pos; row_stride = 64,
//     slice_stride = 64 * 16 * groups: a block's unit range is one contiguous stream; the padding rows
//     and the bytes past G are zeros, read like the others;
//   canonical layout [row][group][2] (kPacked = false): row_stride = 2 G, slice_stride = 64 (64-byte
//     pieces, 2 G apart), read as stored: rows past N and chunks past G are not copied.
// All parts of a launch share one layout (the launcher checks it).
// Partial sums of part q: partial[partial0 + slice * 16 groups + row] (rows padded to whole units, so
// that the main loop stores every row of its units unconditionally; the padding rows are never read;
// added by aqlm_2x8_reduce_kernel); outputs, scales, bias and residual: index row0 + row.
constexpr int kMaxParts = 4;
constexpr int kMetaCols = 5;  // launcher meta per part: N, byte offset, row stride, slice stride, packed (0/1)
struct Part2x8 {
  const uint8_t* codes;
  const void* cb;          // fp16 [2, 256, 8]
  long long row_stride;    // bytes
  long long slice_stride;  // bytes
  long long units0;        // first unit of this part
  long long partial0;      // first partial float of this part
  int N, row0, groups;     // groups: units per slice, ceil(N / 16)
};

// The part that owns unit u (parts are few: a select chain, no dynamic indexing of the parameter).
__host__ __device__ inline Part2x8 part_of(const Part2x8 (&parts)[kMaxParts], int nparts, long long u) {
  Part2x8 P = parts[0];
#pragma unroll
  for (int q = 1; q < kMaxParts; ++q)
    if (q < nparts && u >= parts[q].units0) P = parts[q];
  return P;
}
// Units [u, u1) of part P: the next segment (one slice of one part, row groups [ga, gb)).
__host__ __device__ inline void next_segment(const Part2x8& P, long long u, long long u1, int* slice, int* ga,
                                             int* gb) {
  const long long lu = u - P.units0;
  *slice = int(lu / P.groups);
  *ga = int(lu - (long long)(*slice) * P.groups);
  const long long end = P.units0 + (long long)(*slice) * P.groups + P.groups;
  *gb = int((u1 < end ? u1 : end) - P.units0 - (long long)(*slice) * P.groups);
}

// Totals of a launch's parts (filled by fill_parts).
struct PartTotals {
  long long units = 0, rows = 0, floats = 0;
};
// Host: part q from meta row (rows N, byte offset into codes[q], row stride, slice stride, layout; the
// layout column is the launcher's business); unused slots never own a unit.
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
    P.N = (int)meta[kMetaCols * q];
    P.codes = codes[q] + meta[kMetaCols * q + 1];
    P.row_stride = meta[kMetaCols * q + 2];
    P.slice_stride = meta[kMetaCols * q + 3];
    P.cb = static_cast<const uint16_t*>(cb) + (size_t)q * 2 * 256 * 8;
    P.units0 = t.units;
    P.partial0 = t.floats;
    P.row0 = (int)t.rows;
    P.groups = (P.N + kUnitRows - 1) / kUnitRows;
    t.units += (long long)nslices * P.groups;
    t.floats += (long long)nslices * kUnitRows * P.groups;
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

#if defined(__CUDACC__) || defined(TRAPETUM_AQLM_EMU)
#ifndef TRAPETUM_AQLM_EMU
// ----------------------------------------------------------------------------- device helpers
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
// 16 bytes global -> shared, asynchronous, L2 only, evict-first.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint64_t pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(src), "l"(pol) : "memory");
}
// The same if ok (one predicated LDGSTS; nothing is written to the slot otherwise).
__device__ __forceinline__ void cp_async16_if(uint32_t dst, const void* src, bool ok, uint64_t pol) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n"
               " @p cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n}\n"
               :: "r"(dst), "l"(src), "l"(pol), "r"((int)ok) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
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
#endif  // !TRAPETUM_AQLM_EMU

// Epilogue of one output row: y = acc * scale (+ bias) (+ residual), rounded once to fp16 (explicit
// roundings: never contracted to an FMA, the same bits in every kernel instance). The inputs are loaded
// first (Epi::load) so that their latency overlaps the accumulation.
__device__ __forceinline__ float scale_bias(float acc, float scale, int has_bias, float bias) {
  const float v = __fmul_rn(acc, scale);
  return has_bias ? __fadd_rn(v, bias) : v;
}
struct Epi {
  float scale, bias, res;
  __device__ __forceinline__ static Epi load(const half* __restrict__ scales, const half* __restrict__ bias,
                                             const half* res, int row, int has_bias, int has_res) {
    return {__half2float(scales[row]), has_bias ? __half2float(bias[row]) : 0.f,
            has_res ? trapetum_pdl::ld_input_half(res + row) : 0.f};
  }
  __device__ __forceinline__ void store(half* __restrict__ y, int row, float acc, int has_bias, int has_res) const {
    const float v = scale_bias(acc, scale, has_bias, bias);
    y[row] = __float2half_rn(has_res ? __fadd_rn(v, res) : v);
  }
};

// ----------------------------------------------------------------------------- 2x8 kernel
constexpr int kMaxRows = 16;  // activation rows per launch
struct Params2x8 {
  const half* x;          // [rows, G * 8]
  const half* scales;     // [rows of all parts]
  const half* bias;       // [rows of all parts] or unused
  const half* res;        // [rows, rows of all parts] or unused
  half* y;                // [rows, rows of all parts] ([rows, N] with act)
  float* partial;         // [rows][floats]: per part [nslices, 16 groups] (rows padded to whole units)
  Part2x8 part[kMaxParts];
  int nparts, G, nslices, has_bias, has_res;
  long long units;        // all parts
  // 0: y[t, row] = each row's epilogue. 1 (SiLU) / 2 (GELU-tanh): a gate/up pair (2 parts of N rows):
  // y[t, f] = act(gate[t, f]) * up[t, f] for f < N, gate and up rounded to fp16 first (as the unfused path)
  int act = 0;
  int rows = 1;           // activation rows (blocks i of the main kernel: range i / rows, row i % rows)
  long long floats = 0;   // partial floats per activation row (PartTotals::floats)
  long long y_stride = 0, res_stride = 0;  // elements between activation rows of y and res (x: 8 G)
};

// lut[k][col] for the 32 groups of `slice` of the activation row x (groups >= G get x = 0, hence zero entries).
__device__ void build_table(const Params2x8& p, const half* x, const half* cb, uint32_t tab, int slice, int warp,
                            int lane) {
  const int gid = lane >> 2, t = lane & 3;
  uint32_t a[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int g = slice * kSlice + 16 * mt + 8 * hh + gid;
      a[mt][hh] = g < p.G ? trapetum_pdl::ld_input(reinterpret_cast<const uint32_t*>(x + (size_t)g * 8 + 2 * t)) : 0u;
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

// ---- main loop. A warp takes the units g = ga + warp + i kWarps (i = 0, 1, ..) of a segment (rows
// 16 g .. 16 g + 15 of the slice); unit i lives in ring entry i mod kRing (two 512-byte slots). One loop
// step takes one unit (32 independent lookups per lane), then refills its entry with unit i + kRing
// (one cp.async commit group per unit, kRing groups in flight).
constexpr int kSteady = 3;  // steps per loop iteration (half the ring: ring offsets are immediates)
static_assert(kRing % kSteady == 0, "the steady loop's iterations must tile the ring");

// Steps from unit g (a warp's next unit) whose refills (g + kRing kWarps, then every kWarps) lie below lim.
__host__ __device__ constexpr int steady_steps(int g, int lim) {
  return lim - g - kRing * kWarps > 0 ? (lim - g - kRing * kWarps + kWarps - 1) / kWarps : 0;
}

// The lane's 4 code words in a ring slot: word k = chunk word k ^ 2 half_swap(r). Packed layout: one
// LDS.128 at a0 (stored that way); canonical: words 0, 1 from a0 = slot + ring_half(lane, 0) and 2, 3
// from a1 = slot + ring_half(lane, 1) (two LDS.64, each half-warp's 16 lanes on 16 distinct bank pairs).
template <bool kPacked>
__device__ __forceinline__ void slot_words(uint32_t a0, uint32_t a1, uint32_t (&w)[4]) {
  if (kPacked) {
    const uint4 c = lds128(a0);
    w[0] = c.x, w[1] = c.y, w[2] = c.z, w[3] = c.w;
  } else {
    const uint2 lo = lds64(a0), hi = lds64(a1);
    w[0] = lo.x, w[1] = lo.y, w[2] = hi.x, w[3] = hi.y;
  }
}

// This lane's sum of the 16 lookups of one chunk: 4 interleaved chains, then (a0 + a1) + (a2 + a3).
__device__ __forceinline__ float lane_sum(const uint32_t (&w)[4], uint32_t tab, const uint32_t (&sw)[16]) {
  float acc[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) acc[s] = lds_f32(tab + prmt(w[0], sw[s], sw[s]));
#pragma unroll
  for (int s = 4; s < 16; ++s) acc[s & 3] += lds_f32(tab + prmt(w[s >> 2], sw[s], sw[s]));
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// Row sums of one unit (ring slots at a0/a1 and a0/a1 + 512), transpose-reduced over the 4 lanes j of
// each row pair (r, r + 8): even lanes keep their row-r chunk sum and send the row-(r + 8) one to lane
// j ^ 1, odd lanes the other way round (one SHFL and one FADD for both rows), then a butterfly over
// j ^ 2. Lane j = 0 ends with row r's sum, lane j = 1 with row r + 8's (j = 2, 3: copies), both added as
// (v(0) + v(1)) + (v(2) + v(3)) over the chunks j (fp32 addition is commutative). Packed layout: odd
// lanes find row r + 8 in slot 0 (packed_pos), so every lane keeps slot 0's sum; canonical: odd lanes
// select (2 FSEL).
template <bool kPacked>
__device__ __forceinline__ float unit_sums(uint32_t a0, uint32_t a1, uint32_t tab, const uint32_t (&sw)[16],
                                           bool odd) {
  uint32_t w0[4], w1[4];
  slot_words<kPacked>(a0, a1, w0);
  slot_words<kPacked>(a0 + 512, a1 + 512, w1);
  const float v0 = lane_sum(w0, tab, sw), v1 = lane_sum(w1, tab, sw);
  const bool swap = !kPacked && odd;
  float h = (swap ? v1 : v0) + __shfl_xor_sync(0xffffffffu, swap ? v0 : v1, 1);
  h += __shfl_xor_sync(0xffffffffu, h, 2);
  return h;
}

template <bool kPacked>
__global__ void __launch_bounds__(kThreads, 2) aqlm_2x8_kernel(const Params2x8 p) {
  trapetum_pdl::allow_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, j = lane & 3;
  const uint32_t tab = static_cast<uint32_t>(__cvta_generic_to_shared(trapetum_aqlm_smem));
  const uint32_t ring = tab + kTabBytes + warp * (kRing * kUnitBytes) + lane * 16;  // entry 0, slot 0
  const uint32_t half0 = kPacked ? 0u : ring_half(lane, 0), half1 = kPacked ? 0u : ring_half(lane, 1);
  const uint32_t ring_toggle = ring ^ (ring + kSteady * kUnitBytes);  // the loop's two entry bases
  const uint64_t pol = evict_first_policy();
  uint32_t sw[16];
#pragma unroll
  for (int s = 0; s < 16; ++s) sw[s] = step_word(lane, s);
  const bool odd = j & 1, stores = j < 2;
  // activation row t, code range b of nb (module header: several rows)
  const int t = (int)(blockIdx.x % (unsigned)p.rows);
  const long long b = blockIdx.x / (unsigned)p.rows, nb = gridDim.x / (unsigned)p.rows;
  const half* const x = p.x + (size_t)t * 8 * p.G;
  float* const partial = p.partial + (size_t)t * p.floats;
  const long long u1 = (b + 1) * p.units / nb;
  for (long long u = b * p.units / nb; u < u1;) {
    const Part2x8 P = part_of(p.part, p.nparts, u);
    int slice, ga, gb;
    next_segment(P, u, u1, &slice, &ga, &gb);
    u += gb - ga;
    // This lane copies, for unit g, the 16 bytes at src + g gstride into slot 0 and those at
    // src + g gstride + hstride into slot 1: packed, its bytes of the unit's 1 KB (packed_pos); canonical,
    // chunk j of rows 16 g + r and 16 g + 8 + r, except rows past N and chunks past G (the slot keeps
    // older codes: past G they look up table columns of x = 0, past N they give a padding row's sum).
    const long long gstride = kPacked ? kUnitBytes : kUnitRows * P.row_stride;
    const long long hstride = kPacked ? 512 : 8 * P.row_stride;
    const uint8_t* const src = P.codes + slice * P.slice_stride + r * P.row_stride + 16 * j;
    const bool chunk_ok = kPacked || slice * kSlice + 8 * j < p.G;
    const int rows = kPacked ? kUnitRows * P.groups : P.N;
    // the partial this lane stores for unit g: dst[16 g] (row r for j = 0, row r + 8 for j = 1)
    float* const dst = partial + P.partial0 + (size_t)slice * kUnitRows * P.groups + r + 8 * (j & 1);
    int g = ga + warp;
#pragma unroll
    for (int d = 0; d < kRing; ++d) {
      const int gd = g + d * kWarps;
      const uint8_t* sd = src + gd * gstride;
      cp_async16_if(ring + d * kUnitBytes, sd, gd < gb && 16 * gd + r < rows && chunk_ok, pol);
      cp_async16_if(ring + d * kUnitBytes + 512, sd + hstride, gd < gb && 16 * gd + 8 + r < rows && chunk_ok,
                    pol);
      cp_async_commit();
    }
    __syncthreads();  // the previous segment's lookups are done: the table may be overwritten
    // the ring copies above read codes only (PDL: they may overlap the previous kernel); the table
    // needs x, and the partial sums may still be read by the previous GEMV's reduction until it ends
    trapetum_pdl::wait_inputs();
    build_table(p, x, reinterpret_cast<const half*>(P.cb), tab, slice, warp, lane);
    __syncthreads();
    // The loop, kSteady units per iteration: ring entries, refill sources and partials advance by
    // constants, so their offsets within an iteration are immediates. Unit k of an iteration: ring entry
    // entry + k, partial t[16 k kWarps], refill (unit g + (kRing + k) kWarps) from s + k kWarps gstride.
    uint32_t entry = ring;
    const uint8_t* s = src + (g + kRing * kWarps) * gstride;
    float* t = dst + kUnitRows * g;
    const auto step = [&](int k, bool ok0, bool ok1) {
      cp_async_wait<kRing - 1>();  // this unit's group has landed
      const uint32_t e = entry + k * kUnitBytes;
      const float h = unit_sums<kPacked>(e + half0, e + half1, tab, sw, odd);
      if (stores) t[k * kWarps * kUnitRows] = h;
      const uint8_t* sk = s + k * kWarps * gstride;  // refill: the entry's words were read above
      cp_async16_if(e, sk, ok0, pol);
      cp_async16_if(e + 512, sk + hstride, ok1, pol);
      cp_async_commit();
    };
    const auto advance = [&] {
      entry ^= ring_toggle;
      s += kSteady * kWarps * gstride;
      t += kSteady * kWarps * kUnitRows;
      g += kSteady * kWarps;
    };
    // Trip counts go through redux.sync (every lane holds the same value): ptxas then knows the loops are
    // warp-uniform and drops its divergence checks (BRA.DIV + WARPSYNC paths) around the shuffles.
    // Steady state: every refill lies inside the segment (canonical: and inside the whole units of N
    // rows): no predicates (packed).
    const int lim = kPacked ? gb : min(gb, P.N / kUnitRows);
#pragma unroll 1
    for (int it = (int)__reduce_max_sync(0xffffffffu, (unsigned)(steady_steps(g, lim) / kSteady)); it > 0; --it) {
#pragma unroll
      for (int k = 0; k < kSteady; ++k) step(k, chunk_ok, chunk_ok);
      advance();
    }
    // The segment's last units (at most kRing + kSteady): the same steps, refills checked one by one.
#pragma unroll 1
    for (int n = (int)__reduce_max_sync(0xffffffffu, (unsigned)(max(0, gb - g + kWarps - 1) / kWarps)); n > 0;) {
#pragma unroll
      for (int k = 0; k < kSteady && n > 0; ++k, --n) {
        const int gc = g + (kRing + k) * kWarps;  // packed: every row of a unit is there
        const bool ok = gc < gb && chunk_ok;
        step(k, ok && (kPacked || 16 * gc + r < rows), ok && (kPacked || 16 * gc + 8 + r < rows));
      }
      advance();
    }
    cp_async_wait<0>();
  }
}

// Thread quarter q's share of one row's partial sums: slices q, q + 4, q + 8, .. in order.
__device__ __forceinline__ float quarter_sum(const float* partial, int nslices, const Part2x8& P, int row, int q) {
  const float* src = partial + P.partial0 + row;
  float acc = 0.f;
#pragma unroll 16
  for (int sl = q; sl < nslices; sl += 4) acc += __ldcg(src + (size_t)sl * kUnitRows * P.groups);
  return acc;
}

// Grid (row blocks, activation rows): block (i, t) reduces rows 64 i .. 64 i + 63 of activation row t.
__global__ void __launch_bounds__(kThreads) aqlm_2x8_reduce_kernel(const Params2x8 p) {
  __shared__ float part_sums[2][4][kReduceRows];
  trapetum_pdl::allow_dependents();
  trapetum_pdl::wait_inputs();  // the partial sums of aqlm_2x8_kernel
  const int rl = threadIdx.x % kReduceRows, q = threadIdx.x / kReduceRows, t = blockIdx.y;
  const float* const partial = p.partial + (size_t)t * p.floats;
  half* const y = p.y + (size_t)t * p.y_stride;
  const long long grow = (long long)blockIdx.x * kReduceRows + rl;
  if (p.act) {  // gate/up pair: row f of part 0 (gate) and row f of part 1 (up)
    const int f = (int)grow;
    const bool ok = f < p.part[0].N;
    part_sums[0][q][rl] = ok ? quarter_sum(partial, p.nslices, p.part[0], f, q) : 0.f;
    part_sums[1][q][rl] = ok ? quarter_sum(partial, p.nslices, p.part[1], f, q) : 0.f;
    __syncthreads();
    if (q == 0 && ok) {
      float gu[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = f + i * p.part[0].N;
        const float v = (part_sums[i][0][rl] + part_sums[i][1][rl]) + (part_sums[i][2][rl] + part_sums[i][3][rl]);
        gu[i] = __half2float(__float2half_rn(
            scale_bias(v, __half2float(p.scales[row]), p.has_bias, p.has_bias ? __half2float(p.bias[row]) : 0.f)));
      }
      y[f] = __float2half_rn(__fmul_rn(trapetum_act::apply(p.act, gu[0]), gu[1]));
    }
    return;
  }
  const Part2x8 P = part_of_row(p.part, p.nparts, grow);
  const int row = int(grow - P.row0);
  const bool ok = row < P.N;
  part_sums[0][q][rl] = ok ? quarter_sum(partial, p.nslices, P, row, q) : 0.f;
  __syncthreads();
  if (q == 0 && ok) {
    const float v = (part_sums[0][0][rl] + part_sums[0][1][rl]) + (part_sums[0][2][rl] + part_sums[0][3][rl]);
    const half* res = p.has_res ? p.res + (size_t)t * p.res_stride : p.res;
    Epi::load(p.scales, p.bias, res, (int)grow, p.has_bias, p.has_res).store(y, (int)grow, v, p.has_bias, p.has_res);
  }
}

#ifndef TRAPETUM_AQLM_EMU
// ----------------------------------------------------------------------------- 1x16 kernel
constexpr int kRows16 = 4;  // rows per warp: one x load serves 4 gathers

struct Params1x16 {
  const half* x;          // [rows, G * 8]
  const uint16_t* codes;  // [N, G]
  const uint4* cb;        // [65536] entries of 8 fp16
  const half* scales;
  const half* bias;
  const half* res;        // [rows, N]
  half* y;                // [rows, N]
  int N, G, ks_log2, has_bias, has_res, rows;
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
  for (int m = 16; m >= 1; m >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}
__device__ __forceinline__ void store_1x16(const Params1x16& p, int t, int row, float v) {
  Epi::load(p.scales, p.bias, p.res + (size_t)t * p.N, row, p.has_bias, p.has_res)
      .store(p.y + (size_t)t * p.N, row, v, p.has_bias, p.has_res);
}

// kM: activation-row bucket (p.rows <= kM; rows past p.rows repeat the last one and are not stored).
template <int kM>
__global__ void __launch_bounds__(kThreads) aqlm_1x16_kernel(const Params1x16 p) {
  __shared__ float red[kWarps][kRows16][kM];
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
  const uint4* xrow[kM];
#pragma unroll
  for (int t = 0; t < kM; ++t)
    xrow[t] = reinterpret_cast<const uint4*>(p.x + (size_t)(kM == 1 ? 0 : min(t, p.rows - 1)) * 8 * p.G);
  float acc[kRows16][kM];
  uint32_t nxt[kRows16];
#pragma unroll
  for (int r = 0; r < kRows16; ++r) {
#pragma unroll
    for (int t = 0; t < kM; ++t) acc[r][t] = 0.f;
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
      uint4 e[kRows16];  // gathered once for every activation row
#pragma unroll
      for (int r = 0; r < kRows16; ++r) e[r] = __ldg(p.cb + cur[r]);
#pragma unroll
      for (int t = 0; t < kM; ++t) {
        const uint4 xv = trapetum_pdl::ld_input(xrow[t] + g);
        const uint32_t xw[4] = {xv.x, xv.y, xv.z, xv.w};
        float xf[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&xw[i]));
          xf[2 * i] = f.x, xf[2 * i + 1] = f.y;
        }
#pragma unroll
        for (int r = 0; r < kRows16; ++r) acc[r][t] = dot8(e[r], xf, acc[r][t]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows16; ++r)
#pragma unroll
    for (int t = 0; t < kM; ++t) acc[r][t] = warp_sum(acc[r][t]);
  if (ks == 1) {
#pragma unroll
    for (int t = 0; t < kM; ++t)
#pragma unroll
      for (int r = 0; r < kRows16; ++r)
        if (lane == r && t < p.rows && row0 + r < p.N) store_1x16(p, t, row0 + r, acc[r][t]);
    return;
  }
  if (lane == 0)
#pragma unroll
    for (int r = 0; r < kRows16; ++r)
#pragma unroll
      for (int t = 0; t < kM; ++t) red[warp][r][t] = acc[r][t];
  __syncthreads();
  for (int i = threadIdx.x; i < rows_per_block * kM; i += kThreads) {  // (block row, activation row t)
    const int t = i / rows_per_block, br = i % rows_per_block, rs2 = br / kRows16, r = br % kRows16;
    const int row = blockIdx.x * rows_per_block + br;
    float v = 0.f;
    for (int k = 0; k < ks; ++k) v = __fadd_rn(v, red[rs2 * ks + k][r][t]);
    if (row < p.N && t < p.rows) store_1x16(p, t, row, v);
  }
}
#endif  // !TRAPETUM_AQLM_EMU
#endif  // __CUDACC__ || TRAPETUM_AQLM_EMU
}  // namespace trapetum_aqlm

#ifdef TRAPETUM_SASS_ONLY
// Both instances of the 2x8 kernel (and two 1x16 buckets) for `nvcc -cubin` + cuobjdump (NOTES-additive.md);
// the torch launcher instantiates them otherwise.
template __global__ void trapetum_aqlm::aqlm_2x8_kernel<true>(const trapetum_aqlm::Params2x8);
template __global__ void trapetum_aqlm::aqlm_2x8_kernel<false>(const trapetum_aqlm::Params2x8);
template __global__ void trapetum_aqlm::aqlm_1x16_kernel<1>(const trapetum_aqlm::Params1x16);
template __global__ void trapetum_aqlm::aqlm_1x16_kernel<8>(const trapetum_aqlm::Params1x16);
#endif

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

// Resident 2x8 blocks per SM (shared memory and registers) of one kernel instance, after its one-time
// attribute setup.
template <bool kPacked>
static int max_blocks_2x8(int dev) {
  static int cached[kMaxDevices] = {0};
  if (cached[dev] == 0) {
    auto* kern = aqlm_2x8_kernel<kPacked>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&cached[dev], kern, kThreads, kSmemBytes));
    TORCH_CHECK(cached[dev] > 0, "aqlm 2x8: kernel does not fit on an SM");
  }
  return cached[dev];
}

template <int kM>
static void set_1x16_attributes(int dev) {
  static bool done[kMaxDevices] = {false};
  if (!done[dev]) {  // as much L1 as possible for the codebook
    C10_CUDA_CHECK(cudaFuncSetAttribute(aqlm_1x16_kernel<kM>, cudaFuncAttributePreferredSharedMemoryCarveout, 0));
    done[dev] = true;
  }
}

static bool half_vec(const torch::Tensor& t, int64_t n) {
  return t.scalar_type() == at::kHalf && t.is_contiguous() && t.numel() == n;
}
static bool aligned(const torch::Tensor& t, int bytes) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0;
}
// Activation rows of x: [in] (one row) or [rows, in], contiguous fp16 on CUDA, 1 <= rows <= kMaxRows.
static int64_t x_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && (x.dim() == 1 || x.dim() == 2) && half_vec(x, x.numel()),
              "x: contiguous fp16 [in] or [rows, in]");
  const int64_t rows = x.dim() == 2 ? x.size(0) : 1;
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "x: 1 to 16 activation rows");
  return rows;
}
static const half* half_ptr(const torch::Tensor& t) { return reinterpret_cast<const half*>(t.data_ptr<at::Half>()); }
static int device_index(const torch::Tensor& x) {
  const int dev = x.get_device();
  TORCH_CHECK(dev >= 0 && dev < kMaxDevices, "device index");
  return dev;
}
}  // namespace trapetum_aqlm

// x: fp16 [in] or [rows, in] (rows <= 16). meta: CPU int64 [P, 5], one row per part: (rows N, byte offset in
// codes[q], row stride, slice stride, packed): packed = 1 for the "slices" layout of pack_2x8 (row stride 64,
// slice stride 64 * 16 * groups, bytes permuted by packed_pos), 0 for a layout read as stored; all parts of a
// launch share it. codes: one byte buffer per part; cb: fp16 [P, 2, 256, 8]; scales, bias: [sum N]; res, y:
// [rows, sum N], or with act = 1 (SiLU) / 2 (GELU-tanh) and two parts of N rows (gate, up, no residual):
// y [rows, N] = act(gate) * up. partial: fp32, rows * (floats of the parts). pdl: programmatic launch.
void aqlm_gemv_2x8(torch::Tensor x, std::vector<torch::Tensor> codes, torch::Tensor cb, torch::Tensor scales,
                   torch::Tensor bias, torch::Tensor res, torch::Tensor y, torch::Tensor partial, torch::Tensor meta,
                   int64_t has_bias, int64_t has_res, int64_t blocks_per_sm, int64_t act, int64_t pdl) {
  using namespace trapetum_aqlm;
  const int64_t R = x_rows(x);
  TORCH_CHECK(meta.device().is_cpu() && meta.scalar_type() == at::kLong && meta.is_contiguous() && meta.dim() == 2 &&
              meta.size(1) == kMetaCols && meta.size(0) >= 1 && meta.size(0) <= kMaxParts,
              "meta: int64 [parts <= 4, 5] on the CPU");
  const int P = meta.size(0);
  const int64_t G = x.numel() / R / 8;
  TORCH_CHECK(x.numel() == R * G * 8 && G >= 1 && G % 8 == 0 && G < (1 << 24),
              "x: in_features must be a multiple of 64");
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
  const bool packed = m[4] != 0;
  for (int q = 0; q < P; ++q) {
    const int64_t* mq = m + kMetaCols * q;
    const int64_t N = mq[0], off = mq[1], rs = mq[2], ss = mq[3];
    TORCH_CHECK(N >= 1 && N < (1LL << 31) / 8, "meta: part rows");
    TORCH_CHECK(off >= 0 && off % 16 == 0 && rs > 0 && rs % 16 == 0 && ss > 0 && ss % 16 == 0, "meta: offsets and strides");
    TORCH_CHECK((mq[4] == 0 || mq[4] == 1) && (mq[4] != 0) == packed, "meta: all parts of a launch in one layout");
    int64_t extent;
    if (packed) {  // every row of every unit is read, padding included
      const int64_t groups = (N + kUnitRows - 1) / kUnitRows;
      TORCH_CHECK(rs == kSliceBytes && ss == (int64_t)kUnitBytes * groups, "meta: packed part ", q, " strides");
      extent = off + nslices * ss;
    } else {  // rows below N, chunks below G
      const int64_t last_chunk = std::min<int64_t>(3, (G - 1 - (int64_t)(nslices - 1) * kSlice) / 8);
      extent = off + (nslices - 1) * ss + (N - 1) * rs + 16 * last_chunk + 16;
    }
    TORCH_CHECK(extent <= codes[q].numel(), "meta: part ", q, " reads past its codes buffer");
  }
  Params2x8 p;
  const PartTotals tot = fill_parts(p.part, P, reinterpret_cast<const long long*>(m), cptr, cb.data_ptr(), nslices);
  const int64_t rows = tot.rows, floats = tot.floats, out_rows = act ? rows / 2 : rows;
  TORCH_CHECK(rows < (1LL << 31), "too many rows");
  TORCH_CHECK(half_vec(scales, rows), "scales: fp16 [rows of all parts]");
  TORCH_CHECK(act >= 0 && act <= 2, "act: 0 (none), 1 (silu) or 2 (gelu_tanh)");
  TORCH_CHECK(!act || (P == 2 && m[0] == m[kMetaCols] && !has_res), "act: a gate/up pair of equal parts, no residual");
  TORCH_CHECK(y.device() == x.device() && half_vec(y, R * out_rows),
              "y: contiguous fp16 [x rows, rows] ([x rows, rows / 2] with act)");
  TORCH_CHECK(!has_bias || half_vec(bias, rows), "bias: fp16 [rows]");
  TORCH_CHECK(!has_res || (res.device() == x.device() && half_vec(res, R * rows)), "residual: fp16 [x rows, rows]");
  TORCH_CHECK(partial.device() == x.device() && partial.scalar_type() == at::kFloat && partial.is_contiguous() &&
              partial.numel() >= R * floats, "partial: fp32, x rows * floats");
  const c10::cuda::CUDAGuard guard(x.device());
  const int dev = device_index(x);
  const int fit = packed ? max_blocks_2x8<true>(dev) : max_blocks_2x8<false>(dev);
  const int bps = std::max(1, std::min<int>((int)blocks_per_sm, fit));
  p.x = half_ptr(x);
  p.scales = half_ptr(scales);
  p.bias = has_bias ? half_ptr(bias) : nullptr;
  p.res = has_res ? half_ptr(res) : nullptr;
  p.y = reinterpret_cast<half*>(y.data_ptr<at::Half>());
  p.partial = partial.data_ptr<float>();
  p.nparts = P, p.G = (int)G, p.nslices = nslices, p.has_bias = (int)has_bias, p.has_res = (int)has_res;
  p.units = tot.units, p.act = (int)act, p.rows = (int)R, p.floats = floats, p.y_stride = out_rows, p.res_stride = rows;
  const long long ranges = std::min<long long>(p.units, (long long)bps * sm_count(dev));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  C10_CUDA_CHECK(trapetum_pdl::launch(packed ? aqlm_2x8_kernel<true> : aqlm_2x8_kernel<false>,
                                      dim3((unsigned)(ranges * R)), dim3(kThreads), kSmemBytes, stream, pdl != 0, p));
  C10_CUDA_CHECK(trapetum_pdl::launch(aqlm_2x8_reduce_kernel,
                                      dim3((unsigned)((out_rows + kReduceRows - 1) / kReduceRows), (unsigned)R),
                                      dim3(kThreads), 0, stream, pdl != 0, p));
}

namespace trapetum_aqlm {
template <int kM>
static void launch_1x16(const Params1x16& p, int grid, int dev, bool pdl) {
  set_1x16_attributes<kM>(dev);
  C10_CUDA_CHECK(trapetum_pdl::launch(aqlm_1x16_kernel<kM>, dim3(grid), dim3(kThreads), 0,
                                      c10::cuda::getCurrentCUDAStream().stream(), pdl, p));
}
}  // namespace trapetum_aqlm

// x: fp16 [in] or [rows, in] (rows <= 16); res, y: [rows, N]. ks_log2 < 0: pick the k-split from the shape
// (enough warps to fill the GPU, >= 2 chunks per warp; never from the rows: every row's bits are the one-row
// launch's). The row bucket (1, 2, 4, 8, 16) is the smallest that holds the rows.
void aqlm_gemv_1x16(torch::Tensor x, torch::Tensor codes, torch::Tensor cb, torch::Tensor scales, torch::Tensor bias,
                    torch::Tensor res, torch::Tensor y, int64_t has_bias, int64_t has_res, int64_t ks_log2,
                    int64_t pdl) {
  using namespace trapetum_aqlm;
  const int64_t R = x_rows(x);
  TORCH_CHECK(codes.device() == x.device() && codes.is_contiguous() && codes.dim() == 3, "codes: [N, G, M]");
  TORCH_CHECK(cb.device() == x.device() && half_vec(cb, cb.numel()), "codebooks: contiguous fp16");
  const int64_t N = codes.size(0), G = codes.size(1);
  TORCH_CHECK(N >= 1 && G >= 1 && x.numel() == R * G * 8, "x: in_features != 8 * groups");
  TORCH_CHECK(N < (1LL << 31) / 16 && G < (1 << 24), "shape too large");
  TORCH_CHECK(codes.scalar_type() == at::kShort && codes.size(2) == 1 && cb.numel() == 65536 * 8, "1x16 layout");
  TORCH_CHECK(half_vec(scales, N), "scales: fp16 [N]");
  TORCH_CHECK(y.device() == x.device() && half_vec(y, R * N), "y: contiguous fp16 [rows, N]");
  TORCH_CHECK(!has_bias || half_vec(bias, N), "bias: fp16 [N]");
  TORCH_CHECK(!has_res || (res.device() == x.device() && half_vec(res, R * N)), "residual: fp16 [rows, N]");
  TORCH_CHECK(aligned(x, 16) && aligned(cb, 16), "x, codebook: 16-byte aligned");
  TORCH_CHECK(ks_log2 <= 3, "ks_log2");
  const c10::cuda::CUDAGuard guard(x.device());
  const int dev = device_index(x);
  int ks = (int)ks_log2;
  if (ks < 0) {
    const long long rowsets = (N + kRows16 - 1) / kRows16, want = 32LL * sm_count(dev);
    const int nch = (int)((G + 31) / 32);
    ks = 0;
    while (ks < 3 && (rowsets << ks) < want && nch >= (4 << ks)) ++ks;
  }
  Params1x16 p;
  p.x = half_ptr(x);
  p.codes = reinterpret_cast<const uint16_t*>(codes.data_ptr());
  p.cb = reinterpret_cast<const uint4*>(cb.data_ptr<at::Half>());
  p.scales = half_ptr(scales);
  p.bias = has_bias ? half_ptr(bias) : p.scales;
  p.res = has_res ? half_ptr(res) : p.scales;  // read only if has_res
  p.y = reinterpret_cast<half*>(y.data_ptr<at::Half>());
  p.N = (int)N, p.G = (int)G, p.ks_log2 = ks, p.has_bias = (int)has_bias, p.has_res = (int)has_res, p.rows = (int)R;
  const int rows_per_block = kRows16 * (kWarps >> ks);
  const int grid = (int)((N + rows_per_block - 1) / rows_per_block);
  const bool on = pdl != 0;
  auto launch = R == 1 ? launch_1x16<1> : R == 2 ? launch_1x16<2> : R <= 4 ? launch_1x16<4> : R <= 8 ? launch_1x16<8>
                                                                                                     : launch_1x16<16>;
  launch(p, grid, dev, on);
}
#endif  // TRAPETUM_TORCH_LAUNCHER
