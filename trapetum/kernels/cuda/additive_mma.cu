// AQLM 2x8 GEMV on tensor cores (dequantize-and-mma), 1..16 activation rows: the "mma" option of the 2x8 scheme
// (KernelOptions.aqlm_kernel = "mma"; the default "table" kernel is additive_gemv.cu).
//
//   y[m, r] = scale[r] * sum_k x[m, k] * fp16(C0[c0(r, k / 8)][k % 8] + C1[c1(r, k / 8)][k % 8])  (+ bias[r])
//             (+ residual[m, r]),  fp32 accumulation, rounded once to fp16.
//
// The weight is fp16(C0 + C1) (one hadd2), not the table kernel's fp32 lookups of x against each codebook: the
// bits differ from the table kernel (a 2^-11-relative rounding of each weight), so decode and verify of a model
// both use this kernel when the option is on, and the bitwise verify contract holds within that mode.
//
// Design (NOTES-additive.md, "Session 10" has the floor and the budget):
//  * Per part (projection) one shared-memory table (64 KB): entry k of both codebooks, 8-way replicated,
//      byte (k << 8) | (m << 7) | (w << 5) | (copy << 2)  = half2 word w (elements 2w, 2w+1) of C_m[k], copy 0..7.
//    Lane (g, t) reads copy g at word w = (u + t) & 3 in lookup step u, so the 32 lanes of one LDS hit banks
//    8 w + g: 32 distinct banks whatever the codes. The address is one PRMT of the code word with a lane constant
//    (byte 0 = (m << 7) | (w << 5) | (g << 2), byte 1 = the code): PRMT + LDS per lookup, one HADD2 per 2 lookups.
//  * One block = a range of 32-row tiles of one part (two m16 halves). Warp w takes chunks w, w + 8, ... of 8 input
//    groups (64 columns) of each tile; lane (g, t) works on group 8 c + 4 s + t (steps s = 0, 1) for rows g + 8 h,
//    h = 0..3, so each lane uses only its own codes: the mma's k order is a permutation of the input columns,
//    applied to x identically (A and B of a lane cover the same columns):
//      mma j (0, 1) of step s, half a: k 2t, 2t+1  <- group G_t elements 2 w_{2j}, +1;  k 2t+8, 2t+9 <- elements
//      2 w_{2j+1}, +1, with w_u = (u + t) & 3. A = the hadd2 words (rows g, g+8 of the half), B = x's words.
//    The activation rows are the mma's N = 8 columns (NT = 1: M <= 8; NT = 2: M <= 16, a second n-tile).
//  * Codes are re-packed at load (additive_layout.pack_2x8_mma; its Python reference and test): per part
//    [tile of 32 rows][chunk of 8 groups][lane 4 g + t][16 bytes: s, h, m], zeros past N, so that a warp's chunk load
//    is 512 contiguous bytes (one 16-byte ld.global.nc per lane), streamed two chunks ahead; x one chunk ahead.
//  * The 8 warps' fp32 partial sums go through shared memory and are added in warp order 0..7 per (row, activation
//    row); scale, bias, residual in that order, one rounding. No atomics: bitwise reproducible.
//
// Batch invariance (verify): row m of an M-row call has the bits of the one-row call on that row, whatever the other
// rows hold. Output (m, r) is column n = m % 8 of n-tile m / 8 of the chain of mma(A, B, C) over a warp's chunks; the
// A operands, the k permutation and the chunk order do not depend on M; column n of an mma's D depends only on A,
// column n of B (x[m] only) and column n of C (the same argument as codebook_gemv_mma.cu's file comment). n-tile 1
// has its own accumulators fed the same A, so n-tile 0 of NT = 2 is NT = 1. Columns n >= M are zeros, never stored.
// The reduction and the epilogue are per (m, r), in an order fixed by the shape. tests/test_additive_mma.py pins it.
//
// Requirements (checked by the Python wrapper, kernels/additive_mma.py): in % 64 == 0, 1..4 parts per launch, each
// with its own codebooks fp16 [2, 256, 8] and scales, 1 <= M <= 16, x / y / residual fp16 [M, *] contiguous, sm_80+.
// PDL: the table build and the first code loads read weights only and run before wait_inputs().
#include <cuda_fp16.h>
#include <stdint.h>
#include "pdl.cuh"
#include "ptx.cuh"

extern __shared__ __align__(16) uint32_t trapetum_amma_smem[];

