// Session 15 experiment: what the grouped multi-row 4-bit codebook GEMV (cb_gemv_mma_groups_kernel<4, 0, 2>,
// codebook_gemv_groups.cuh) waits on. Measurements only (scripts/dev/gemv_ablation.py; NOTES-kernels.md "what the
// 64-row GEMV waits on"); no production path calls this file. It includes the production device code
// (codebook_gemv_mma.cu without its launchers), so "prod" here is the production kernel, compiled from the
// production source, and the copy below shares CodeStream, build_table, dequant_tile and reduce_store with it.
//
// cb_abl_kernel<MINB, FLAGS> is a copy of cb_gemv_mma_groups_kernel<4, 0, 2> (tiled codes, EPI 0, 2 groups a
// block) with compile-time switches:
//   MINB 2 / 3: __launch_bounds__(256, MINB) (3: <= 80 registers, three 64 KB tables an SM: carveout 86%);
//   kNoLut:   A fragments = the PRMT byte addresses themselves (the LDS left out, the code words still used);
//   kNoX:     B fragments constant (no x loads);
//   kNoMma:   the mma replaced by one XOR of A and B into an accumulator (A, B still computed and loaded);
//   kNoRed:   no reduction across warps, no store (accumulators kept alive by a store under a never-true test);
//   kNoTable: no table build (no codebook loads, no STS; the lookups read what shared memory holds);
//   kCodes2:  codes two chunks ahead (as the 16-row kernel) instead of one (hypothesis: DRAM latency of codes);
//   kPfx2 / kPfx4: prefetch.global.L1 of the x piece 2 / 4 pieces ahead (hypothesis: x L2 latency; no registers).
// cb_xr2_kernel<GB, NT> (below): x reuse across two weight tiles a warp (NOTES-kernels.md "x reuse across two weight
// tiles"); exact. -3 / -4: the production M <= 8 / M <= 2 kernels.
// The first five give wrong results (timed only); MINB 3, kCodes2 and kPfx* keep every instruction that computes
// a value in the same order per row, so they must give the production bits (the script asserts it).
//
// Built without torch (no torch headers: the whole build has to fit the lead's one short GPU call): nvcc -shared,
// one library per part (-DABL_PART=k -DABL_NPARTS=n, compiled in parallel), each holding the variants whose
// index i satisfies (i + 4) % n == k and a plain C entry point; trapetum/kernels/experimental/
// codebook_gemv_ablation.py builds and calls them with ctypes on torch's current stream (CUDA-graph capture works:
// capture is per driver stream). The library links the CUDA runtime statically; the device and context are the
// process's primary ones, as torch's.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#undef TRAPETUM_TORCH_LAUNCHER  // the production device code only (its launchers are the main extension's)
#include "codebook_gemv_mma.cu"

namespace trapetum_abl {
using namespace trapetum_mma;

constexpr int kNoLut = 1, kNoX = 2, kNoMma = 4, kNoRed = 8, kNoTable = 16, kCodes2 = 32, kPfx2 = 64, kPfx4 = 128;
constexpr int kGB = 2;
constexpr int kBits = 4;

__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

template <int MINB, int FLAGS>
__global__ void __launch_bounds__(kThreads, MINB)
cb_abl_kernel(const half* __restrict__ x, const uint8_t* __restrict__ codes, const half* __restrict__ cb,
              half* __restrict__ y, int M, int N, int K, int KB, int never) {
  constexpr int GB = kGB;
  constexpr bool kLut = !(FLAGS & kNoLut), kX = !(FLAGS & kNoX), kMma = !(FLAGS & kNoMma);
  constexpr int PF = (FLAGS & kPfx4) ? 4 : (FLAGS & kPfx2) ? 2 : 0;
  uint32_t* smem = trapetum_cbgemv_smem;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  int tile, g0, ng;
  groups_block((int)blockIdx.x, M, GB, tile, g0, ng);
  const int row0 = tile * 16;
  const CodeStream<true> cs(codes, N, KB, row0, g, t);
  const int nchunks = cs.nchunks;

  uint4 qa0, qb0, qa1, qb1, qa2, qb2;
  cs.load(warp, qa0, qb0);
  if (FLAGS & kCodes2) cs.load(warp + kWarps, qa1, qb1);
  if (!(FLAGS & kNoTable)) build_table<kBits>(smem, cb, N, row0, tid);
  __syncthreads();

  uint32_t sb;
  asm("mov.u32 %0, trapetum_cbgemv_smem;" : "=r"(sb));
  const uint32_t lane4 = (uint32_t)lane * 4u;
  constexpr int PT = XPieces<kBits>::value;
  float acc[GB][2][4];
#pragma unroll
  for (int i = 0; i < GB; ++i)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) acc[i][nt][0] = acc[i][nt][1] = acc[i][nt][2] = acc[i][nt][3] = 0.0f;

