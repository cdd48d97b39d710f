// fp16 GEMV for the engine's fp16 path, M = 1..16 activation rows: y[m, o] = sum_k W[o, k] x[m, k] (+ res[m, o]),
// or the fused gate/up epilogue y[m, o] = act(W[o] . x[m]) * (W[F + o] . x[m]) over a [gate; up] row-stacked W.
//
// Design: the weight rows are read exactly once for all M rows, 16 bytes per lane per load, each warp instruction
// covering 512 contiguous bytes of one row (4 full 128-B lines: the minimum L1 wavefronts). One warp owns ROWS
// weight rows over the whole input: lane l takes the 16-byte pieces v = l, l + 32, l + 64, ... of each row in
// that order; U steps are issued before any arithmetic so that each lane keeps U * ROWS * 16 bytes of weights in
// flight (Little's law at ~4 TB/s needs ~30 KB per SM). x (2 bytes per column and row) is loaded per step for
// all rows and stays in L1 (coherent loads: it is the previous kernel's output, see pdl.cuh).
// fp32 accumulation with fmaf in a fixed order; the lane partials are combined by a fixed xor-shuffle tree:
// bitwise reproducible.
//
// Batch invariance: row m of an M-row call has exactly the bits of an M = 1 call on that row. For every (o, m)
// lane l computes the same fmaf chain (pieces v = l, l + 32, ... in order, 8 products each in column order,
// starting from 0) whatever M, ROWS and U are (they decide which loads are in flight, not the order of the
// arithmetic), then the same shuffle tree and the same epilogue. M = 1 is the decode path: ROWS = 2, U = 4, x
// loaded with the weights, as before the multi-row kernel; M > 1 rounds up to MR in {2, 4, 8, 16} (rows past M
// are neither loaded nor stored) and, from 4 rows on, gives each warp 4 weight rows so that the x loads
// (MR / ROWS times the weight bytes through L1) stay under the L1 bandwidth.
// Requires K % 8 == 0 (16-byte rows); the Python wrapper falls back to Triton / torch otherwise.
#include <cuda_fp16.h>
#include <stdint.h>
#include "pdl.cuh"
#include "act.cuh"

