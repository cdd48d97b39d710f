// Experimental variants of the 4-/8-bit codebook GEMV, kept for measurements (trapetum.kernels.experimental.
// codebook_gemv_variants, eval/bench_kernels.py); no production path calls them. This is the production kernel as
// it was before the multi-row work (its M > 1 rows read x in place: the baseline of `bench_kernels --rows`) and its
// earlier variants (NOTES-kernels.md has the measurements):
//   V = 3: shared-memory pair tables, conflict-free register-sourced table build, x one chunk ahead;
//   V = 4: byte-permute (PRMT) lookups from codebook byte planes in registers (4-bit; 8-bit runs V = 3);
//   V = 5: V = 3 with x loaded only by the lanes whose activation row exists;
//   V = 7: V = 5 with no code loads past the last chunk (the production kernel on canonical codes);
//   V = 11: V = 7 on codes tiled at load (codebook_layout.tile_codes; the production kernel on tiled codes).
// Same table layout, mma fragment mapping and reduction as the production kernel (codebook_gemv_mma.cu), so the
// same bits. Loaded as an extension of its own (cuda_ext.Extension), so the production build does not compile it.
#include <cuda_fp16.h>
#include <stdint.h>
#include "pdl.cuh"
#include "act.cuh"
#include "lut4.cuh"

// Dynamic shared memory, named at file scope so PTX can take its address as a constant
// (ptxas then folds the table base into the LDS immediate: PRMT + LDS per lookup).
extern __shared__ __align__(16) uint32_t trapetum_cbgemv_x_smem[];

namespace trapetum_mma_x {

constexpr int kThreads = 256;
constexpr int kWarps = 8;
constexpr int kTabWords = 2 * 256 * 32;  // 64 KB

__device__ __forceinline__ uint4 ld_stream(const uint8_t* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of table entry (byte k of w) for this lane: (byte << 8) | lane*4, one PRMT.
// Table layout: word e*64 + h*32 + lane  (entry e, row half h), so byte offset e*256 + h*128 + lane*4.
__device__ __forceinline__ uint32_t sel_byte(uint32_t w, uint32_t lane4, int k) {
  return __byte_perm(w, lane4, 0x5504 | (k << 4));
}
__device__ __forceinline__ uint32_t lds(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

template <int BITS>
struct XWords { static constexpr int value = (BITS == 4) ? 16 : 8; };  // half2 words of x per lane-chunk

// x words of one lane-chunk for activation rows g (nt = 0) and g + 8 (nt = 1).
// Columns n >= M of the mma result are never read. XP = false: lanes past M load row M-1 (valid,
// unused; at M = 1 all 8 lane groups read the same x, 8x the L1 wavefronts). XP = true: lanes
// past M skip the load and keep the zeros their registers were initialised with.
template <int BITS, int NT, bool XP>
__device__ __forceinline__ void load_x(uint32_t (&xw)[NT][XWords<BITS>::value], const half* __restrict__ x,
                                       int M, int K, int g, int off) {
  constexpr int XW = XWords<BITS>::value;
  const int col0 = (BITS == 4) ? 2 * off : off;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (XP && nt * 8 + g >= M) continue;
    const int m = min(nt * 8 + g, M - 1);
    const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)m * K + col0);
#pragma unroll
    for (int i = 0; i < XW / 4; ++i) {
      uint4 v = trapetum_pdl::ld_input(xp + i);  // x: written by the previous kernel
      xw[nt][4 * i + 0] = v.x; xw[nt][4 * i + 1] = v.y;
      xw[nt][4 * i + 2] = v.z; xw[nt][4 * i + 3] = v.w;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// V = 4 (4-bit only): no shared-memory table. Each lane keeps the 16-entry codebooks of its two
// rows as byte planes in registers (low bytes L[4], high bytes H[4]: 8 registers per row) and
// dequantizes 4 weights (one 16-bit piece = 4 nibbles) with byte permutes:
//   s7 = v & 0x7777                    byte index inside each 8-entry half
//   sf = ((v >> 1) & 0x4444) | 0x3210  per output byte: take half 0 or half 1 (bit 3 of the nibble)
//   lo = PRMT(PRMT(L0,L1,s7), PRMT(L2,L3,s7), sf); hi likewise from H
//   A-operand pairs = PRMT(lo, hi, 0x5140), PRMT(lo, hi, 0x7362)
// 11 ALU instructions per 4 weights and no shared-memory traffic: the V3 kernel was bound by the
// L1/shared-memory pipe (ncu: L1/TEX 83%, MIO-queue stalls), this one by instruction issue.
// (prmt, lut4 and load_planes: lut4.cuh, shared with the production kernels.)
using trapetum_lut::prmt;
using trapetum_lut::lut4;
using trapetum_lut::load_planes;

// The code stream of one lane: 16 bytes of rows g and g+8 of a 16-row tile per 64-byte chunk.
// Canonical layout (TILED = false): rows past N read row N-1 (valid loads; never stored); a warp load
// touches 8 rows (8 L1 wavefronts). Tiled layout (TILED = true, ``tile_codes`` in codebook_gemv.py,
// made once at load): per 16-row tile, chunk c's 1,024 bytes are [h][g][t][16 B] (h: rows g / g+8),
// so each warp load is 512 contiguous bytes (4 wavefronts); rows are padded to 16.
// PP = false: chunks past the end re-read the last chunk (unpredicated, never computed); PP = true:
// they are not loaded at all.
template <bool PP, bool TILED>
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
    if (PP) {
      if (c < nchunks) {
        qa = ld_stream(pa + c * kStride);
        qb = ld_stream(pb + c * kStride);
      }
    } else {
      const int cc = min(c, nchunks - 1);
      qa = ld_stream(pa + cc * kStride);
      qb = ld_stream(pb + cc * kStride);
    }
  }
};

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
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma16816(acc[nt], A, xw[nt][2 * j], xw[nt][2 * j + 1]);
  }
}