  const uint4* xg = reinterpret_cast<const uint4*>(x) + (size_t)g0 * 2 * K;
  auto load_piece = [&](uint32_t (&xp)[GB][2][4], int c, int p) {
    if (!kX) return;
#pragma unroll
    for (int i = 0; i < GB; ++i) {
      const int mg = min(16, M - 16 * (g0 + i));
      const uint4* q = xg + groups_x_piece(i, mg, K, PT, c, p, t);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        if (nt * 8 + g >= mg) continue;
        const uint4 v = trapetum_pdl::ld_input(q + (nt * 8 + g) * 4);
        xp[i][nt][0] = v.x; xp[i][nt][1] = v.y; xp[i][nt][2] = v.z; xp[i][nt][3] = v.w;
      }
    }
  };
  // prefetch into L1 the x piece PF pieces after piece p of chunk c (the next chunk of this warp past the end)
  auto prefetch_piece = [&](int c, int p) {
    if (PF == 0 || !kX) return;
    const int q = p + PF, cc = c + (q / PT) * kWarps, pp = q % PT;
    if (cc >= nchunks) return;
#pragma unroll
    for (int i = 0; i < GB; ++i) {
      const int mg = min(16, M - 16 * (g0 + i));
      if (mg <= 0) continue;
      const uint4* qx = xg + groups_x_piece(i, mg, K, PT, cc, pp, t);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
        if (nt * 8 + g < mg) prefetch_l1(qx + (nt * 8 + g) * 4);
    }
  };
  constexpr uint32_t kOne2 = 0x3c003c00u;  // half2 (1, 1): the constant B of kNoX
  uint32_t xc[GB][2][4], xn[GB][2][4];
#pragma unroll
  for (int i = 0; i < GB; ++i)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int w = 0; w < 4; ++w) xc[i][nt][w] = xn[i][nt][w] = kX ? 0u : kOne2;
  load_piece(xc, min(warp, nchunks - 1), 0);
  if (PF) {
#pragma unroll
    for (int p = 2; p < PF && p < PT; ++p) prefetch_piece(warp, p - PF);  // pieces 2 .. PF - 1
  }
  for (int c = warp; c < nchunks; c += kWarps) {
    if (FLAGS & kCodes2) cs.load(c + 2 * kWarps, qa2, qb2);
    else cs.load(c + kWarps, qa1, qb1);
    const uint32_t wa4[4] = {qa0.x, qa0.y, qa0.z, qa0.w};
    const uint32_t wb4[4] = {qb0.x, qb0.y, qb0.z, qb0.w};
#pragma unroll
    for (int p = 0; p < PT; ++p) {
      prefetch_piece(c, p);
      if (p + 1 < PT) load_piece(xn, c, p + 1);
      else load_piece(xn, min(c + kWarps, nchunks - 1), 0);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t A[4];
        if (kLut) {
          dequant_tile<kBits>(A, wa4, wb4, 2 * p + h, sb, lane4);
        } else {  // dequant_tile without its LDS: the byte addresses it would load from
          const int j = 2 * p + h, k0 = (j & 1) * 2;
          const uint32_t wa = wa4[j >> 1], wb = wb4[j >> 1];
          A[0] = sel_byte(wa, lane4, k0);
          A[2] = sel_byte(wa, lane4, k0 + 1);
          A[1] = sel_byte(wb, lane4, k0);
          A[3] = sel_byte(wb, lane4, k0 + 1);
        }
#pragma unroll
        for (int i = 0; i < GB; ++i) {
          if (i >= ng) continue;
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const uint32_t b0 = xc[i][nt][2 * h], b1 = xc[i][nt][2 * h + 1];
            if (kMma) {
              mma16816(acc[i][nt], A, b0, b1);
            } else {
              const uint32_t v = __float_as_uint(acc[i][nt][0]) ^ A[0] ^ A[1] ^ A[2] ^ A[3] ^ b0 ^ b1;
              acc[i][nt][0] = __uint_as_float(v);
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < GB; ++i)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int w = 0; w < 4; ++w) xc[i][nt][w] = xn[i][nt][w];
    }
    qa0 = qa1; qb0 = qb1;
    if (FLAGS & kCodes2) { qa1 = qa2; qb1 = qb2; }
  }

  if (FLAGS & kNoRed) {  // keep the accumulators alive without the reduction: a store that never runs
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < GB; ++i)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) s += acc[i][nt][r];
    if (never == 0x7e57ab1e) y[(size_t)blockIdx.x * kThreads + tid] = __float2half(s);
    return;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < GB; ++i) {
    if (i >= ng) continue;
    const int grp = g0 + i;
    reduce_store<2, 0>(reinterpret_cast<float*>(smem), acc[i], tid, lane, warp, row0, min(16, M - 16 * grp), N, N,
                       0, 0, y, y + (size_t)grp * 16 * N, tile);
  }
}

}  // namespace trapetum_abl

