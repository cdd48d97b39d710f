// Tensor-core per-row codebook GEMV (4-bit and 8-bit), M = 1..16 activation rows; 4-bit dequantization.
//
// y[m, r] = sum_c x[m, c] * codebook[r, idx(r, c)]  (+ residual[m, r]), fp32 accumulation.
//
// Design (NOTES-kernels.md has the instruction budget and the measurements):
//  * One block = 16 weight rows x the whole input dimension. The input is cut into chunks of 64 code bytes per
//    row; warp w (of 8) takes chunks w, w + 8, w + 16, ... in that order, and the 8 partial sums are added in a
//    fixed order (no atomics: bitwise reproducible).
//  * Per block a lookup table in shared memory, [entry e][half h][lane] 32-bit words (64 KB):
//      4-bit: entry e = one code byte -> half2 (codebook[e & 15], codebook[e >> 4]), the two weights of columns
//             2j, 2j+1 in one lookup;
//      8-bit: entry e -> codebook[e] in the low half.
//    Lane (g, t) of every warp reads row (g + 8h)'s table at word e*64 + h*32 + lane: each row's table is stored
//    4 times (once per t), so the 32 lanes of one LDS hit 32 distinct banks. The byte address
//    (e << 8) | (lane << 2) comes from the code word with one PRMT.
//  * The looked-up half2 words are the A operand of mma.sync.m16n8k16 (rows g and g+8, k pairs); x is the B
//    operand (column n = activation row), so M <= 8 costs one mma per 256 weights and M <= 16 two (n-tiles
//    NT = 1, 2). The mma's k order is a permutation of the input columns applied to x identically, so the
//    canonical code layout can be read as stored (TILED = false); TILED = true reads codes tiled once at load
//    (codebook_layout.tile_codes) so that each warp code load is 512 contiguous bytes. Both give the same bits.
//  * Codes are streamed with 16-byte loads (ld.global.nc.L1::no_allocate) two chunks ahead, x one chunk ahead.
//
// Batch invariance (speculative verify runs M rows): row m of an M-row call has exactly the bits of an M = 1
// call on that row, whatever the other rows hold. For output (m, r) warp w computes the chain
// acc_w = mma(... mma(mma(0, chunk w), chunk w + 8) ...) in mma column n = m % 8 of n-tile m / 8, and
// y = round(acc_0 + acc_1 + ... + acc_7 (+ residual)) in that order. The A operands and the k order do not depend
// on M; column n of B holds x[m] only; column n of an mma's D depends only on A, column n of B and column n of C,
// computed alike for every n; n-tile 1 (M > 8) has accumulators of its own fed the same A, so n-tile 0's chains
// are those of NT = 1; the reduction and the epilogue are per (m, r). Columns n >= M are zeros, never stored.
// How x reaches the registers (below) changes addresses, not values. tests/test_kernels_gemv.py pins it.
//
// x delivery. The B fragment of lane (g, t) for one chunk is row g's 64 (4-bit) / 32 (8-bit) contiguous bytes of
// that chunk. Read from row-major x, a warp instruction touches 2 rows x 2 lines per quarter-warp: 4 L1 wavefronts
// per 128 useful bytes; at M = 8 that is 64 wavefronts per 2,048-weight chunk, twice the table lookups, and the
// multi-row GEMV was L1-bound on it. So for M >= kFragRows the launcher first copies x into fragment order
// (x_fragments_kernel, one small launch): 16-byte piece i of lane t's columns of chunk c of row m goes to piece
// index ((c * PT + i) * M + m) * 4 + t (PT = 4 pieces per lane and chunk at 4 bits, 2 at 8 bits), so that every
// warp instruction reads 512 contiguous bytes (16 wavefronts per chunk at M = 8, 32 at M = 16). M = 1 and 2 read
// x in place (M = 1 is the decode path: no copy, no extra launch; only the lanes of row 0 load).
// Requirements (checked by the Python wrapper): code bytes per row % 64 == 0 (in % 128 == 0 for 4-bit,
// in % 64 == 0 for 8-bit), 1 <= M <= 16, or <= 256 on tiled codes
// (more than 16 rows: groups of 16 in one launch, cb_gemv_mma_groups_kernel or GROUPED), sm_80+.
#define TRAPETUM_CBGEMV_MMA_CU 1  // expert_gemv_mma.cu builds on this file
#include <cuda_fp16.h>
#include <stdint.h>
#include "pdl.cuh"
#include "act.cuh"
#include "ptx.cuh"
#include "lut4.cuh"

