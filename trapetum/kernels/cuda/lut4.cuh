// The 4-bit codebook's byte-permute lookups in registers, shared by the prefill dequantization
// (codebook_gemv_mma.cu, cb_dequant4_kernel) and the many-row wgmma GEMV (codebook_gemm_wgmma.cu): a row's 16-entry
// fp16 codebook held as byte planes (low bytes L[4], high bytes H[4]), looked up 4 nibbles at a time.
//   Per 16-bit piece v (4 nibbles): s7 = v & 0x7777 (byte index inside each 8-entry half),
//   sf = ((v >> 1) & 0x4444) | 0x3210 (per output byte: half 0 or 1 = bit 3 of the nibble);
//   lo = PRMT(PRMT(L0,L1,s7), PRMT(L2,L3,s7), sf), hi likewise from H; pairs = PRMT(lo, hi, 0x5140 / 0x7362):
//   p01 = (cb[n0], cb[n1]), p23 = (cb[n2], cb[n3]) as half2 words (nibble n0 = the low nibble of the low byte).
// Raw PTX prmt: the selectors never set bit 3, and going around __byte_perm keeps nvcc from re-masking them.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

namespace trapetum_lut {

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ void lut4(uint32_t s7, uint32_t sf, const uint32_t (&L)[4], const uint32_t (&H)[4],
                                     uint32_t& p01, uint32_t& p23) {
  const uint32_t lo = prmt(prmt(L[0], L[1], s7), prmt(L[2], L[3], s7), sf);
  const uint32_t hi = prmt(prmt(H[0], H[1], s7), prmt(H[2], H[3], s7), sf);
  p01 = __byte_perm(lo, hi, 0x5140);
  p23 = __byte_perm(lo, hi, 0x7362);
}

// lut4 of the 16-bit piece v (its selectors computed here).
__device__ __forceinline__ void lut4_piece(uint32_t v, const uint32_t (&L)[4], const uint32_t (&H)[4],
                                           uint32_t& p01, uint32_t& p23) {
  lut4(v & 0x7777u, ((v >> 1) & 0x4444u) | 0x3210u, L, H, p01, p23);
}

// Row r's codebook (fp16 [., 16]) as byte planes.
__device__ __forceinline__ void load_planes(const half* __restrict__ cb, int r, uint32_t (&L)[4], uint32_t (&H)[4]) {
  const uint4* cp = reinterpret_cast<const uint4*>(cb + (size_t)r * 16);
  const uint4 c0 = __ldg(cp), c1 = __ldg(cp + 1);
  const uint32_t c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    L[q] = __byte_perm(c[2 * q], c[2 * q + 1], 0x6420);
    H[q] = __byte_perm(c[2 * q], c[2 * q + 1], 0x7531);
  }
}

}  // namespace trapetum_lut