#include "codebook_gemv_xr2.cuh"

// The variants the script times: (index, MINB, FLAGS); -1 / -2 are the production kernels (launch_prod).
#define TRAPETUM_ABL_VARIANTS(X) \
  X(0, 2, 0) X(1, 3, 0) X(2, 2, kNoLut) X(3, 2, kNoX) X(4, 2, kNoMma) X(5, 2, kNoRed) X(6, 2, kNoTable) \
  X(7, 2, kNoLut | kNoMma) X(8, 2, kNoLut | kNoX) X(9, 2, kCodes2) X(10, 2, kPfx2) X(11, 2, kPfx4)           \
  X(12, 3, kPfx2) X(13, 2, kNoLut | kNoX | kNoMma)

// x reuse across two weight tiles: (index, GB, NT)
#define TRAPETUM_XR2_VARIANTS(X) X(14, 2, 2) X(15, 1, 2) X(16, 1, 1)
// persistent x reuse: (index, GB, NT)
#define TRAPETUM_XR2P_VARIANTS(X) X(17, 2, 2) X(18, 1, 2)

#ifndef ABL_PART
#define ABL_PART 0
#define ABL_NPARTS 1
#endif
#define ABL_MINE(I) ((((I) + 4) % ABL_NPARTS) == ABL_PART)

namespace trapetum_abl {
struct A {
  const half* x; const uint8_t* codes; const half* cb; half* y; int M, N, K, KB;
};

// Kernel attributes (dynamic shared memory, carveout) set once (the process uses one device in the script), then
// the launch (query = true: only the attributes, for abl_info).
template <typename Kern, typename... Args>
static cudaError_t go_smem(Kern kern, bool& done, int carveout, int smem, int grid, cudaStream_t s, bool query,
                           Args... args) {
  cudaError_t e = cudaSuccess;
  if (!done) {
    e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, carveout);
    if (e != cudaSuccess) return e;
    done = true;
  }
  if (query) return cudaSuccess;
  e = trapetum_pdl::launch(kern, grid, kThreads, smem, s, false, args...);
  return e != cudaSuccess ? e : cudaGetLastError();
}
template <typename Kern, typename... Args>
static cudaError_t go(Kern kern, bool& done, int carveout, int grid, cudaStream_t s, bool query, Args... args) {
  return go_smem(kern, done, carveout, kTabWords * 4, grid, s, query, args...);
}