// Fixed-order reduction of the 8 warps' partial sums through shared memory, then the epilogue.
template <int NT, int EPI>
__device__ __forceinline__ void reduce_store(float* red, const float (&acc)[NT][4], int tid, int lane, int warp,
                                             int row0, int M, int N, int F, int has_res,
                                             const half* __restrict__ res, half* __restrict__ y) {
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
      const int o = blockIdx.x * 8 + rr;
      if (o < F && m < M) {
        const float a = trapetum_act::apply(EPI, sg);
        y[(size_t)m * F + o] = __float2half(a * su);
      }
    }
  }
}


// EPI 0: y = x W^T (+ residual). EPI 1 / 2: rows interleaved as 8 gate then 8 up rows per
// 16-row tile; y[m, o] = act(gate) * up with act = SiLU (1) or GELU-tanh (2), o < F.
// V = 3: conflict-free register-sourced table build, x prefetched one chunk ahead (M<=8).
// V = 5: V = 3 with x loaded only by the lanes whose activation row exists (load_x's XP).
// V = 7: V = 5 with no loads past the last chunk (the clamped prefetches re-read the last chunk:
//        +25% code traffic through L1 at in = 8192, +50% at in = 4096).
// V = 11: V = 7 on the tiled code layout (a warp's code load is 512 contiguous bytes: 4 L1 wavefronts
//        instead of 8); rows of `codes` padded to 16.
// (Measured and removed, see NOTES-kernels.md and git history: V = 2, the first version; V = 6, V = 4
// with XP; V = 8-10, hybrids looking up 2-4 of every 8 tiles with V = 4's PRMT method.)
template <int BITS, int NT, int EPI, int V>
__global__ void __launch_bounds__(kThreads, NT == 1 ? 3 : 2)
cb_gemv_mma_kernel(const half* __restrict__ x, const uint8_t* __restrict__ codes,
                   const half* __restrict__ cb, const half* __restrict__ res,
                   half* __restrict__ y, int M, int N, int K, int KB, int has_res, int F) {
  constexpr bool XP = V >= 5, PP = V >= 7, TILED = V == 11;
  trapetum_pdl::allow_dependents();
  uint32_t* smem = trapetum_cbgemv_x_smem;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  const CodeStream<PP, TILED> cs(codes, N, KB, row0, g, t);
  const int nchunks = cs.nchunks;
  auto load = [&](int c, uint4& qa, uint4& qb) { cs.load(c, qa, qb); };

  // Two chunks in flight before the table build, so DRAM latency overlaps it.
  // (with PP, registers of chunks past the end are left unloaded: they are never computed)
  uint4 qa0, qb0, qa1, qb1;
  load(warp, qa0, qb0);
  load(warp + kWarps, qa1, qb1);

  {
    // Thread (gg, h, s): row h*8+gg (clamped: rows past N are never stored), 16 entries whose
    // words land, for each unrolled step, as 8 consecutive uint4 per quarter-warp: no conflicts.
    const int gg = tid & 7, h = (tid >> 3) & 1, sIdx = tid >> 4;
    const int r = min(row0 + h * 8 + gg, N - 1);
    if (BITS == 4) {
      const uint4* cp = reinterpret_cast<const uint4*>(cb + (size_t)r * 16);
      const uint4 c0 = __ldg(cp), c1 = __ldg(cp + 1);
      const uint32_t cw[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
      const uint32_t lov = __half_as_ushort(cb[(size_t)r * 16 + sIdx]);  // low nibble = sIdx
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
  __syncthreads();
  // everything above read weights only (PDL: it may overlap the previous kernel); x, the residual and
  // y belong to the previous kernels
  trapetum_pdl::wait_inputs();

  uint32_t sb;
  asm("mov.u32 %0, trapetum_cbgemv_x_smem;" : "=r"(sb));
  const uint32_t lane4 = (uint32_t)lane * 4u;
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  constexpr int XW = XWords<BITS>::value;
  const int offt = t * 16;

  if (NT == 1) {
    // one chunk per step; codes two steps ahead, x one step ahead
    uint32_t xw0[NT][XW] = {}, xw1[NT][XW] = {};
    load_x<BITS, NT, XP>(xw0, x, M, K, g, min(warp, nchunks - 1) * 64 + offt);
    for (int c = warp; c < nchunks; c += kWarps) {
      uint4 qa2, qb2;
      load(c + 2 * kWarps, qa2, qb2);
      load_x<BITS, NT, XP>(xw1, x, M, K, g, min(c + kWarps, nchunks - 1) * 64 + offt);
      compute_chunk<BITS, NT>(acc, qa0, qb0, sb, lane4, xw0);
      qa0 = qa1; qb0 = qb1; qa1 = qa2; qb1 = qb2;
#pragma unroll
      for (int i = 0; i < XW; ++i) xw0[0][i] = xw1[0][i];
    }
  } else {
    uint32_t xw[NT][XW] = {};
    for (int c = warp; c < nchunks; c += 2 * kWarps) {
      uint4 qa2, qb2, qa3, qb3;
      load(c + 2 * kWarps, qa2, qb2);
      load_x<BITS, NT, XP>(xw, x, M, K, g, c * 64 + offt);
      compute_chunk<BITS, NT>(acc, qa0, qb0, sb, lane4, xw);
      load(c + 3 * kWarps, qa3, qb3);
      if (c + kWarps < nchunks) {
        load_x<BITS, NT, XP>(xw, x, M, K, g, (c + kWarps) * 64 + offt);
        compute_chunk<BITS, NT>(acc, qa1, qb1, sb, lane4, xw);
      }
      qa0 = qa2; qb0 = qb2; qa1 = qa3; qb1 = qb3;
    }
  }

  __syncthreads();  // every warp is done with the table: reuse it for the reduction
  reduce_store<NT, EPI>(reinterpret_cast<float*>(smem), acc, tid, lane, warp, row0, M, N, F, has_res, res, y);
}

template <int NT>
__device__ __forceinline__ void compute_chunk_prmt(float (&acc)[NT][4], const uint4 qa, const uint4 qb,
                                                   const uint32_t (&LA)[4], const uint32_t (&HA)[4],
                                                   const uint32_t (&LB)[4], const uint32_t (&HB)[4],
                                                   const uint32_t (&xw)[NT][16]) {
  const uint32_t wa4[4] = {qa.x, qa.y, qa.z, qa.w};
  const uint32_t wb4[4] = {qb.x, qb.y, qb.z, qb.w};
  uint32_t base;  // 0x32103210 kept in a register so that sf is one LOP3: (w >> 1 & 0x44..) | base
  asm("mov.b32 %0, 0x32103210;" : "=r"(base));
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // word i holds tiles 2i (low 16 bits) and 2i+1 (high 16 bits)
    const uint32_t a7 = wa4[i] & 0x77777777u, af = ((wa4[i] >> 1) & 0x44444444u) | base;
    const uint32_t b7 = wb4[i] & 0x77777777u, bf = ((wb4[i] >> 1) & 0x44444444u) | base;
#pragma unroll
    for (int half_ = 0; half_ < 2; ++half_) {
      const int j = 2 * i + half_;
      const int sh = 16 * half_;
      uint32_t A[4];
      lut4(a7 >> sh, af >> sh, LA, HA, A[0], A[2]);
      lut4(b7 >> sh, bf >> sh, LB, HB, A[1], A[3]);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma16816(acc[nt], A, xw[nt][2 * j], xw[nt][2 * j + 1]);
    }
  }
}

template <int NT, int EPI>
__global__ void __launch_bounds__(kThreads, 2)
cb_gemv_prmt_kernel(const half* __restrict__ x, const uint8_t* __restrict__ codes,
                    const half* __restrict__ cb, const half* __restrict__ res,
                    half* __restrict__ y, int M, int N, int K, int KB, int has_res, int F) {
  __shared__ float red[kWarps * NT * 4 * 32];
  trapetum_pdl::allow_dependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  const int ra = min(row0 + g, N - 1), rb = min(row0 + g + 8, N - 1);
  const CodeStream<false, false> cs(codes, N, KB, row0, g, t);
  const int nchunks = cs.nchunks;
  auto load = [&](int c, uint4& qa, uint4& qb) { cs.load(c, qa, qb); };
  uint4 qa0, qb0, qa1, qb1;
  load(warp, qa0, qb0);
  load(warp + kWarps, qa1, qb1);
  uint32_t LA[4], HA[4], LB[4], HB[4];
  load_planes(cb, ra, LA, HA);
  load_planes(cb, rb, LB, HB);
  trapetum_pdl::wait_inputs();  // codes and codebook above; x below
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  const int offt = t * 16;
  uint32_t xw0[NT][16] = {}, xw1[NT][16] = {};
  load_x<4, NT, false>(xw0, x, M, K, g, min(warp, nchunks - 1) * 64 + offt);
  for (int c = warp; c < nchunks; c += 2 * kWarps) {  // two chunks per step: x ping-pongs
    uint4 qa2, qb2, qa3, qb3;
    load(c + 2 * kWarps, qa2, qb2);
    load_x<4, NT, false>(xw1, x, M, K, g, min(c + kWarps, nchunks - 1) * 64 + offt);
    compute_chunk_prmt<NT>(acc, qa0, qb0, LA, HA, LB, HB, xw0);
    load(c + 3 * kWarps, qa3, qb3);
    load_x<4, NT, false>(xw0, x, M, K, g, min(c + 2 * kWarps, nchunks - 1) * 64 + offt);
    if (c + kWarps < nchunks) compute_chunk_prmt<NT>(acc, qa1, qb1, LA, HA, LB, HB, xw1);
    qa0 = qa2; qb0 = qb2; qa1 = qa3; qb1 = qb3;
  }
  reduce_store<NT, EPI>(red, acc, tid, lane, warp, row0, M, N, F, has_res, res, y);
}

}  // namespace trapetum_mma_x

#ifdef TRAPETUM_TORCH_LAUNCHER
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace trapetum_mma_x {
template <int BITS, int NT, int EPI, int V>
static void launch(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& cb,
                   const torch::Tensor& res, torch::Tensor& y, int M, int N, int K, int KB,
                   int has_res, int F, cudaStream_t stream, bool pdl) {
  auto kern = cb_gemv_mma_kernel<BITS, NT, EPI, V>;
  const int smem_bytes = kTabWords * 4;
  static bool attr_set = false;
  if (!attr_set) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    // all of the unified L1/shared array as shared memory, so 3 blocks (3 x 65.5 KB) fit per SM
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    attr_set = true;
  }
  const int grid = (N + 15) / 16;
  C10_CUDA_CHECK(trapetum_pdl::launch(kern, grid, kThreads, smem_bytes, stream, pdl,
      reinterpret_cast<const half*>(x.data_ptr<at::Half>()), (const uint8_t*)codes.data_ptr<uint8_t>(),
      reinterpret_cast<const half*>(cb.data_ptr<at::Half>()),
      reinterpret_cast<const half*>(res.data_ptr<at::Half>()),
      reinterpret_cast<half*>(y.data_ptr<at::Half>()), M, N, K, KB, has_res, F));
}

template <int NT, int EPI>
static void launch_prmt(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& cb,
                        const torch::Tensor& res, torch::Tensor& y, int M, int N, int K, int KB,
                        int has_res, int F, cudaStream_t stream, bool pdl) {
  const int grid = (N + 15) / 16;
  C10_CUDA_CHECK(trapetum_pdl::launch(cb_gemv_prmt_kernel<NT, EPI>, grid, kThreads, 0, stream, pdl,
      reinterpret_cast<const half*>(x.data_ptr<at::Half>()), (const uint8_t*)codes.data_ptr<uint8_t>(),
      reinterpret_cast<const half*>(cb.data_ptr<at::Half>()),
      reinterpret_cast<const half*>(res.data_ptr<at::Half>()),
      reinterpret_cast<half*>(y.data_ptr<at::Half>()), M, N, K, KB, has_res, F));
}

// One launcher per kernel family; NT (activation rows <= 8 or <= 16) and the epilogue are picked here.
template <int BITS, int V>
struct TableKernel {
  template <int NT, int EPI>
  static void go(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& cb, const torch::Tensor& res,
                 torch::Tensor& y, int M, int N, int K, int KB, int has_res, int F, cudaStream_t s, bool pdl) {
    launch<BITS, NT, EPI, V>(x, codes, cb, res, y, M, N, K, KB, has_res, F, s, pdl);
  }
};
struct PrmtKernel {
  template <int NT, int EPI>
  static void go(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& cb, const torch::Tensor& res,
                 torch::Tensor& y, int M, int N, int K, int KB, int has_res, int F, cudaStream_t s, bool pdl) {
    launch_prmt<NT, EPI>(x, codes, cb, res, y, M, N, K, KB, has_res, F, s, pdl);
  }
};

template <class Kern>
static void dispatch_nt_epi(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& cb,
                            const torch::Tensor& res, torch::Tensor& y, int M, int N, int K, int KB,
                            int has_res, int F, int epi, cudaStream_t s, bool pdl) {
  if (M <= 8) {
    if (epi == 0) Kern::template go<1, 0>(x, codes, cb, res, y, M, N, K, KB, has_res, F, s, pdl);
    else if (epi == 1) Kern::template go<1, 1>(x, codes, cb, res, y, M, N, K, KB, has_res, F, s, pdl);
    else Kern::template go<1, 2>(x, codes, cb, res, y, M, N, K, KB, has_res, F, s, pdl);
  } else {
    if (epi == 0) Kern::template go<2, 0>(x, codes, cb, res, y, M, N, K, KB, has_res, F, s, pdl);
    else if (epi == 1) Kern::template go<2, 1>(x, codes, cb, res, y, M, N, K, KB, has_res, F, s, pdl);
    else Kern::template go<2, 2>(x, codes, cb, res, y, M, N, K, KB, has_res, F, s, pdl);
  }
}
}  // namespace trapetum_mma_x