// Dynamic shared memory, named at file scope so PTX can take its address as a constant
// (ptxas then folds the table base into the LDS immediate: PRMT + LDS per lookup).
extern __shared__ __align__(16) uint32_t trapetum_cbgemv_smem[];

namespace trapetum_mma {

constexpr int kThreads = 256;
constexpr int kWarps = 8;
constexpr int kTabWords = 2 * 256 * 32;  // 64 KB
constexpr int kFragRows = 3;             // x copied into fragment order from this many activation rows on
constexpr int kMaxGroupedRows = 256;     // rows of one call (more than 16: groups of 16 in one launch)

using trapetum_ptx::ld_stream;
using trapetum_ptx::lds;
using trapetum_ptx::mma16816;

// Byte offset of table entry (byte k of w) for this lane: (byte << 8) | lane*4, one PRMT.
// Table layout: word e*64 + h*32 + lane  (entry e, row half h), so byte offset e*256 + h*128 + lane*4.
__device__ __forceinline__ uint32_t sel_byte(uint32_t w, uint32_t lane4, int k) {
  return __byte_perm(w, lane4, 0x5504 | (k << 4));
}

template <int BITS>
struct XWords { static constexpr int value = (BITS == 4) ? 16 : 8; };  // half2 words of x per lane and chunk
template <int BITS>
struct XPieces { static constexpr int value = XWords<BITS>::value / 4; };  // 16-byte pieces per lane and chunk

// x words of chunk c for lane (g, t): activation rows g (nt = 0) and g + 8 (nt = 1). Lanes whose row is past M
// skip the load and keep the zeros their registers were initialised with (columns n >= M are never read).
// XF = false: x row-major [M, K]; XF = true: x in fragment order (file comment, x_fragments_kernel).
template <int BITS, int NT, bool XF>
__device__ __forceinline__ void load_x(uint32_t (&xw)[NT][XWords<BITS>::value], const half* __restrict__ x,
                                       int M, int K, int g, int t, int c) {
  constexpr int PT = XPieces<BITS>::value;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (nt * 8 + g >= M) continue;
    const int m = min(nt * 8 + g, M - 1);
    const int off = c * 64 + t * 16;  // byte offset of the lane's codes in the row (XF = false)
    const uint4* xp = XF ? reinterpret_cast<const uint4*>(x) + ((size_t)c * PT * M + m) * 4 + t
                         : reinterpret_cast<const uint4*>(x + (size_t)m * K + ((BITS == 4) ? 2 * off : off));
    const int step = XF ? M * 4 : 1;  // uint4 between a lane's pieces
#pragma unroll
    for (int i = 0; i < PT; ++i) {
      const uint4 v = trapetum_pdl::ld_input(xp + i * step);  // x: written by the previous kernel
      xw[nt][4 * i + 0] = v.x; xw[nt][4 * i + 1] = v.y;
      xw[nt][4 * i + 2] = v.z; xw[nt][4 * i + 3] = v.w;
    }
  }
}

// The code stream of one lane: 16 bytes of rows g and g+8 of a 16-row tile per 64-byte chunk; chunks past the
// end are not loaded. Canonical layout (TILED = false): rows past N read row N-1 (valid loads; never stored); a
// warp load touches 8 rows (8 L1 wavefronts). Tiled layout (TILED = true): per 16-row tile, chunk c's 1,024 bytes
// are [h][g][t][16 B] (h: rows g / g+8), so each warp load is 512 contiguous bytes (4 wavefronts); rows padded to 16.
template <bool TILED>
struct CodeStream {
  const uint8_t* pa;
  const uint8_t* pb;
  int nchunks;
  static constexpr int kStride = TILED ? 1024 : 64;  // bytes between a lane's consecutive chunks
  __device__ __forceinline__ CodeStream(const uint8_t* codes, int N, int KB, int row0, int g, int t)
      : pa(TILED ? codes + (size_t)row0 * KB + (g * 4 + t) * 16 : codes + (size_t)min(row0 + g, N - 1) * KB + t * 16),
        pb(TILED ? codes + (size_t)row0 * KB + 512 + (g * 4 + t) * 16
                 : codes + (size_t)min(row0 + g + 8, N - 1) * KB + t * 16),
        nchunks((KB + 63) >> 6) {}
  __device__ __forceinline__ void load(int c, uint4& qa, uint4& qb) const {
    if (c < nchunks) {
      qa = ld_stream(pa + c * kStride);
      qb = ld_stream(pb + c * kStride);
    }
  }
};