// The production kernels with the production launcher's settings (codebook_gemv_mma.cu, PDL off):
// -1 = cb_gemv_mma_groups_kernel<4, 0, 2> (carveout Carveout<2, true> = 58), -2 = cb_gemv_mma_kernel<4, 2, 0, true,
// true> (what the production dispatch runs at 9..16 rows; its x layout is the group-wise one at M <= 16).
static const void* kernel_of(int v) {
  if constexpr (ABL_MINE(-1)) if (v == -1) return (const void*)cb_gemv_mma_groups_kernel<4, 0, 2>;
  if constexpr (ABL_MINE(-2)) if (v == -2) return (const void*)cb_gemv_mma_kernel<4, 2, 0, true, true, false>;
  if constexpr (ABL_MINE(-3)) if (v == -3) return (const void*)cb_gemv_mma_kernel<4, 1, 0, true, true, false>;
  if constexpr (ABL_MINE(-4)) if (v == -4) return (const void*)cb_gemv_mma_kernel<4, 1, 0, true, false, false>;
#define TRAPETUM_XR2_K(I, GB, NT) \
  if constexpr (ABL_MINE(I)) if (v == I) return (const void*)cb_xr2_kernel<GB, NT>;
  TRAPETUM_XR2_VARIANTS(TRAPETUM_XR2_K)
#define TRAPETUM_XR2P_K(I, GB, NT) \
  if constexpr (ABL_MINE(I)) if (v == I) return (const void*)cb_xr2p_kernel<GB, NT>;
  TRAPETUM_XR2P_VARIANTS(TRAPETUM_XR2P_K)
#define TRAPETUM_ABL_K(I, B, F) \
  if constexpr (ABL_MINE(I)) if (v == I) return (const void*)cb_abl_kernel<B, F>;
  TRAPETUM_ABL_VARIANTS(TRAPETUM_ABL_K)
  return nullptr;
}

// SMs of the current device (the persistent grid), read once.
static int num_sms() {
  static int n = 0;
  if (n == 0) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) !=
        cudaSuccess || n < 1)
      n = 132;
  }
  return n;
}

static cudaError_t launch(int v, const A& a, cudaStream_t s, bool query) {
  const int ggrid = groups_grid(a.N, a.M, 2);
  if constexpr (ABL_MINE(-1)) if (v == -1) {
    static bool done = false;
    return go(cb_gemv_mma_groups_kernel<4, 0, 2>, done, 58, ggrid, s, query, a.x, a.codes, a.cb,
              (const half*)a.y, a.y, a.M, a.N, a.K, a.KB, 0, 0, 0);
  }
  if constexpr (ABL_MINE(-2)) if (v == -2) {
    static bool done = false;
    return go(cb_gemv_mma_kernel<4, 2, 0, true, true, false>, done, 58, (a.N + 15) / 16, s, query, a.x, a.codes,
              a.cb, (const half*)a.y, a.y, a.M, a.N, a.K, a.KB, 0, 0, 0);
  }
#define TRAPETUM_ABL_L(I, B, F)                                                                              \
  if constexpr (ABL_MINE(I)) if (v == I) {                                                                 \
    static bool done = false; /* carveout: 3 x 65 KB of the 196 KB configuration; 2 x 65 KB of 132 KB */   \
    return go(cb_abl_kernel<B, F>, done, B >= 3 ? 86 : 58, ggrid, s, query, a.x, a.codes, a.cb, a.y, a.M, a.N, \
              a.K, a.KB, 0);                                                                                \
  }
  TRAPETUM_ABL_VARIANTS(TRAPETUM_ABL_L)
  // -3 / -4: cb_gemv_mma_kernel NT = 1 as the production dispatch runs it at 3..8 rows (fragment-order x, carveout
  // Carveout<1, true> = 86) and at 1..2 rows (x row-major, carveout 100)
  if constexpr (ABL_MINE(-3)) if (v == -3) {
    static bool done = false;
    return go(cb_gemv_mma_kernel<4, 1, 0, true, true, false>, done, 86, (a.N + 15) / 16, s, query, a.x, a.codes,
              a.cb, (const half*)a.y, a.y, a.M, a.N, a.K, a.KB, 0, 0, 0);
  }
  if constexpr (ABL_MINE(-4)) if (v == -4) {
    static bool done = false;
    return go(cb_gemv_mma_kernel<4, 1, 0, true, false, false>, done, 100, (a.N + 15) / 16, s, query, a.x, a.codes,
              a.cb, (const half*)a.y, a.y, a.M, a.N, a.K, a.KB, 0, 0, 0);
  }
  // xr2: two 64 KB tables (128 KB + 1 KB reserved fits the 132 KB configuration, 58%: L1 keeps what production's
  // two blocks leave it)
#define TRAPETUM_XR2_L(I, GB, NT)                                                                              \
  if constexpr (ABL_MINE(I)) if (v == I) {                                                                     \
    static bool done = false;                                                                                  \
    return go_smem(cb_xr2_kernel<GB, NT>, done, 58, 2 * kTabWords * 4, xr2_grid(a.N, a.M, GB), s, query, a.x, \
                   a.codes, a.cb, a.y, a.M, a.N, a.K, a.KB);                                                  \
  }
  TRAPETUM_XR2_VARIANTS(TRAPETUM_XR2_L)
#define TRAPETUM_XR2P_L(I, GB, NT)                                                                              \
  if constexpr (ABL_MINE(I)) if (v == I) {                                                                      \
    static bool done = false;                                                                                   \
    const int items = xr2_grid(a.N, a.M, GB);                                                                   \
    return go_smem(cb_xr2p_kernel<GB, NT>, done, 58, 2 * kTabWords * 4, (items < num_sms() ? items : num_sms()), s, query, a.x,  \
                   a.codes, a.cb, a.y, a.M, a.N, a.K, a.KB, items);                                             \
  }
  TRAPETUM_XR2P_VARIANTS(TRAPETUM_XR2P_L)
  return cudaErrorInvalidDeviceFunction;
}
}  // namespace trapetum_abl