namespace trapetum_amma {
using trapetum_ptx::ld_stream;
using trapetum_ptx::lds;
using trapetum_ptx::mma16816;

constexpr int kThreads = 256;
constexpr int kWarps = 8;
constexpr int kTileRows = 32;                 // rows per tile (two m16 halves)
constexpr int kChunkGroups = 8;               // input groups per chunk (4 lanes t x 2 steps)
constexpr int kChunkBytes = 32 * 16;          // packed code bytes of one (tile, chunk)
constexpr int kTabBytes = 256 * 256;          // 64 KB: 256 entries x (2 codebooks x 4 words x 8 copies x 4 B)
constexpr int kMaxParts = 4;

// Byte offset in the table of copy `copy` of half2 word w of codebook m's entry k (file comment).
__host__ __device__ constexpr int tab_byte(int k, int m, int w, int copy) {
  return (k << 8) | (m << 7) | (w << 5) | (copy << 2);
}
// Word of lane t's 16-byte x (and entry) piece that lookup step u (0..3) uses.
__host__ __device__ constexpr int step_word(int t, int u) { return (u + t) & 3; }
// Byte b (0..15) of lane (g, t)'s 16 packed bytes of a chunk: step s = b >> 3, row h = (b >> 1) & 3, codebook b & 1.

struct Part {
  const uint8_t* codes;  // packed (file comment)
  const half* cb;        // fp16 [2, 256, 8]
  const half* scales;    // fp16 [N]
  const half* bias;      // fp16 [N] or null
  int N, row0;           // rows; first output column
  int tiles, block0;     // 32-row tiles; first block of this part
  int plane;             // part index (the "planes" output form)
};
struct Params {
  Part parts[kMaxParts];
  int nparts, tiles_per_block, G, M, ldy, has_res, planes;  // planes: y[part][M][N] (parts of equal N), no res
  const half* x;
  const half* res;
  half* y;
};

__device__ __forceinline__ uint32_t hadd2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// (code byte k of w) << 8 | low byte of ofs: the table byte offset of a lookup.
__device__ __forceinline__ uint32_t sel(uint32_t w, uint32_t ofs, int k) {
  return __byte_perm(w, ofs, 0x7704 | (k << 4));
}

// x words of lane (g, t) for chunk c: activation row nt * 8 + g, groups 8 c + 4 s + t, rotated so that word u is
// the piece's word (u + t) & 3. Rows past M keep zeros (never stored).
template <int NT>
__device__ __forceinline__ void load_x(uint32_t (&xw)[2][NT][4], const half* __restrict__ x, int M, int K, int g,
                                       int t, int c) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int m = nt * 8 + g;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (m < M) v = trapetum_pdl::ld_input(reinterpret_cast<const uint4*>(x + (size_t)m * K) + 8 * c + 4 * s + t);
      const uint32_t r0 = (t & 1) ? v.y : v.x, r1 = (t & 1) ? v.z : v.y;
      const uint32_t r2 = (t & 1) ? v.w : v.z, r3 = (t & 1) ? v.x : v.w;
      xw[s][nt][0] = (t & 2) ? r2 : r0;
      xw[s][nt][1] = (t & 2) ? r3 : r1;
      xw[s][nt][2] = (t & 2) ? r0 : r2;
      xw[s][nt][3] = (t & 2) ? r1 : r3;
    }
  }
}

// One chunk of one lane: 2 steps x 2 halves x 2 mma, 64 lookups.
template <int NT>
__device__ __forceinline__ void compute_chunk(float (&acc)[2][NT][4], const uint4 q, const uint32_t (&ofs)[2][4],
                                              const uint32_t (&xw)[2][NT][4], uint32_t tab) {
  const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int s = 0; s < 2; ++s) {
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      const uint32_t cw = qw[2 * s + a];  // bytes: row 16a + g (c0, c1), row 16a + g + 8 (c0, c1)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t A[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // a0: row g, u = 2j; a1: row g+8, u = 2j; a2: row g, u = 2j+1; a3: row g+8
          const int u = 2 * j + (e >> 1), b = e & 1;
          const uint32_t w0 = lds(tab + sel(cw, ofs[0][u], 2 * b));
          const uint32_t w1 = lds(tab + sel(cw, ofs[1][u], 2 * b + 1));
          A[e] = hadd2(w0, w1);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma16816(acc[a][nt], A, xw[s][nt][2 * j], xw[s][nt][2 * j + 1]);
      }
    }
  }
}