// The A fragment (rows g, g+8 of the tile; k pairs) of 16-column k-step j of one chunk for one lane: table lookups
// of the chunk's code words wa4 (row g) / wb4 (row g+8). It depends on the codes only, never on x or M.
template <int BITS>
__device__ __forceinline__ void dequant_tile(uint32_t (&A)[4], const uint32_t (&wa4)[4], const uint32_t (&wb4)[4],
                                             int j, const uint32_t sb, const uint32_t lane4) {
  if (BITS == 4) {
    const uint32_t wa = wa4[j >> 1], wb = wb4[j >> 1];
    const int k0 = (j & 1) * 2;  // byte of the word holding columns (2j, 2j+1) of this lane
    A[0] = lds(sb + sel_byte(wa, lane4, k0));
    A[2] = lds(sb + sel_byte(wa, lane4, k0 + 1));
    A[1] = lds(sb + 128 + sel_byte(wb, lane4, k0));
    A[3] = lds(sb + 128 + sel_byte(wb, lane4, k0 + 1));
  } else {
    const uint32_t wa = wa4[j], wb = wb4[j];
    A[0] = __byte_perm(lds(sb + sel_byte(wa, lane4, 0)), lds(sb + sel_byte(wa, lane4, 1)), 0x5410);
    A[2] = __byte_perm(lds(sb + sel_byte(wa, lane4, 2)), lds(sb + sel_byte(wa, lane4, 3)), 0x5410);
    A[1] = __byte_perm(lds(sb + 128 + sel_byte(wb, lane4, 0)), lds(sb + 128 + sel_byte(wb, lane4, 1)), 0x5410);
    A[3] = __byte_perm(lds(sb + 128 + sel_byte(wb, lane4, 2)), lds(sb + 128 + sel_byte(wb, lane4, 3)), 0x5410);
  }
}

// One 16-byte code chunk per weight row (rows g and g+8 of the tile) for one lane.
template <int BITS, int NT>
__device__ __forceinline__ void compute_chunk(float (&acc)[NT][4], const uint4 qa, const uint4 qb,
                                              const uint32_t sb, const uint32_t lane4,
                                              const uint32_t (&xw)[NT][XWords<BITS>::value]) {
  constexpr int TILES = XWords<BITS>::value / 2;
  const uint32_t wa4[4] = {qa.x, qa.y, qa.z, qa.w};
  const uint32_t wb4[4] = {qb.x, qb.y, qb.z, qb.w};
#pragma unroll
  for (int j = 0; j < TILES; ++j) {
    uint32_t A[4];
    dequant_tile<BITS>(A, wa4, wb4, j, sb, lane4);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma16816(acc[nt], A, xw[nt][2 * j], xw[nt][2 * j + 1]);
  }
}

// Fixed-order reduction of the 8 warps' partial sums through shared memory, then the epilogue.
// Element offset of row m, feature k of M rows in fragment order with PT pieces (codebook_layout.frag_index):
// the layout x_fragments_kernel writes, element by element (the gate/up epilogue writes it for the down GEMV).
__host__ __device__ __forceinline__ size_t frag_index(int m, int k, int M, int PT) {
  const int r = k >> 3, c = r / (4 * PT), t = (r / PT) & 3, i = r % PT;
  return ((((size_t)(c * PT + i) * M + m) * 4 + t) << 3) + (k & 7);
}

template <int NT, int EPI>
__device__ __forceinline__ void reduce_store(float* red, const float (&acc)[NT][4], int tid, int lane, int warp,
                                             int row0, int M, int N, int F, int has_res, int ypt,
                                             const half* __restrict__ res, half* __restrict__ y, int tile = -1) {
  __syncthreads();
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) red[((warp * NT + nt) * 4 + r) * 32 + lane] = acc[nt][r];
  __syncthreads();

  if (EPI == 0) {
    if (tid < 16 * NT * 8) {
      const int rr = tid & 15, m = tid >> 4;
      const int nt = m >> 3, n = m & 7;
      const int ln = (rr & 7) * 4 + (n >> 1);
      const int reg = ((rr >> 3) << 1) | (n & 1);
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += red[((w * NT + nt) * 4 + reg) * 32 + ln];
      const int row = row0 + rr;
      if (row < N && m < M) {
        if (has_res) s += trapetum_pdl::ld_input_half(res + (size_t)m * N + row);
        y[(size_t)m * N + row] = __float2half(s);
      }
    }
  } else {
    if (tid < 8 * NT * 8) {
      const int rr = tid & 7, m = tid >> 3;
      const int nt = m >> 3, n = m & 7;
      const int ln = rr * 4 + (n >> 1);
      const int rg = n & 1, ru = 2 | (n & 1);
      float sg = 0.0f, su = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        sg += red[((w * NT + nt) * 4 + rg) * 32 + ln];
        su += red[((w * NT + nt) * 4 + ru) * 32 + ln];
      }
      const int o = (tile < 0 ? (int)blockIdx.x : tile) * 8 + rr;
      if (o < F && m < M) {
        const float a = trapetum_act::apply(EPI, sg);
        y[ypt ? frag_index(m, o, M, ypt) : (size_t)m * F + o] = __float2half(a * su);
      }
    }
  }
}