extern "C" {
// 1 if this part holds variant v.
int trapetum_abl_has(int v) {
  if (v < -4 || v > 18) return 0;
  return ABL_MINE(v) ? 1 : 0;
}

// y [M, N] = the variant on group-wise fragment-order x xf [M, K], tiled codes [N padded to 16, K / 2] and
// codebooks [>= N, 16], all fp16 / uint8 device pointers, on stream. Returns a cudaError_t (0: launched),
// 1000 + reason for bad arguments.
int trapetum_abl_launch(int v, const void* xf, const void* codes, const void* cb, void* y, int M, int N, int K,
                        int KB, void* stream) {
  if (!trapetum_abl_has(v)) return 1001;
  if (M < 1 || M > trapetum_mma::kMaxGroupedRows || KB % 64 || 2 * KB != K || N < 1) return 1002;
  if (v == -2 && (M < 9 || M > 16)) return 1003;
  if (v == -3 && (M < 3 || M > 8)) return 1003;
  if (v == -4 && M > 2) return 1003;
  if (v == 16 && M > 8) return 1003;  // xr2_n1: n-tile 0 only
  const trapetum_abl::A a{(const half*)xf, (const uint8_t*)codes, (const half*)cb, (half*)y, M, N, K, KB};
  return (int)trapetum_abl::launch(v, a, (cudaStream_t)stream, false);
}

// Registers, local (spill) bytes per thread and resident blocks an SM of variant v as launched (its carveout and
// 64 KB table set first). Returns a cudaError_t.
int trapetum_abl_info(int v, int* regs, int* local_bytes, int* blocks_per_sm) {
  if (!trapetum_abl_has(v)) return 1001;
  const trapetum_abl::A a{nullptr, nullptr, nullptr, nullptr, 64, 16, 128, 64};
  cudaError_t e = trapetum_abl::launch(v, a, nullptr, true);
  if (e != cudaSuccess) return (int)e;
  const void* k = trapetum_abl::kernel_of(v);
  cudaFuncAttributes fa;
  e = cudaFuncGetAttributes(&fa, k);
  if (e != cudaSuccess) return (int)e;
  *regs = fa.numRegs;
  *local_bytes = (int)fa.localSizeBytes;
  const int smem = (v >= 14 ? 2 : 1) * trapetum_mma::kTabWords * 4;
  return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, k, trapetum_mma::kThreads, smem);
}

// x [M, K] fp16 row-major -> xf in the group-wise fragment order (x_fragments_groups_kernel<4>).
int trapetum_abl_frag(const void* x, void* xf, int M, int K, void* stream) {
  if (M < 1 || K % 128) return 1002;
  const long long pieces = (long long)M * (K / 8);
  cudaError_t e = trapetum_pdl::launch(trapetum_mma::x_fragments_groups_kernel<4>, (unsigned)((pieces + 255) / 256),
                                       256, 0, (cudaStream_t)stream, false, (const half*)x, (half*)xf, M, K);
  return (int)(e != cudaSuccess ? e : cudaGetLastError());
}
}
