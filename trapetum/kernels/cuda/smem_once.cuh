// Launcher-side helper shared by the extensions whose kernels take dynamic shared memory above 48 KB
// (codebook_gemv_mma.cu, expert_gemv_mma.cu through it, sparse_mma.cu, codebook_gemm_wgmma.cu): include after the
// torch / c10 headers.
#pragma once

namespace trapetum_launch {

constexpr int kAttrDevices = 64;
// kern's dynamic shared memory size and carveout, set once per device (function attributes are per device; done:
// the caller's flags, one array per kernel instantiation)
template <typename Kern>
static void set_smem_once(Kern kern, bool (&done)[kAttrDevices], int smem_bytes, int carveout) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < kAttrDevices && done[dev]) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, carveout));
  if (dev < kAttrDevices) done[dev] = true;
}

}  // namespace trapetum_launch