template <int NT>
__global__ void __launch_bounds__(kThreads) aqlm_mma_kernel(const Params p) {
  // The part of this block (a select chain over the few parts).
  Part P = p.parts[0];
#pragma unroll
  for (int i = 1; i < kMaxParts; ++i)
    if (i < p.nparts && (int)blockIdx.x >= p.parts[i].block0) P = p.parts[i];
  const int tile0 = ((int)blockIdx.x - P.block0) * p.tiles_per_block;
  const int tile1 = min(P.tiles, tile0 + p.tiles_per_block);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int K = 8 * p.G, nchunks = p.G / kChunkGroups;
  const int cpw = nchunks > warp ? (nchunks - warp + kWarps - 1) / kWarps : 0;  // chunks of this warp per tile
  const int items = cpw * (tile1 - tile0);

  // The warp's code stream: item i = (tile tile0 + i / cpw, chunk warp + 8 (i % cpw)), loaded two items ahead;
  // (pf_tile, pf_j) is the next item to load, advanced by one per load (no division in the loop).
  int pf_tile = tile0, pf_j = 0;
  auto next_codes = [&]() {
    const uint4 v = ld_stream(P.codes + ((size_t)pf_tile * nchunks + warp + kWarps * pf_j) * kChunkBytes + lane * 16);
    if (++pf_j == cpw) { pf_j = 0; ++pf_tile; }
    return v;
  };
  uint4 q0 = make_uint4(0u, 0u, 0u, 0u), q1 = q0;
  if (items > 0) q0 = next_codes();
  if (items > 1) q1 = next_codes();

  // The table (weights only: before the PDL wait).
  uint8_t* smem = reinterpret_cast<uint8_t*>(trapetum_amma_smem);
  for (int i = threadIdx.x; i < 2 * 256; i += kThreads) {
    const int m = i >> 8, k = i & 255;
    const uint4 e = *reinterpret_cast<const uint4*>(P.cb + (size_t)(m * 256 + k) * 8);
    const uint32_t ew[4] = {e.x, e.y, e.z, e.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint4* dst = reinterpret_cast<uint4*>(smem + tab_byte(k, m, w, 0));
      dst[0] = make_uint4(ew[w], ew[w], ew[w], ew[w]);
      dst[1] = make_uint4(ew[w], ew[w], ew[w], ew[w]);
    }
  }
  uint32_t ofs[2][4];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int u = 0; u < 4; ++u) ofs[m][u] = (uint32_t)tab_byte(0, m, step_word(t, u), g);
  const uint32_t tab = (uint32_t)__cvta_generic_to_shared(trapetum_amma_smem);
  float* red = reinterpret_cast<float*>(smem + kTabBytes);  // [warp][32 rows][NT * 8 activation rows]
  __syncthreads();
  trapetum_pdl::wait_inputs();

  uint32_t xw[2][NT][4];
  if (items > 0) load_x<NT>(xw, p.x, p.M, K, g, t, warp);
  int i = 0;
  for (int tile = tile0; tile < tile1; ++tile) {
    float acc[2][NT][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[a][nt][e] = 0.0f;
    for (int j = 0; j < cpw; ++j, ++i) {
      const uint4 q = q0;
      q0 = q1;
      if (i + 2 < items) q1 = next_codes();
      uint32_t xn[2][NT][4];
      const int cn = j + 1 < cpw ? warp + kWarps * (j + 1) : warp;  // the next item's chunk
      if (i + 1 < items) load_x<NT>(xn, p.x, p.M, K, g, t, cn);
      compute_chunk<NT>(acc, q, ofs, xw, tab);
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) xw[s][nt][e] = (i + 1 < items) ? xn[s][nt][e] : xw[s][nt][e];
    }
    // D layout: acc[a][nt][0, 1] = rows 16a + g, activation rows nt * 8 + 2t, +1; [2, 3] = row 16a + g + 8.
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = 16 * a + g + 8 * (e >> 1), n = nt * 8 + 2 * t + (e & 1);
          red[(warp * kTileRows + row) * (NT * 8) + n] = acc[a][nt][e];
        }
    __syncthreads();
    for (int o = threadIdx.x; o < kTileRows * p.M; o += kThreads) {
      const int row = o % kTileRows, n = o / kTileRows, r = tile * kTileRows + row;
      if (r < P.N) {
        float s = red[row * (NT * 8) + n];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) s = __fadd_rn(s, red[(w * kTileRows + row) * (NT * 8) + n]);
        float v = __fmul_rn(s, __half2float(P.scales[r]));
        if (P.bias != nullptr) v = __fadd_rn(v, __half2float(P.bias[r]));
        if (p.has_res) v = __fadd_rn(v, trapetum_pdl::ld_input_half(p.res + (size_t)n * p.ldy + P.row0 + r));
        const size_t o_y = p.planes ? ((size_t)P.plane * p.M + n) * P.N + r : (size_t)n * p.ldy + P.row0 + r;
        p.y[o_y] = __float2half_rn(v);
      }
    }
    __syncthreads();
  }
  trapetum_pdl::allow_dependents();
}

inline int smem_bytes(int nt) { return kTabBytes + kWarps * kTileRows * nt * 8 * 4; }

}  // namespace trapetum_amma

