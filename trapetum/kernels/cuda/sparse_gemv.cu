// Activation-sparse 4-bit per-row codebook GEMV (kernels/sparse_cuda.py is its Python side): the codes of the
// inputs that the threshold drops are not read.
//
// y[m, r] = sum over kept k of x[m, k] * codebook[r, idx(r, k)]  (+ residual[m, r]), fp32 accumulation, where
// kept = |x[m, k]| > t, or x[m, k] != 0 on a dense row (dense[m] != 0: positions kept whole).
//
// Code layout (warp-major, made once at load, sparse_cuda.warp_major_codes): uint32 cw[G][K][32], G = ceil(N / 256);
// word cw[g][k][lane] holds the 8 nibbles of input k for rows 256 g + lane + 32 i, i = 0..7 (nibble i in bits
// 4i..4i+3); rows >= N hold code 0. A warp's load of one kept input is 128 contiguous bytes (one line).
//
// Block (8 warps) = one group g of 256 rows x one K range [s KS, (s + 1) KS) (split s of S) x activation row m:
//  1. (weights only: before the PDL wait) the 256 rows' codebooks into shared memory as fp32, [entry e][row]:
//     lane reads entry e of row lane + 32 i at word e * 256 + lane + 32 i, bank = lane: conflict-free.
//  2. the kept inputs of the range, ascending, into a shared list (k, x) (warp ballots and a block prefix).
//  3. warp w takes list entries [w L, (w + 1) L), L = ceil(nnz / 8), 16 loads in flight; lane accumulates its 8
//     rows in fp32 (fmaf, list order).
//  4. the 8 warps' sums added per row in warp order (shared memory). S = 1: the epilogue. S > 1: the partial to
//     part[s][m][256 g + r]; the block that finishes last for (g, m) (a device counter, fenced) sums the S partials
//     in the order s = 0, 1, .. and writes the epilogue, then resets the counter to 0 for the next call.
// Every sum and its order depend on row m's own data (its list) and on the shape (S from K and N only, never M):
// deterministic, and a row's bits are those of its one-row call. No host sync: capturable.
// EPI 0: y [M, N] fp16 = sum (+ residual). EPI 1 / 2: rows interleaved 8 gate / 8 up per 16 (N % 16 == 0),
// y [M, F] fp16 = act(gate) * up (act.cuh: SiLU / GELU-tanh), o = 8 (r / 16) + r % 16 for r % 16 < 8, o < F.
#include <cuda_fp16.h>
#include <stdint.h>
#include "pdl.cuh"
#include "act.cuh"
#include "sparse_split.cuh"

namespace trapetum_sparse {

constexpr int kThreads = 256;
constexpr int kWarps = 8;
constexpr int kRows = 256;     // rows per group
constexpr int kMaxKS = 1024;   // inputs per K range (the launcher picks S so that KS <= kMaxKS)
constexpr int kUnroll = 16;    // code loads in flight per warp

__device__ __forceinline__ uint32_t ld_code(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

template <int EPI>
__global__ void __launch_bounds__(kThreads)  // 64 registers (ptxas -v): 4 blocks an SM
sparse_gemv_kernel(const half* __restrict__ x, const uint32_t* __restrict__ cw, const half* __restrict__ cb,
                   const half* __restrict__ res, const uint8_t* dense, half* __restrict__ y,
                   float* __restrict__ part, int* __restrict__ cnt, float t, int M, int N, int K, int KS, int S,
                   int has_res, int F) {
  trapetum_pdl::allow_dependents();
  __shared__ float cbs[16 * kRows];     // [entry][row]; reused for the warps' partial sums after step 3
  __shared__ int sk[kMaxKS];            // kept inputs of the range, ascending
  __shared__ float sx[kMaxKS];          // their x values
  __shared__ int wcount[kWarps];
  __shared__ int last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = blockIdx.x / S, s = blockIdx.x % S, m = blockIdx.y;
  const int G = gridDim.x / S;
  const int Np = G * kRows;

  {  // 1. codebook of row 256 g + tid (clamped: rows past N are never stored)
    const int r = min(g * kRows + tid, N - 1);
    const uint4* cp = reinterpret_cast<const uint4*>(cb + (size_t)r * 16);
    const uint4 c0 = __ldg(cp), c1 = __ldg(cp + 1);
    const uint32_t w8[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const __half2 h2 = *reinterpret_cast<const __half2*>(&w8[e]);
      cbs[(2 * e) * kRows + tid] = __low2float(h2);
      cbs[(2 * e + 1) * kRows + tid] = __high2float(h2);
    }
  }
  trapetum_pdl::wait_inputs();  // x, the residual, y, part and the counters belong to the previous kernels

  // 2. the kept inputs of [k_lo, k_hi), in chunks of 256 (x of all chunks loaded first: KS <= 4 chunks)
  const int k_lo = s * KS, k_hi = min(k_lo + KS, K);
  const bool dn = __ldca(dense + m) != 0;  // written by an earlier kernel: a coherent load, kept below the wait
  constexpr int kChunks = kMaxKS / kThreads;
  float xr[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int k = k_lo + c * kThreads + tid;
    xr[c] = k < k_hi ? trapetum_pdl::ld_input_half(x + (size_t)m * K + k) : 0.0f;
  }
  int nnz = 0;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int k0 = k_lo + c * kThreads;
    if (k0 >= k_hi) break;  // block-uniform
    const int k = k0 + tid;
    const float xv = xr[c];
    const bool keep = k < k_hi && (dn ? xv != 0.0f : fabsf(xv) > t);
    const uint32_t b = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) wcount[warp] = __popc(b);
    __syncthreads();
    int before = nnz, total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int nw = wcount[w];
      before += w < warp ? nw : 0;
      total += nw;
    }
    if (keep) {
      const int j = before + __popc(b & ((1u << lane) - 1u));
      sk[j] = k;
      sx[j] = xv;
    }
    nnz += total;
    __syncthreads();  // wcount reused by the next chunk; the list complete after the last
  }

  // 3. warp w: entries [w L, min((w + 1) L, nnz))
  const int L = (nnz + kWarps - 1) / kWarps;
  const int j_lo = warp * L, j_hi = min(j_lo + L, nnz);
  const uint32_t* cwg = cw + (size_t)g * K * 32 + lane;
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
  for (int j0 = j_lo; j0 < j_hi; j0 += kUnroll) {
    const int n = min(kUnroll, j_hi - j0);  // warp-uniform
    uint32_t w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (u < n) w[u] = ld_code(cwg + (size_t)sk[j0 + u] * 32);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (u < n) {
        const float xv = sx[j0 + u];
        const uint32_t c = w[u];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(xv, cbs[((c >> (4 * i)) & 15u) * kRows + lane + 32 * i], acc[i]);
      }
    }
  }

  // 4. the warps' sums in warp order, per row tid
  __syncthreads();  // every warp done with the codebook: its space holds the partials
  float* red = cbs;