// The block's lookup table (file comment) of weight rows row0 .. row0 + 15, built by all 256 threads: thread
// (gg, h, s) writes row h*8+gg's (clamped: rows past N are never stored) 16 entries, whose words land, for each
// unrolled step, as 8 consecutive uint4 per quarter-warp: no conflicts. (expert_gemv_mma.cu builds on it.)
template <int BITS>
__device__ __forceinline__ void build_table(uint32_t* smem, const half* __restrict__ cb, int N, int row0, int tid) {
  const int gg = tid & 7, h = (tid >> 3) & 1, sIdx = tid >> 4;
  const int r = min(row0 + h * 8 + gg, N - 1);
  if (BITS == 4) {
    const uint4* cp = reinterpret_cast<const uint4*>(cb + (size_t)r * 16);
    const uint4 c0 = __ldg(cp), c1 = __ldg(cp + 1);
    const uint32_t cw[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
    const uint32_t lov = __half_as_ushort(cb[(size_t)r * 16 + sIdx]);
#pragma unroll
    for (int hi = 0; hi < 16; ++hi) {
      const uint32_t hv = (hi & 1) ? (cw[hi >> 1] & 0xFFFF0000u) : (cw[hi >> 1] << 16);
      const uint32_t v = lov | hv;
      const int e = hi * 16 + sIdx;
      *reinterpret_cast<uint4*>(&smem[e * 64 + h * 32 + gg * 4]) = make_uint4(v, v, v, v);
    }
  } else {
    const uint4* cp = reinterpret_cast<const uint4*>(cb + (size_t)r * 256 + sIdx * 16);
    const uint4 c0 = __ldg(cp), c1 = __ldg(cp + 1);
    const uint32_t cw[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t v = (i & 1) ? (cw[i >> 1] >> 16) : (cw[i >> 1] & 0xFFFFu);
      const int e = sIdx * 16 + i;
      *reinterpret_cast<uint4*>(&smem[e * 64 + h * 32 + gg * 4]) = make_uint4(v, v, v, v);
    }
  }
}

// EPI 0: y = x W^T (+ residual). EPI 1 / 2: rows interleaved as 8 gate then 8 up rows per 16-row tile;
// y[m, o] = act(gate) * up with act = SiLU (1) or GELU-tanh (2), o < F. NT: n-tiles (M <= 8: 1, M <= 16: 2).
// (Earlier variants, measured and moved to kernels/cuda/experimental/codebook_gemv_variants.cu or removed: see
// NOTES-kernels.md. This kernel is variant 7 (canonical codes) and 11 (tiled codes) of those notes.)
// GROUPED (M > 16, NT = 2, XF): the rows are ceil(M / 16) groups of 16 (the last one shorter), each its own
// fragment-order block of x (x_fragments_groups_kernel) and its own rows of y / res; block b computes weight tile
// b / G for group b % G (the groups of one tile are neighbours in the grid, so the tile's codes come from DRAM once
// and from L2 for the other groups). Each group runs exactly the instructions of a 16-row call on its rows, so every
// row keeps the bits of its one-row call.
template <int BITS, int NT, int EPI, bool TILED, bool XF, bool GROUPED = false>
__global__ void __launch_bounds__(kThreads, NT == 1 ? 3 : 2)
cb_gemv_mma_kernel(const half* __restrict__ x, const uint8_t* __restrict__ codes,
                   const half* __restrict__ cb, const half* __restrict__ res,
                   half* __restrict__ y, int M, int N, int K, int KB, int has_res, int F, int ypt) {
  trapetum_pdl::allow_dependents();
  uint32_t* smem = trapetum_cbgemv_smem;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  int tile = blockIdx.x;
  if (GROUPED) {
    const int G = (M + 15) >> 4, grp = (int)blockIdx.x % G;
    tile = (int)blockIdx.x / G;
    x += (size_t)grp * 16 * K;
    y += (size_t)grp * 16 * (EPI == 0 ? N : F);
    res += (size_t)grp * 16 * N;  // read only with has_res (EPI 0)
    M = min(16, M - 16 * grp);
  }
  const int row0 = tile * 16;
  const CodeStream<TILED> cs(codes, N, KB, row0, g, t);
  const int nchunks = cs.nchunks;
  auto load = [&](int c, uint4& qa, uint4& qb) { cs.load(c, qa, qb); };

  // Two chunks in flight before the table build, so DRAM latency overlaps it
  // (registers of chunks past the end are left unloaded: they are never computed).
  uint4 qa0, qb0, qa1, qb1;
  load(warp, qa0, qb0);
  load(warp + kWarps, qa1, qb1);

  build_table<BITS>(smem, cb, N, row0, tid);
  __syncthreads();
  // everything above read weights only (PDL: it may overlap the previous kernel); x, the residual and
  // y belong to the previous kernels
  trapetum_pdl::wait_inputs();

  uint32_t sb;
  asm("mov.u32 %0, trapetum_cbgemv_smem;" : "=r"(sb));
  const uint32_t lane4 = (uint32_t)lane * 4u;
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  constexpr int XW = XWords<BITS>::value;

  // one chunk per step; codes two steps ahead, x one step ahead
  uint32_t xw0[NT][XW] = {}, xw1[NT][XW] = {};
  load_x<BITS, NT, XF>(xw0, x, M, K, g, t, min(warp, nchunks - 1));
  for (int c = warp; c < nchunks; c += kWarps) {
    uint4 qa2, qb2;
    load(c + 2 * kWarps, qa2, qb2);
    load_x<BITS, NT, XF>(xw1, x, M, K, g, t, min(c + kWarps, nchunks - 1));
    compute_chunk<BITS, NT>(acc, qa0, qb0, sb, lane4, xw0);
    qa0 = qa1; qb0 = qb1; qa1 = qa2; qb1 = qb2;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < XW; ++i) xw0[nt][i] = xw1[nt][i];
  }

  __syncthreads();  // every warp is done with the table: reuse it for the reduction
  reduce_store<NT, EPI>(reinterpret_cast<float*>(smem), acc, tid, lane, warp, row0, M, N, F, has_res, ypt, res, y,
                        tile);
}

