// Programmatic dependent launch (PDL, sm_90+), shared by the package's CUDA kernels.
//
// A kernel launched through trapetum_pdl::launch may start while the previous kernel in the stream is
// still running, once every block of that kernel has called allow_dependents() (or exited). It must
// call wait_inputs() before it reads anything the previous kernels wrote (activations, residuals,
// partial sums) and before it writes anything; what it does before that may only read weights (codes,
// codebooks, scales), which no decode kernel writes. The GEMVs use that window for their weight-only
// prologue (table build from the codebook, first code loads), which otherwise starts only after the
// previous kernel (a norm, attention, another GEMV) has finished. wait_inputs() waits for the full
// completion of the previous kernel and the visibility of its memory, so results are unchanged.
// A launch with pdl = false (the kernel options' pdl "off" or "triton") goes without the attribute (each
// kernel then starts after the previous one ends, as with <<<>>>). Below sm_90 both device calls compile to nothing and the attribute is not set.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <utility>

namespace trapetum_pdl {

__device__ __forceinline__ void wait_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Loads of what earlier kernels wrote (activations, residuals) must stay below wait_inputs(). ptxas
// treats read-only-path loads (__ldg, ld.global.nc, and what it infers from const __restrict__) as free to
// move and was seen hoisting them above griddepcontrol.wait (the 2x8 kernel's x loads: wrong logits
// once the previous kernel could start early). These are ordinary coherent loads (ld.global.ca), which it
// keeps below the wait; unlike an asm volatile load they stay free to be scheduled otherwise.
__device__ __forceinline__ uint4 ld_input(const uint4* p) { return __ldca(p); }
__device__ __forceinline__ uint32_t ld_input(const uint32_t* p) { return __ldca(reinterpret_cast<const unsigned int*>(p)); }
__device__ __forceinline__ float ld_input_half(const half* p) { return __half2float(__ldca(p)); }

// PDL for launches on the current device: asked for by the caller (the kernel options' pdl_cuda, passed
// down from Python as each launcher's `pdl` argument) and sm_90+. The capability is looked up once per device.
inline bool enabled(bool want) {
  if (!want) return false;
  constexpr int kDevices = 64;
  static int major[kDevices] = {};  // 0: not looked up yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) return false;
  if (dev >= kDevices) return false;
  if (major[dev] == 0) {
    int m = 0;
    if (cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    major[dev] = m;
  }
  return major[dev] >= 9;
}

// kern<<<grid, block, smem, stream>>>(args...), with the PDL attribute when enabled(pdl).
template <typename... KArgs, typename... Args>
inline cudaError_t launch(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                          Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = enabled(pdl) ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kern, std::forward<Args>(args)...);
}

}  // namespace trapetum_pdl
