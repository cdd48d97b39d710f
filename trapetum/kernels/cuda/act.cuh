// The gated activations of the GEMV epilogues, fp32: act(gate) * up is fused into the 4-bit gate/up GEMV
// (codebook_gemv_mma.cu) and into the 2x8 reduction (additive_gemv.cu). The fast exponential (__expf) on
// the GPU; the host build of the 2x8 kernels (tests/cuda/additive_2x8_host_check.cu) uses std::exp.
#pragma once
#include <cmath>

namespace trapetum_act {

__host__ __device__ __forceinline__ float fast_exp(float x) {
#ifdef __CUDA_ARCH__
  return __expf(x);
#else
  return std::exp(x);
#endif
}

__host__ __device__ __forceinline__ float silu(float g) { return g / (1.0f + fast_exp(-g)); }

__host__ __device__ __forceinline__ float gelu_tanh(float g) {
  float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  u = fminf(fmaxf(u, -15.0f), 15.0f);
  const float t = 1.0f - 2.0f / (fast_exp(2.0f * u) + 1.0f);
  return 0.5f * g * (1.0f + t);
}

// act: 1 = SiLU, 2 = GELU (tanh approximation).
__host__ __device__ __forceinline__ float apply(int act, float g) { return act == 1 ? silu(g) : gelu_tanh(g); }

}  // namespace trapetum_act