// x [M, K] row-major -> fragment order (file comment): thread q copies the 16-byte piece q of x (coalesced reads,
// 16-byte scattered writes). PDL: it lets the GEMV after it start its weight-only prologue at once, and waits for
// the previous kernel before reading x or writing xf (the previous GEMV may still read the memory xf reuses).
template <int PT>
__global__ void __launch_bounds__(256)
x_fragments_kernel(const half* __restrict__ x, half* __restrict__ xf, int M, int K) {
  trapetum_pdl::allow_dependents();
  trapetum_pdl::wait_inputs();
  const int n8 = K >> 3;  // 16-byte pieces per row
  const long long q = (long long)blockIdx.x * 256 + threadIdx.x;
  if (q >= (long long)M * n8) return;
  const int m = (int)(q / n8), r = (int)(q - (long long)m * n8);
  const int c = r / (4 * PT), t = (r / PT) & 3, i = r % PT;  // r = (c * 4 + t) * PT + i
  const uint4 v = trapetum_pdl::ld_input(reinterpret_cast<const uint4*>(x) + q);
  reinterpret_cast<uint4*>(xf)[((size_t)(c * PT + i) * M + m) * 4 + t] = v;
}

// x [M, K] row-major (M > 16) -> groups of 16 rows, group j's rows (16 j ..) in the fragment order of its own row
// count min(16, M - 16 j), at element offset 16 j K (the GROUPED GEMV's x). PDL as x_fragments_kernel.
template <int PT>
__global__ void __launch_bounds__(256)
x_fragments_groups_kernel(const half* __restrict__ x, half* __restrict__ xf, int M, int K) {
  trapetum_pdl::allow_dependents();
  trapetum_pdl::wait_inputs();
  const int n8 = K >> 3;
  const long long q = (long long)blockIdx.x * 256 + threadIdx.x;
  if (q >= (long long)M * n8) return;
  const int m = (int)(q / n8), r = (int)(q - (long long)m * n8);
  const int grp = m >> 4, ml = m & 15, mg = min(16, M - 16 * grp);
  const int c = r / (4 * PT), t = (r / PT) & 3, i = r % PT;
  const uint4 v = trapetum_pdl::ld_input(reinterpret_cast<const uint4*>(x) + q);
  reinterpret_cast<uint4*>(xf)[(size_t)grp * 16 * n8 + ((size_t)(c * PT + i) * mg + ml) * 4 + t] = v;
}