namespace trapetum_dense {

constexpr int kWarps = 4;

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

// EPI 0: warp rows o0 .. o0+ROWS-1 -> y[m, o] (+ residual). EPI 1 (SiLU) / 2 (GELU-tanh): the warp's P = ROWS / 2
// outputs o0 .. o0+P-1, rows o (gate) and F + o (up) -> y[m, o] = act(gate) * up. MR: activation rows (>= M).
template <int EPI, int ROWS, int MR, int U>
__global__ void __launch_bounds__(kWarps * 32)
dense_gemv_kernel(const half* __restrict__ x, const half* __restrict__ W, const half* __restrict__ res,
                  half* __restrict__ y, int N, int K, int F, int has_res, int M) {
  trapetum_pdl::allow_dependents();
  constexpr int P = EPI == 0 ? ROWS : ROWS / 2;  // outputs per warp
  const int lane = threadIdx.x & 31;
  const int wid = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int nout = EPI == 0 ? N : F;
  const int o0 = wid * P;
  if (o0 >= nout) return;
  const half* rows[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {  // rows past the end read the last one (valid loads, never stored)
    const int g = P == 1 ? o0 : min(o0 + (r < P ? r : r - P), F - 1);  // (gate/up: o0 < F already)
    const int row = EPI == 0 ? min(o0 + r, N - 1) : (r < P ? g : F + g);
    rows[r] = W + (size_t)row * K;
  }
  const int K8 = K >> 3;
  // weight-only prologue (PDL: may overlap the previous kernel): the first step's weight lines into L2
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (lane + 32 * u < K8)
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        asm volatile("prefetch.global.L2 [%0];" :: "l"(rows[r] + (size_t)(lane + 32 * u) * 8));
  trapetum_pdl::wait_inputs();  // x and the residual belong to the previous kernels
  float acc[ROWS][MR];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int m = 0; m < MR; ++m) acc[r][m] = 0.0f;
  const uint4* xv4 = reinterpret_cast<const uint4*>(x);
  for (int v0 = lane; v0 < K8; v0 += 32 * U) {
    uint4 wv[U][ROWS], xv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + 32 * u;
      if (v < K8) {
        if (MR == 1) xv[u] = trapetum_pdl::ld_input(xv4 + v);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) wv[u][r] = ld_stream(rows[r] + (size_t)v * 8);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + 32 * u;
      if (v < K8) {
        if (MR == 1) {
#pragma unroll
          for (int r = 0; r < ROWS; ++r) acc[r][0] = dot8(wv[u][r], xv[u], acc[r][0]);
        } else {
#pragma unroll
          for (int m = 0; m < MR; ++m) {
            if (m < M) {
              const uint4 xm = trapetum_pdl::ld_input(xv4 + (size_t)m * K8 + v);
#pragma unroll
              for (int r = 0; r < ROWS; ++r) acc[r][m] = dot8(wv[u][r], xm, acc[r][m]);
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int m = 0; m < MR; ++m) acc[r][m] = warp_sum(acc[r][m]);
  if (lane != 0) return;
  if (EPI == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int o = o0 + r;
      if (o >= N) continue;
#pragma unroll
      for (int m = 0; m < MR; ++m) {
        if (MR > 1 && m >= M) continue;
        const size_t i = (size_t)m * N + o;
        y[i] = __float2half(has_res ? acc[r][m] + trapetum_pdl::ld_input_half(res + i) : acc[r][m]);
      }
    }
  } else {
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int o = o0 + p;
      if (P > 1 && o >= F) continue;
#pragma unroll
      for (int m = 0; m < MR; ++m) {
        if (MR > 1 && m >= M) continue;
        const float a = trapetum_act::apply(EPI, acc[p][m]);
        y[(size_t)m * F + o] = __float2half(a * acc[P + p][m]);
      }
    }
  }
}

}  // namespace trapetum_dense

#ifdef TRAPETUM_TORCH_LAUNCHER
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace trapetum_dense {
struct Args {
  const half* x; const half* w; const half* res; half* y;
  int N, K, F, has_res, M;
};

template <int EPI, int ROWS, int MR, int U>
static void launch(const Args& a, cudaStream_t s, bool pdl) {
  constexpr int P = EPI == 0 ? ROWS : ROWS / 2;
  const int warps = ((EPI == 0 ? a.N : a.F) + P - 1) / P;
  C10_CUDA_CHECK(trapetum_pdl::launch(dense_gemv_kernel<EPI, ROWS, MR, U>, (warps + kWarps - 1) / kWarps, kWarps * 32,
                                      0, s, pdl, a.x, a.w, a.res, a.y, a.N, a.K, a.F, a.has_res, a.M));
}

// M = 1: ROWS = 2, U = 4 (the decode kernel); M = 2: the same with 2 rows; M = 3..16: 4 weight rows per warp.
template <int EPI>
static void by_rows(const Args& a, cudaStream_t s, bool pdl) {
  if (a.M == 1) launch<EPI, 2, 1, 4>(a, s, pdl);
  else if (a.M == 2) launch<EPI, 2, 2, 4>(a, s, pdl);
  else if (a.M <= 4) launch<EPI, 4, 4, 2>(a, s, pdl);
  else if (a.M <= 8) launch<EPI, 4, 8, 2>(a, s, pdl);
  else launch<EPI, 4, 16, 2>(a, s, pdl);
}
}  // namespace trapetum_dense

// x [M, K] (or [K]); y = W x (+ residual) [M, N] for epi 0; y = act(W[:F] x) * (W[F:2F] x) [M, F] for epi 1 / 2.
// pdl: launch with programmatic dependent launch (KernelOptions.pdl_cuda).
void dense_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor res, torch::Tensor y, int64_t epi,
                int64_t has_res, int64_t f, int64_t pdl) {
  using namespace trapetum_dense;
  TORCH_CHECK(w.is_cuda() && w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kHalf && w.size(1) % 8 == 0, "w");
  const int N = w.size(0), K = w.size(1), F = (int)f;
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.scalar_type() == at::kHalf && K > 0 && x.numel() % K == 0, "x");
  const int M = (int)(x.numel() / K);
  TORCH_CHECK(M >= 1 && M <= 16, "x: 1 to 16 rows");
  TORCH_CHECK(y.is_cuda() && y.is_contiguous() && y.scalar_type() == at::kHalf, "y");
  TORCH_CHECK(epi == 0 ? y.numel() == (int64_t)M * N : (epi <= 2 && F > 0 && 2 * F <= N && y.numel() == (int64_t)M * F), "y");
  TORCH_CHECK(!has_res || (res.is_contiguous() && res.scalar_type() == at::kHalf && res.numel() == (int64_t)M * N), "residual");
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  const Args a{reinterpret_cast<const half*>(x.data_ptr<at::Half>()), reinterpret_cast<const half*>(w.data_ptr<at::Half>()),
               reinterpret_cast<const half*>(res.data_ptr<at::Half>()), reinterpret_cast<half*>(y.data_ptr<at::Half>()),
               N, K, F, (int)has_res, M};
  const bool use_pdl = pdl != 0;
  if (epi == 0) by_rows<0>(a, s, use_pdl);
  else if (epi == 1) by_rows<1>(a, s, use_pdl);
  else by_rows<2>(a, s, use_pdl);
}
#endif
