// fp16 GEMV for the engine's fp16 path (batch 1): y[o] = sum_k W[o, k] x[k] (+ residual[o]), or the
// fused gate/up epilogue y[o] = act(W[o] . x) * (W[F + o] . x) over a [gate; up] row-stacked W.
//
// Design: the weight rows are read exactly once, 16 bytes per lane per load, each warp instruction
// covering 512 contiguous bytes of one row (4 full 128-B lines: the minimum L1 wavefronts). One
// warp owns ROWS rows over the whole input (the x vector, 2 bytes per column, is loaded once per
// warp step for all ROWS rows and stays in L1/L2); U steps are issued before any arithmetic so
// that each lane keeps U * ROWS * 16 bytes in flight (Little's law at ~4 TB/s needs ~30 KB per SM).
// fp32 accumulation; the lane partials are combined by a fixed xor-shuffle tree: bitwise
// reproducible. Requires K % 8 == 0 (16-byte rows); the Python wrapper falls back to cuBLAS.
#include <cuda_fp16.h>
#include <stdint.h>
#include "pdl.cuh"
#include "act.cuh"

namespace trapetum_dense {

constexpr int kWarps = 4;
constexpr int kU = 4;

__device__ __forceinline__ uint4 ld_stream(const half* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ float dot8(const uint4 w, const uint4 x, float acc) {
  const uint32_t ww[4] = {w.x, w.y, w.z, w.w}, xx[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = __half22float2(*reinterpret_cast<const half2*>(&ww[i]));
    const float2 b = __half22float2(*reinterpret_cast<const half2*>(&xx[i]));
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// EPI 0: warp rows o0 .. o0+ROWS-1 -> y[o] (+ residual). EPI 1 (SiLU) / 2 (GELU-tanh): ROWS = 2,
// warp output o: rows o (gate) and F + o (up) -> y[o] = act(gate) * up.
template <int EPI, int ROWS>
__global__ void __launch_bounds__(kWarps * 32)
dense_gemv_kernel(const half* __restrict__ x, const half* __restrict__ W, const half* __restrict__ res,
                  half* __restrict__ y, int N, int K, int F, int has_res) {
  trapetum_pdl::allow_dependents();
  const int lane = threadIdx.x & 31;
  const int wid = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int nout = EPI == 0 ? N : F;
  const int o0 = wid * (EPI == 0 ? ROWS : 1);
  if (o0 >= nout) return;
  const half* rows[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int row = EPI == 0 ? min(o0 + r, N - 1) : (r == 0 ? o0 : F + o0);
    rows[r] = W + (size_t)row * K;
  }
  const int K8 = K >> 3;
  // weight-only prologue (PDL: may overlap the previous kernel): the first step's weight lines into L2
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (lane + 32 * u < K8)
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        asm volatile("prefetch.global.L2 [%0];" :: "l"(rows[r] + (size_t)(lane + 32 * u) * 8));
  trapetum_pdl::wait_inputs();  // x and the residual belong to the previous kernels
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
  for (int v0 = lane; v0 < K8; v0 += 32 * kU) {
    uint4 wv[kU][ROWS], xv[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = v0 + 32 * u;
      if (v < K8) {
        xv[u] = trapetum_pdl::ld_input(reinterpret_cast<const uint4*>(x) + v);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) wv[u][r] = ld_stream(rows[r] + (size_t)v * 8);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (v0 + 32 * u < K8)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = dot8(wv[u][r], xv[u], acc[r]);
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = warp_sum(acc[r]);
  if (lane != 0) return;
  if (EPI == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int o = o0 + r;
      if (o < N) y[o] = __float2half(has_res ? acc[r] + trapetum_pdl::ld_input_half(res + o) : acc[r]);
    }
  } else {
    const float a = trapetum_act::apply(EPI, acc[0]);
    y[o0] = __float2half(a * acc[1]);
  }
}

}  // namespace trapetum_dense

#ifdef TRAPETUM_TORCH_LAUNCHER
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

// y = W x (+ residual) for epi 0 (N = W rows); y = act(W[:F] x) * (W[F:2F] x) for epi 1 / 2.
void dense_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor res, torch::Tensor y, int64_t epi,
                int64_t has_res, int64_t f) {
  using namespace trapetum_dense;
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.scalar_type() == at::kHalf && x.numel() == w.size(1), "x");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kHalf && w.size(1) % 8 == 0, "w");
  const int N = w.size(0), K = w.size(1), F = (int)f;
  TORCH_CHECK(epi == 0 ? y.numel() == N : (2 * F <= N && y.numel() == F), "y");
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  const half* xp = reinterpret_cast<const half*>(x.data_ptr<at::Half>());
  const half* wp = reinterpret_cast<const half*>(w.data_ptr<at::Half>());
  const half* rp = reinterpret_cast<const half*>(res.data_ptr<at::Half>());
  half* yp = reinterpret_cast<half*>(y.data_ptr<at::Half>());
  const int threads = kWarps * 32;
  if (epi == 0) {
    const int warps = (N + 1) / 2;
    C10_CUDA_CHECK(trapetum_pdl::launch(dense_gemv_kernel<0, 2>, (warps + kWarps - 1) / kWarps, threads, 0, s,
                                        xp, wp, rp, yp, N, K, F, (int)has_res));
  } else {
    const int blocks = (F + kWarps - 1) / kWarps;
    C10_CUDA_CHECK(trapetum_pdl::launch(epi == 1 ? dense_gemv_kernel<1, 2> : dense_gemv_kernel<2, 2>, blocks, threads,
                                        0, s, xp, wp, rp, yp, N, K, F, 0));
  }
}
#endif