// ---------------------------------------------------------------------------------------------
// 4-bit dequantization for prefill: W[r, c] = cb[r, idx(r, c)] as a dense fp16 [N, 2*KB] matrix.
// One thread = 16 code bytes (32 weights) of one row: one 16-byte code load, the row's codebook as byte planes
// (low bytes L[4], high bytes H[4]; two 16-byte loads, L1 hits for the row's other threads) and byte-permute
// lookups, four 16-byte stores; consecutive threads take consecutive segments of a row: coalesced.
// Memory-bound at 2.5 bytes per weight. Requires KB % 16 == 0. Not launched with PDL (a prefill kernel).
// (lut4.cuh: the byte-permute lookups of 4 nibbles in the row's codebook planes.)
using trapetum_lut::lut4_piece;
using trapetum_lut::load_planes;

__global__ void __launch_bounds__(256)
cb_dequant4_kernel(const uint8_t* __restrict__ codes, const half* __restrict__ cb, half* __restrict__ w,
                   int N, int KB) {
  const int segs = KB >> 4;
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  if (i >= (long long)N * segs) return;
  const int r = (int)(i / segs), sgm = (int)(i - (long long)r * segs);
  uint32_t L[4], H[4];
  load_planes(cb, r, L, H);
  const uint4 q = __ldg(reinterpret_cast<const uint4*>(codes + (size_t)r * KB + sgm * 16));
  const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
  uint4* out = reinterpret_cast<uint4*>(w + (size_t)r * KB * 2 + sgm * 32);
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // word k: columns 8k .. 8k+7 of the segment, low nibble first
    uint32_t a0, a1, a2, a3;
    const uint32_t lo = qw[k], hi = qw[k] >> 16;
    lut4_piece(lo, L, H, a0, a1);
    lut4_piece(hi, L, H, a2, a3);
    out[k] = make_uint4(a0, a1, a2, a3);
  }
}

}  // namespace trapetum_mma

#include "codebook_gemv_groups.cuh"  // more than 16 rows: cb_gemv_mma_groups_kernel

#ifdef TRAPETUM_SASS_ONLY
// Explicit instantiations for `nvcc -cubin` + cuobjdump (NOTES-kernels.md).
#define TRAPETUM_INST(B, NT, T, XF) template __global__ void trapetum_mma::cb_gemv_mma_kernel<B, NT, 0, T, XF>( \
    const half*, const uint8_t*, const half*, const half*, half*, int, int, int, int, int, int, int);
TRAPETUM_INST(4, 1, true, false) TRAPETUM_INST(4, 1, true, true) TRAPETUM_INST(4, 2, true, true)
TRAPETUM_INST(4, 1, false, false) TRAPETUM_INST(8, 1, true, false) TRAPETUM_INST(8, 2, true, true)
#endif

#ifdef TRAPETUM_TORCH_LAUNCHER
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include "smem_once.cuh"