// variant: 3 = shared-memory pair tables, 4 = PRMT lookups from registers (4-bit; the 8-bit head
// uses the table kernel), 5 = 3 with x loaded only by lanes whose activation row exists, 7 = 5 without
// loads past the last chunk, 11 = 7 on tiled codes (``tile_codes``: rows padded to 16; the output
// rows N are then y's columns for epi 0, the codes' rows for the gate/up epilogues).
void cb_gemv_variant(torch::Tensor x, torch::Tensor codes, torch::Tensor cb, torch::Tensor res,
                     torch::Tensor y, int64_t bits, int64_t epi, int64_t has_res, int64_t f, int64_t variant,
                     int64_t pdl) {
  using namespace trapetum_mma_x;
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kHalf, "x");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte, "codes");
  TORCH_CHECK(cb.is_contiguous() && cb.scalar_type() == at::kHalf, "codebook");
  const int M = x.size(0), K = x.size(1), KB = codes.size(1);
  int N = codes.size(0);
  TORCH_CHECK(M >= 1 && M <= 16 && KB % 64 == 0, "shape");
  TORCH_CHECK((bits == 4 && KB * 2 == K) || (bits == 8 && KB == K), "codes width");
  TORCH_CHECK(variant == 3 || variant == 4 || variant == 5 || variant == 7 || variant == 11, "variant");
  if (variant == 11) {
    TORCH_CHECK(N % 16 == 0, "tiled codes: rows padded to a multiple of 16");
    if (epi == 0) {
      TORCH_CHECK(y.dim() == 2 && y.size(1) <= N && y.size(1) > N - 16, "tiled codes: y columns vs padded rows");
      N = y.size(1);
    }
    TORCH_CHECK(cb.size(0) >= N, "codebook rows");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  const int F = (int)f, hr = (int)has_res, e = (int)epi;
  if (bits == 4 && variant == 4) dispatch_nt_epi<PrmtKernel>(x, codes, cb, res, y, M, N, K, KB, hr, F, e, s, pdl != 0);
  else if (bits == 4 && variant == 11) dispatch_nt_epi<TableKernel<4, 11>>(x, codes, cb, res, y, M, N, K, KB, hr, F, e, s, pdl != 0);
  else if (bits == 4 && variant == 7) dispatch_nt_epi<TableKernel<4, 7>>(x, codes, cb, res, y, M, N, K, KB, hr, F, e, s, pdl != 0);
  else if (bits == 4 && variant == 5) dispatch_nt_epi<TableKernel<4, 5>>(x, codes, cb, res, y, M, N, K, KB, hr, F, e, s, pdl != 0);
  else if (bits == 4) dispatch_nt_epi<TableKernel<4, 3>>(x, codes, cb, res, y, M, N, K, KB, hr, F, e, s, pdl != 0);
  else if (variant == 11) dispatch_nt_epi<TableKernel<8, 11>>(x, codes, cb, res, y, M, N, K, KB, hr, F, e, s, pdl != 0);
  else if (variant == 7) dispatch_nt_epi<TableKernel<8, 7>>(x, codes, cb, res, y, M, N, K, KB, hr, F, e, s, pdl != 0);
  else if (variant == 5) dispatch_nt_epi<TableKernel<8, 5>>(x, codes, cb, res, y, M, N, K, KB, hr, F, e, s, pdl != 0);
  else dispatch_nt_epi<TableKernel<8, 3>>(x, codes, cb, res, y, M, N, K, KB, hr, F, e, s, pdl != 0);
}
#endif