#pragma unroll
  for (int i = 0; i < 8; ++i) red[warp * kRows + lane + 32 * i] = acc[i];
  __syncthreads();
  float sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += red[w * kRows + tid];
  trapetum_sparse_split::finish<EPI, kRows>(sum, red, last, true, tid, tid, part, cnt, M, Np, s, S, m, G, g, N, F,
                                            res, has_res, y);
}

}  // namespace trapetum_sparse

#ifdef TRAPETUM_TORCH_LAUNCHER
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include "sparse_split_args.cuh"

// x fp16 [M, K] contiguous; cw int32 [G, K, 32] (warp-major codes, file comment); cb fp16 [N, 16]; dense uint8 [M];
// y fp16 [M, N] (epi 0) or [M, f] (epi 1, 2); res fp16 [M, N] (read when has_res); part fp32 [S, M, 256 G]
// (S > 1); cnt int32, at least M G elements, zero (left zero). splits S: K ranges of ceil(K / S) <= 1024 inputs.
void cb_sparse_gemv(torch::Tensor x, torch::Tensor cw, torch::Tensor cb, torch::Tensor res, torch::Tensor dense,
                    torch::Tensor y, torch::Tensor part, torch::Tensor cnt, double t, int64_t epi, int64_t has_res,
                    int64_t f, int64_t splits, int64_t pdl) {
  using namespace trapetum_sparse;
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kHalf, "x");
  const int M = x.size(0), K = x.size(1);
  TORCH_CHECK(cw.is_cuda() && cw.dim() == 3 && cw.is_contiguous() && cw.scalar_type() == at::kInt && cw.size(1) == K &&
              cw.size(2) == 32, "codes: int32 [G, K, 32]");
  const int G = cw.size(0);
  const int S = (int)splits;
  const int KS = (K + S - 1) / S;
  const int N = trapetum_sparse_split::check_args(cb, res, dense, y, part, cnt, M, K, G, kRows, kMaxKS, epi, has_res,
                                                 f, S);
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t st = c10::cuda::getCurrentCUDAStream().stream();
  auto kern = epi == 0 ? sparse_gemv_kernel<0> : epi == 1 ? sparse_gemv_kernel<1> : sparse_gemv_kernel<2>;
  const dim3 grid((unsigned)(G * S), (unsigned)M);
  C10_CUDA_CHECK(trapetum_pdl::launch(
      kern, grid, kThreads, 0, st, pdl != 0, reinterpret_cast<const half*>(x.data_ptr<at::Half>()),
      reinterpret_cast<const uint32_t*>(cw.data_ptr<int32_t>()), reinterpret_cast<const half*>(cb.data_ptr<at::Half>()),
      reinterpret_cast<const half*>(res.data_ptr<at::Half>()), dense.data_ptr<uint8_t>(),
      reinterpret_cast<half*>(y.data_ptr<at::Half>()), part.data_ptr<float>(), cnt.data_ptr<int32_t>(), (float)t, M, N,
      K, KS, S, (int)has_res, (int)f));
}
#endif