namespace trapetum_mma {
// Shared-memory carveout (percent of the maximum): all of it for the decode path (3 blocks of 65 KB fit); the
// multi-row paths ask for the smallest configuration that still holds their blocks (3 x 65 KB of 196 KB at
// NT = 1, 2 x 65 KB of 132 KB at NT = 2), leaving the rest to L1, where the blocks of an SM share x.
template <int NT, bool XF>
struct Carveout { static constexpr int value = !XF ? 100 : (NT == 1 ? 86 : 58); };

struct Args {
  const half* x; const uint8_t* codes; const half* cb; const half* res; half* y;
  int M, N, K, KB, has_res, F, ypt;
};

using trapetum_launch::kAttrDevices;  // smem_once.cuh (expert_gemv_mma.cu uses them through this file too)
using trapetum_launch::set_smem_once;

template <int BITS, int NT, int EPI, bool TILED, bool XF, bool GROUPED = false>
static void launch(const Args& a, cudaStream_t stream, bool pdl) {
  auto kern = cb_gemv_mma_kernel<BITS, NT, EPI, TILED, XF, GROUPED>;
  const int smem_bytes = kTabWords * 4;
  static bool attr_set[kAttrDevices] = {};
  set_smem_once(kern, attr_set, smem_bytes, Carveout<NT, XF>::value);
  const int grid = (a.N + 15) / 16 * (GROUPED ? (a.M + 15) / 16 : 1);
  C10_CUDA_CHECK(trapetum_pdl::launch(kern, grid, kThreads, smem_bytes, stream, pdl,
                                      a.x, a.codes, a.cb, a.res, a.y, a.M, a.N, a.K, a.KB, a.has_res, a.F, a.ypt));
}

template <int BITS, bool TILED, int NT, bool XF, bool GROUPED = false>
static void by_epi(const Args& a, int epi, cudaStream_t s, bool pdl) {
  if (epi == 0) launch<BITS, NT, 0, TILED, XF, GROUPED>(a, s, pdl);
  else if (epi == 1) launch<BITS, NT, 1, TILED, XF, GROUPED>(a, s, pdl);
  else launch<BITS, NT, 2, TILED, XF, GROUPED>(a, s, pdl);
}

template <int BITS, int EPI, int GB>
static void launch_groups(const Args& a, cudaStream_t stream, bool pdl) {
  auto kern = cb_gemv_mma_groups_kernel<BITS, EPI, GB>;
  const int smem_bytes = kTabWords * 4;
  static bool attr_set[kAttrDevices] = {};
  // GB = 2: two blocks an SM (as the 16-row kernel); GB = 4: one block (98 KB asked: the 100 KB configuration)
  set_smem_once(kern, attr_set, smem_bytes, GB <= 2 ? Carveout<2, true>::value : 43);
  C10_CUDA_CHECK(trapetum_pdl::launch(kern, groups_grid(a.N, a.M, GB), kThreads, smem_bytes, stream, pdl,
                                      a.x, a.codes, a.cb, a.res, a.y, a.M, a.N, a.K, a.KB, a.has_res, a.F, a.ypt));
}

template <int BITS, int GB>
static void by_epi_groups(const Args& a, int epi, cudaStream_t s, bool pdl) {
  if (epi == 0) launch_groups<BITS, 0, GB>(a, s, pdl);
  else if (epi == 1) launch_groups<BITS, 1, GB>(a, s, pdl);
  else launch_groups<BITS, 2, GB>(a, s, pdl);
}

// M = 1, 2: x read in place (NT = 1); M = 3..8: fragment-order x, NT = 1; M = 9..16: fragment-order x, NT = 2;
// M > 16 (tiled codes, group-wise fragment-order x): gpb = 2 / 4: up to gpb groups of 16 rows per block, one
// dequantization for all of them (cb_gemv_mma_groups_kernel); gpb = 1: a block per group (GROUPED, session 10).
template <int BITS, bool TILED>
static void dispatch(const Args& a, int epi, cudaStream_t s, bool pdl, int gpb) {
  if (a.M < kFragRows) by_epi<BITS, TILED, 1, false>(a, epi, s, pdl);
  else if (a.M <= 8) by_epi<BITS, TILED, 1, true>(a, epi, s, pdl);
  else if (a.M <= 16 || !TILED) by_epi<BITS, TILED, 2, true>(a, epi, s, pdl);  // !TILED: M <= 16 (checked)
  else if (gpb == 1) by_epi<BITS, TILED, 2, true, TILED>(a, epi, s, pdl);
  else if constexpr (TILED) {
    if (gpb == 2) by_epi_groups<BITS, 2>(a, epi, s, pdl);
    else by_epi_groups<BITS, 4>(a, epi, s, pdl);
  }
}
}  // namespace trapetum_mma