#ifdef TRAPETUM_TORCH_LAUNCHER
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace trapetum_amma {
template <int NT>
static void launch(const Params& p, int grid, cudaStream_t stream, bool pdl) {
  auto kern = aqlm_mma_kernel<NT>;
  const int smem = smem_bytes(NT);
  constexpr int kDevices = 64;
  static bool attr_set[kDevices] = {};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= kDevices || !attr_set[dev]) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    if (dev < kDevices) attr_set[dev] = true;
  }
  C10_CUDA_CHECK(trapetum_pdl::launch(kern, dim3(grid), dim3(kThreads), smem, stream, pdl, p));
}
}  // namespace trapetum_amma

// x fp16 [M, 8 G]; codes: per part the packed uint8 buffer; cb fp16 [P, 2, 256, 8]; scales fp16 [sum N];
// bias fp16 [sum N] (has_bias); res, y fp16 [M, sum N]; meta int64 [P, 2]: (N, tiles); tiles_per_block >= 1.
// planes = 1: y fp16 [P, M, N] (every part N rows; part q's rows in plane q: a gate/up pair gives two contiguous
// halves for the activation kernel), no residual.
void aqlm_mma_2x8(torch::Tensor x, std::vector<torch::Tensor> codes, torch::Tensor cb, torch::Tensor scales,
                  torch::Tensor bias, torch::Tensor res, torch::Tensor y, torch::Tensor meta, int64_t has_bias,
                  int64_t has_res, int64_t tiles_per_block, int64_t pdl, int64_t planes) {
  using namespace trapetum_amma;
  const int P = (int)codes.size();
  TORCH_CHECK(P >= 1 && P <= kMaxParts && meta.size(0) == P && meta.size(1) == 2, "parts");
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kHalf && x.is_contiguous() && x.dim() == 2, "x");
  const int M = (int)x.size(0), K = (int)x.size(1);
  TORCH_CHECK(M >= 1 && M <= 16 && K % 64 == 0, "x rows / columns");
  TORCH_CHECK(cb.scalar_type() == at::kHalf && cb.is_contiguous() && cb.numel() == (int64_t)P * 2 * 256 * 8, "cb");
  TORCH_CHECK(y.scalar_type() == at::kHalf && y.is_contiguous(), "y");
  TORCH_CHECK(planes ? (y.dim() == 3 && y.size(0) == P && y.size(1) == M && !has_res)
                     : (y.dim() == 2 && y.size(0) == M), "y shape");
  TORCH_CHECK(!has_res || (res.scalar_type() == at::kHalf && res.is_contiguous() && res.sizes() == y.sizes()), "res");
  TORCH_CHECK(tiles_per_block >= 1, "tiles_per_block");
  const c10::cuda::CUDAGuard guard(x.device());
  Params p = {};
  p.nparts = P; p.tiles_per_block = (int)tiles_per_block; p.G = K / 8; p.M = M;
  p.ldy = planes ? (int)(P * y.size(2)) : (int)y.size(1);
  p.planes = (int)planes;
  p.has_res = (int)has_res; p.x = (const half*)x.data_ptr(); p.res = has_res ? (const half*)res.data_ptr() : nullptr;
  p.y = (half*)y.data_ptr();
  auto m = meta.cpu();
  int row0 = 0, block0 = 0;
  for (int q = 0; q < P; ++q) {
    const int N = (int)m[q][0].item<int64_t>(), tiles = (int)m[q][1].item<int64_t>();
    TORCH_CHECK(codes[q].is_cuda() && codes[q].is_contiguous() && codes[q].scalar_type() == at::kByte &&
                codes[q].numel() == (int64_t)tiles * (K / 64) * kChunkBytes && tiles == (N + 31) / 32, "codes");
    Part& Q = p.parts[q];
    Q.codes = codes[q].data_ptr<uint8_t>();
    Q.cb = (const half*)cb.data_ptr() + (size_t)q * 2 * 256 * 8;
    Q.scales = (const half*)scales.data_ptr() + row0;
    Q.bias = has_bias ? (const half*)bias.data_ptr() + row0 : nullptr;
    Q.N = N; Q.row0 = row0; Q.tiles = tiles; Q.block0 = block0; Q.plane = q;
    TORCH_CHECK(!planes || N == y.size(2), "planes: parts of equal rows");
    row0 += N;
    block0 += (tiles + (int)tiles_per_block - 1) / (int)tiles_per_block;
  }
  TORCH_CHECK(row0 == p.ldy && scales.numel() == row0 && (!has_bias || bias.numel() == row0), "rows");
  for (int q = P; q < kMaxParts; ++q) p.parts[q] = p.parts[P - 1];
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  if (M <= 8) launch<1>(p, block0, s, pdl != 0);
  else launch<2>(p, block0, s, pdl != 0);
}
#endif  // TRAPETUM_TORCH_LAUNCHER
