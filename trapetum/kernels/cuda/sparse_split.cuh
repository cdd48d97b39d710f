// The ending of the split sparse GEMV (sparse_mma.cu, the "mma" kernel; once shared with a deleted first kernel):
// a block of kRows output rows (row group b of B, activation row m) and K range s of S holds each row's sum in `sum`.
// With S > 1 it writes its fp32 partial, and the last block of the row group to finish (a device counter, left at
// zero again) adds the S partials in range order s = 0, 1, ..; then the epilogue: EPI 0 y = sum (+ residual), else
// y = act(gate) * up of rows interleaved 8 / 8 (through `red`, the block's shared scratch of >= kRows floats).
// `active`: this thread holds row r (the mma kernel has more threads than rows). Same arithmetic, same order as
// the kernel had it inline.
#pragma once
#include <cuda_fp16.h>
#include "pdl.cuh"
#include "act.cuh"

namespace trapetum_sparse_split {

template <int EPI, int kRows>
__device__ __forceinline__ void finish(float sum, float* red, int& last, bool active, int tid, int r,
                                       float* __restrict__ part, int* __restrict__ cnt, int M, int Np, int s, int S,
                                       int m, int B, int b, int N, int F, const half* __restrict__ res, int has_res,
                                       half* __restrict__ y) {
  if (S > 1) {
    if (active) part[((size_t)s * M + m) * Np + b * kRows + r] = sum;
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(cnt + m * B + b, 1) == S - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    sum = 0.0f;
    const float* pp = part + (size_t)m * Np + b * kRows + r;
    const size_t step = (size_t)M * Np;
    for (int s0 = 0; s0 < S; s0 += 16) {  // 16 loads in flight, added in the order s = 0, 1, ..
      float v[16];
#pragma unroll
      for (int u = 0; u < 16; ++u) v[u] = s0 + u < S ? __ldcg(pp + (s0 + u) * step) : 0.0f;
#pragma unroll
      for (int u = 0; u < 16; ++u)
        if (s0 + u < S) sum += v[u];
    }
    if (tid == 0) cnt[m * B + b] = 0;
  }
  const int row = b * kRows + r;
  if (EPI == 0) {
    if (active && row < N) {
      if (has_res) sum += trapetum_pdl::ld_input_half(res + (size_t)m * N + row);
      y[(size_t)m * N + row] = __float2half(sum);
    }
  } else {
    __syncthreads();  // red read by every thread before (S = 1)
    if (active) red[tid] = sum;
    __syncthreads();
    if (active && (tid & 15) < 8) {
      const int o = b * (kRows / 2) + (tid >> 4) * 8 + (tid & 7);
      if (o < F) y[(size_t)m * F + o] = __float2half(trapetum_act::apply(EPI, red[tid]) * red[tid + 8]);
    }
  }
}

}  // namespace trapetum_sparse_split