void cb_dequant4(torch::Tensor codes, torch::Tensor cb, torch::Tensor w) {
  TORCH_CHECK(codes.is_cuda() && codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.dim() == 2, "codes");
  TORCH_CHECK(cb.is_contiguous() && cb.scalar_type() == at::kHalf && cb.size(0) == codes.size(0) && cb.size(1) == 16, "codebook");
  const int N = codes.size(0), KB = codes.size(1);
  TORCH_CHECK(KB % 16 == 0 && w.is_contiguous() && w.scalar_type() == at::kHalf && w.size(0) == N && w.size(1) == 2 * KB, "out");
  const c10::cuda::CUDAGuard guard(codes.device());
  const long long threads = (long long)N * (KB / 16);
  if (threads == 0) return;
  trapetum_mma::cb_dequant4_kernel<<<(unsigned)((threads + 255) / 256), 256, 0, c10::cuda::getCurrentCUDAStream().stream()>>>(
      codes.data_ptr<uint8_t>(), reinterpret_cast<const half*>(cb.data_ptr<at::Half>()),
      reinterpret_cast<half*>(w.data_ptr<at::Half>()), N, KB);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// x [M, K] fp16; codes uint8 [N, KB] (tiled: rows padded to 16, and for epi 0 the output rows N are y's columns,
// for the gate/up epilogues the codes' rows); cb fp16 [N, 2**bits]; y [M, N] (epi 0) or [M, f] (epi 1, 2);
// res [M, N] (read when has_res). pdl: launch with programmatic dependent launch (KernelOptions.pdl_cuda).
// x_frag: x is already in fragment order (M >= kFragRows; written so by its producer): no copy launch.
// y_pt (epi 1, 2): 0 = y row-major, else y in the fragment order of PT = y_pt pieces (the consumer's bits).
// gpb (M > 16, tiled): row groups of 16 per block, 1 (a block per group), 2 or 4 (one dequantization for the groups
// of a block; KernelOptions.grouped_gemv_groups).
void cb_gemv_mma(torch::Tensor x, torch::Tensor codes, torch::Tensor cb, torch::Tensor res, torch::Tensor y,
                 int64_t bits, int64_t epi, int64_t has_res, int64_t f, int64_t tiled, int64_t pdl,
                 int64_t x_frag, int64_t y_pt, int64_t gpb) {
  using namespace trapetum_mma;
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kHalf, "x");
  TORCH_CHECK(codes.is_cuda() && codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kByte, "codes");
  TORCH_CHECK(cb.is_cuda() && cb.is_contiguous() && cb.scalar_type() == at::kHalf && cb.size(1) == (1 << bits), "codebook");
  TORCH_CHECK(y.is_cuda() && y.is_contiguous() && y.scalar_type() == at::kHalf, "y");
  TORCH_CHECK(res.is_cuda() && res.is_contiguous() && res.scalar_type() == at::kHalf, "residual");
  TORCH_CHECK(epi >= 0 && epi <= 2, "epi");
  const int M = x.size(0), K = x.size(1), KB = codes.size(1);
  int N = codes.size(0);
  TORCH_CHECK(M >= 1 && M <= (tiled ? kMaxGroupedRows : 16) && KB % 64 == 0, "shape");
  TORCH_CHECK((bits == 4 && KB * 2 == K) || (bits == 8 && KB == K), "codes width");
  if (tiled) {
    TORCH_CHECK(N % 16 == 0, "tiled codes: rows padded to a multiple of 16");
    if (epi == 0) {
      TORCH_CHECK(y.dim() == 2 && y.size(1) <= N && y.size(1) > N - 16, "tiled codes: y columns vs padded rows");
      N = y.size(1);
    }
  }
  TORCH_CHECK(cb.size(0) >= N, "codebook rows");
  TORCH_CHECK(epi == 0 ? y.numel() == (int64_t)M * N : (N % 16 == 0 && f > 0 && 2 * f <= N && y.numel() == (int64_t)M * f), "y shape");
  TORCH_CHECK(!has_res || res.numel() == (int64_t)M * N, "residual shape");
  TORCH_CHECK(!x_frag || (M >= kFragRows && M <= 16), "x_frag: fragment-order x needs 3 to 16 rows");
  TORCH_CHECK(gpb == 1 || gpb == 2 || gpb == 4, "gpb: row groups per block 1, 2 or 4");
  TORCH_CHECK(y_pt == 0 || (epi != 0 && M <= 16 && (y_pt == 2 || y_pt == 4) && f % (32 * y_pt) == 0), "y_pt");
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  const bool use_pdl = pdl != 0;
  Args a{reinterpret_cast<const half*>(x.data_ptr<at::Half>()), codes.data_ptr<uint8_t>(),
         reinterpret_cast<const half*>(cb.data_ptr<at::Half>()), reinterpret_cast<const half*>(res.data_ptr<at::Half>()),
         reinterpret_cast<half*>(y.data_ptr<at::Half>()), M, N, K, KB, (int)has_res, (int)f, (int)y_pt};
  torch::Tensor xf;  // fragment-order copy of x (M >= kFragRows), alive until both launches are queued
  if (M >= kFragRows && !x_frag) {
    xf = torch::empty({M, K}, x.options());
    const long long pieces = (long long)M * (K / 8);
    auto kern = M > 16 ? (bits == 4 ? x_fragments_groups_kernel<4> : x_fragments_groups_kernel<2>)
                       : (bits == 4 ? x_fragments_kernel<4> : x_fragments_kernel<2>);
    C10_CUDA_CHECK(trapetum_pdl::launch(kern, (unsigned)((pieces + 255) / 256), 256, 0, s, use_pdl,
                                        a.x, reinterpret_cast<half*>(xf.data_ptr<at::Half>()), M, K));
    a.x = reinterpret_cast<const half*>(xf.data_ptr<at::Half>());
  }
  const int e = (int)epi;
  const int gp = (int)gpb;
  if (bits == 4 && tiled) dispatch<4, true>(a, e, s, use_pdl, gp);
  else if (bits == 4) dispatch<4, false>(a, e, s, use_pdl, gp);
  else if (tiled) dispatch<8, true>(a, e, s, use_pdl, gp);
  else dispatch<8, false>(a, e, s, use_pdl, gp);
}
#endif
