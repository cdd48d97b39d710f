// Activation-sparse 4-bit per-row codebook GEMV on tensor cores (kernels/sparse_mma.py is its Python side;
// KernelOptions.sparse_kernel "mma"): the codes of the inputs that the threshold drops are not read.
//
// y[m, r] = sum over kept k of x[m, k] * codebook[r, idx(r, k)]  (+ residual[m, r]), where kept = |x[m, k]| > t,
// or x[m, k] != 0 on a dense row (dense[m] != 0). The contract of sparse_gemv.sparse_project (kernels/sparse_gemv.py).
//
// Code layout (tile-major, made once at load, sparse_mma.tile_codes): uint8 ct[T][K][64], T = ceil(N / 128);
// byte b of ct[tt][k] holds the codes of input k for rows 128 tt + 2b (low nibble) and 2b + 1 (high nibble)
// (rows >= N: code 0): the sparse path's input-major bytes (sparse_gemv.input_major_codes) cut in 64-byte tiles.
// A warp reads one kept input's codes for its 128 rows as one 64-byte piece (two whole sectors), lane l the
// halfword 2l: rows 4l .. 4l + 3.
//
// Tensor-core trick (n = 1 real column): lane l = 4g + c of mma.m16n8k16 holds A rows g / g + 8 at k columns
// 2c, 2c + 1 (+ 8). Here A's k column 2c + i (+ 8) means "row 4l + 2h + i of the tile at kept input in0 (in1)"
// (h = 0 for A row g, 1 for g + 8), and B = [x0 I8; x1 I8] (16 x 8): D[g][2c + i] = W[4l + i] . (x0, x1), and
// D[g + 8][2c + i] = W[4l + 2 + i] . (x0, x1): the eight D columns are eight different rows, each lane's four
// accumulators are its own rows 4l .. 4l + 3, and each of the 32 lanes reads its own rows' tables: one copy of a
// pair table, conflict-free. One mma = 2 kept inputs x 128 rows = 256 weights, from 2 halfword code loads, 4 PRMT
// and 4 LDS (the dense mma kernel's instruction per weight), no FMA.
//  * Table (shared memory, 64 KB, built before the PDL wait): word e * 64 + 32 h + l = half2 (codebook[4l + 2h]
//    [e & 15], codebook[4l + 2h + 1][e >> 4]) for code byte e: byte address (e << 8) | (h << 7) | (l << 2), the
//    offset of one PRMT from the code halfword (bank = lane).
//  * B: lane (g, c) with c == g >> 1 holds (x0, 0) / (x1, 0) (g even) or (0, x0) / (0, x1) (g odd), every other
//    lane zeros: one PRMT of the pair's (x0, x1) with a per-lane selector each.
//    (A consequence: a kept input's weights of other rows meet B's zeros; a non-finite weight of a KEPT input
//    would spread to the other rows of its mma. fp16 codebooks of real models are finite; dropped inputs'
//    weights are never read.)
// Block (8 warps) = one tile tt of 128 rows x one K range [s KS, (s + 1) KS) (split s of S) x activation row m:
//  1. (weights only: before the PDL wait) the table.
//  2. the kept inputs of the range, ascending, into a shared list of 16-bit (k, x) (a scan, one barrier).
//  3. P = floor(nnz / 2) pairs; warp w takes pairs [w L, (w + 1) L), L = ceil(P / 8) rounded up to even (list
//     reads of two pairs at once), batches of 8 pairs (16 code loads in flight, the next batch loaded before the
//     current one is multiplied); one mma per pair in pair order; an odd last entry: warp 7's last mma (its in1
//     weights and x zero).
//  4. the 8 warps' sums added per row in warp order. S = 1: the epilogue. S > 1: the partial to
//     part[s][m][128 tt + r]; the last block for (tt, m) (a device counter, fenced) sums the S partials in order
//     s = 0, 1, .. and writes the epilogue, then resets the counter to 0.
// Every sum and its order depend on row m's own data and on the shape (S from K and N only): deterministic, a
// row's bits those of its one-row call. No host sync: capturable.
// EPI 0: y [M, N] fp16 = sum (+ residual). EPI 1 / 2: rows interleaved 8 gate / 8 up per 16 (N % 16 == 0),
// y [M, F] fp16 = act(gate) * up, o = 8 (r / 16) + r % 16 for r % 16 < 8, o < F.
#include <cuda_fp16.h>
#include <stdint.h>
#include "pdl.cuh"
#include "act.cuh"
#include "sparse_split.cuh"
#include "ptx.cuh"

extern __shared__ __align__(16) uint32_t trapetum_spmma_smem[];

namespace trapetum_spmma {

constexpr int kThreads = 256;
constexpr int kWarps = 8;
constexpr int kRows = 128;                   // rows per tile (a block)
constexpr int kMaxKS = 2048;                 // inputs per K range (k < 65536: 16-bit list entries)
constexpr int kTabWords = 256 * 64;          // 64 KB
constexpr int kBatch = 8;                    // pairs per batch (16 code loads)
constexpr int kSmemBytes = kTabWords * 4 + kMaxKS * 2 * 2;  // table + list k + list x (72 KB)

using trapetum_ptx::lds;
using trapetum_ptx::mma16816;

__device__ __forceinline__ uint32_t ld_code16(const uint8_t* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// (byte k of w) << 8 | lane4 (lane4 = lane * 4 < 256): the table offset of one code byte.
__device__ __forceinline__ uint32_t sel_byte(uint32_t w, uint32_t lane4, int k) {
  return __byte_perm(w, lane4, 0x5504 | (k << 4));
}

// One mma: kept inputs with code halfwords w0 (x0) and w1 (x1), b0 / b1 this lane's B registers.
__device__ __forceinline__ void pair_mma(float (&acc)[4], uint32_t w0, uint32_t w1, uint32_t b0, uint32_t b1,
                                         uint32_t sb, uint32_t lane4) {
  uint32_t A[4];
  A[0] = lds(sb + sel_byte(w0, lane4, 0));
  A[1] = lds(sb + 128 + sel_byte(w0, lane4, 1));
  A[2] = lds(sb + sel_byte(w1, lane4, 0));
  A[3] = lds(sb + 128 + sel_byte(w1, lane4, 1));
  mma16816(acc, A, b0, b1);
}

template <int EPI>
__global__ void __launch_bounds__(kThreads, 3)
sparse_mma_kernel(const half* __restrict__ x, const uint8_t* __restrict__ ct, const half* __restrict__ cb,
                  const half* __restrict__ res, const uint8_t* dense, half* __restrict__ y,
                  float* __restrict__ part, int* __restrict__ cnt, float t, int M, int N, int K, int KS, int S,
                  int has_res, int F) {
  trapetum_pdl::allow_dependents();
  uint32_t* tab = trapetum_spmma_smem;                       // [e][h][lane]
  unsigned short* sk = reinterpret_cast<unsigned short*>(tab + kTabWords);  // kept inputs k
  unsigned short* sx = sk + kMaxKS;                                          // their x (fp16 bits)
  __shared__ int wcount[kWarps];
  __shared__ int last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tt = blockIdx.x / S, s = blockIdx.x % S, m = blockIdx.y;
  const int T = gridDim.x / S;
  const int Np = T * kRows;

  {  // 1. table: thread (col = 32 h + l, j0) writes entries e = 16 j + i, j = j0 + 4 q, of rows 4l + 2h (+ 1)
    const int col = tid & 63, j0 = tid >> 6;
    const int r0 = tt * kRows + 4 * (col & 31) + 2 * (col >> 5);
    const uint4* c0p = reinterpret_cast<const uint4*>(cb + (size_t)min(r0, N - 1) * 16);
    const uint4 u0 = __ldg(c0p), u1 = __ldg(c0p + 1);
    const uint32_t lo[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};  // codebook[r0], 2 entries a word
    const unsigned short* c1 = reinterpret_cast<const unsigned short*>(cb + (size_t)min(r0 + 1, N - 1) * 16);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int j = j0 + 4 * q;
      const uint32_t hi = __ldg(c1 + j);  // codebook[r0 + 1][j] in bytes 0..1
#pragma unroll
      for (int i = 0; i < 16; ++i)
        tab[(16 * j + i) * 64 + col] = __byte_perm(lo[i >> 1], hi, (i & 1) ? 0x5432 : 0x5410);
    }
  }
  trapetum_pdl::wait_inputs();  // x, the residual, y, part and the counters belong to the previous kernels

  // 2. the kept inputs of [k_lo, k_hi), ascending: thread tid tests inputs k_lo + 8 tid + j, j = 0..7; a warp
  //    scan of the counts, the warps' totals through shared memory (one barrier), entries (k, x) written in order
  const int k_lo = s * KS, k_hi = min(k_lo + KS, K);
  const bool dn = __ldca(dense + m) != 0;
  constexpr int kPer = kMaxKS / kThreads;
  const int kt = k_lo + tid * kPer;
  half xr[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) xr[j] = kt + j < k_hi ? __ldca(x + (size_t)m * K + kt + j) : __float2half(0.0f);
  uint32_t keep = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const float xv = __half2float(xr[j]);
    keep |= static_cast<uint32_t>(kt + j < k_hi && (dn ? xv != 0.0f : fabsf(xv) > t)) << j;
  }
  const int mine = __popc(keep);
  int incl = mine;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) wcount[warp] = incl;
  __syncthreads();
  int at = incl - mine, nnz = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int nw = wcount[w];
    at += w < warp ? nw : 0;
    nnz += nw;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j)
    if ((keep >> j) & 1u) {
      sk[at] = static_cast<unsigned short>(kt + j);
      sx[at] = __half_as_ushort(xr[j]);
      ++at;
    }
  __syncthreads();  // the list and the table complete

  // 3. warp w: pairs [w L, min((w + 1) L, P))
  const int g = lane >> 2, c4 = lane & 3;
  // B from a pair's (x0, x1) half2: PRMT selectors giving (x0, 0) / (x1, 0) (g even), (0, x0) / (0, x1) (g odd)
  // on the lanes c == g >> 1, zeros elsewhere
  const bool diag = c4 == (g >> 1);
  const uint32_t sel0 = !diag ? 0x4444u : (g & 1) ? 0x1044u : 0x4410u;
  const uint32_t sel1 = !diag ? 0x4444u : (g & 1) ? 0x3244u : 0x4432u;
  const uint32_t sb = static_cast<uint32_t>(__cvta_generic_to_shared(tab));
  const uint32_t lane4 = lane * 4;
  const uint8_t* lbase = ct + (size_t)tt * K * 64 + 2 * lane;  // lane l's halfword of input k at + 64 k
  const int P = nnz >> 1;
  const int L = ((P + kWarps - 1) / kWarps + 1) & ~1;  // even: batches start at 16-byte list entries
  const int p_lo = min(warp * L, P), p_hi = min(p_lo + L, P);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  uint32_t wa[2 * kBatch], wb[2 * kBatch];  // two batches of code halfwords: one in flight while the other is used
  auto load = [&](uint32_t (&w)[2 * kBatch], int p0) {
    const int n = min(kBatch, p_hi - p0);  // warp-uniform
#pragma unroll
    for (int u = 0; u < kBatch; u += 2) {
      if (u + 1 < n) {  // two pairs' inputs in one 8-byte load
        const uint2 o = *reinterpret_cast<const uint2*>(sk + 2 * (p0 + u));
        w[2 * u] = ld_code16(lbase + (size_t)(o.x & 0xFFFFu) * 64);
        w[2 * u + 1] = ld_code16(lbase + (size_t)(o.x >> 16) * 64);
        w[2 * u + 2] = ld_code16(lbase + (size_t)(o.y & 0xFFFFu) * 64);
        w[2 * u + 3] = ld_code16(lbase + (size_t)(o.y >> 16) * 64);
      } else if (u < n) {
        const uint32_t o = *reinterpret_cast<const uint32_t*>(sk + 2 * (p0 + u));
        w[2 * u] = ld_code16(lbase + (size_t)(o & 0xFFFFu) * 64);
        w[2 * u + 1] = ld_code16(lbase + (size_t)(o >> 16) * 64);
      }
    }
  };
  auto compute = [&](const uint32_t (&w)[2 * kBatch], int p0) {
    const int n = min(kBatch, p_hi - p0);
    if (n == kBatch) {  // a whole batch: no predicates
#pragma unroll
      for (int u = 0; u < kBatch; u += 2) {
        const uint2 xv = *reinterpret_cast<const uint2*>(sx + 2 * (p0 + u));
        pair_mma(acc, w[2 * u], w[2 * u + 1], __byte_perm(xv.x, 0u, sel0), __byte_perm(xv.x, 0u, sel1), sb, lane4);
        pair_mma(acc, w[2 * u + 2], w[2 * u + 3], __byte_perm(xv.y, 0u, sel0), __byte_perm(xv.y, 0u, sel1), sb,
                 lane4);
      }
    } else {
#pragma unroll
      for (int u = 0; u < kBatch - 1; ++u)
        if (u < n) {
          const uint32_t xv = *reinterpret_cast<const uint32_t*>(sx + 2 * (p0 + u));
          pair_mma(acc, w[2 * u], w[2 * u + 1], __byte_perm(xv, 0u, sel0), __byte_perm(xv, 0u, sel1), sb, lane4);
        }
    }
  };
  if (p_lo < p_hi) load(wa, p_lo);
  for (int p0 = p_lo; p0 < p_hi; p0 += 2 * kBatch) {  // pairs in order; batches alternate between wa and wb
    if (p0 + kBatch < p_hi) load(wb, p0 + kBatch);
    compute(wa, p0);
    if (p0 + kBatch >= p_hi) break;
    if (p0 + 2 * kBatch < p_hi) load(wa, p0 + 2 * kBatch);
    compute(wb, p0 + kBatch);
  }
  if ((nnz & 1) && warp == kWarps - 1) {  // the odd last entry: in1's weights and x zero
    const uint32_t w0 = ld_code16(lbase + (size_t)sk[nnz - 1] * 64);
    uint32_t A[4];
    A[0] = lds(sb + sel_byte(w0, lane4, 0));
    A[1] = lds(sb + 128 + sel_byte(w0, lane4, 1));
    A[2] = 0u;
    A[3] = 0u;
    mma16816(acc, A, __byte_perm(static_cast<uint32_t>(sx[nnz - 1]), 0u, sel0), 0u);
  }

  // 4. the warps' sums in warp order, per row tid < 128
  __syncthreads();  // every warp done with the table: its space holds the partials
  float* red = reinterpret_cast<float*>(tab);
  *reinterpret_cast<float4*>(red + warp * kRows + 4 * lane) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  __syncthreads();
  const int r = tid & (kRows - 1);
  float sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += red[w * kRows + r];
  trapetum_sparse_split::finish<EPI, kRows>(sum, red, last, tid < kRows, tid, r, part, cnt, M, Np, s, S, m, T, tt, N,
                                            F, res, has_res, y);
}

}  // namespace trapetum_spmma

#ifdef TRAPETUM_TORCH_LAUNCHER
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include "smem_once.cuh"
#include "sparse_split_args.cuh"

// x fp16 [M, K] contiguous; ct uint8 [T, K, 64] (tile-major codes, file comment); cb fp16 [N, 16]; dense uint8
// [M]; y fp16 [M, N] (epi 0) or [M, f] (epi 1, 2); res fp16 [M, N] (read when has_res); part fp32 [S, M, 128 T]
// (S > 1); cnt int32, at least M T elements, zero (left zero). splits S: K ranges of ceil(K / S) <= 2048 inputs;
// K <= 65536.
void cb_sparse_mma(torch::Tensor x, torch::Tensor ct, torch::Tensor cb, torch::Tensor res, torch::Tensor dense,
                   torch::Tensor y, torch::Tensor part, torch::Tensor cnt, double t, int64_t epi, int64_t has_res,
                   int64_t f, int64_t splits, int64_t pdl) {
  using namespace trapetum_spmma;
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kHalf, "x");
  const int M = x.size(0), K = x.size(1);
  TORCH_CHECK(ct.is_cuda() && ct.dim() == 3 && ct.is_contiguous() && ct.scalar_type() == at::kByte && ct.size(1) == K &&
              ct.size(2) == 64, "codes: uint8 [T, K, 64]");
  const int T = ct.size(0);
  TORCH_CHECK((int64_t)T * K * 64 < (int64_t)1 << 40 && (int64_t)K * 64 < ((int64_t)1 << 31), "K too large");
  TORCH_CHECK(K <= 65536, "shape (K <= 65536: 16-bit list entries)");
  const int S = (int)splits;
  const int KS = (K + S - 1) / S;
  const int N = trapetum_sparse_split::check_args(cb, res, dense, y, part, cnt, M, K, T, kRows, kMaxKS, epi, has_res,
                                                 f, S);
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t st = c10::cuda::getCurrentCUDAStream().stream();
  static bool done[3][trapetum_launch::kAttrDevices] = {};
  using Kern = void (*)(const half*, const uint8_t*, const half*, const half*, const uint8_t*, half*, float*, int*,
                        float, int, int, int, int, int, int, int);
  const Kern kerns[3] = {sparse_mma_kernel<0>, sparse_mma_kernel<1>, sparse_mma_kernel<2>};
  const int ki = (int)epi;
  trapetum_launch::set_smem_once(kerns[ki], done[ki], kSmemBytes, 100);
  C10_CUDA_CHECK(trapetum_pdl::launch(
      kerns[ki], dim3((unsigned)(T * S), (unsigned)M), dim3(kThreads), kSmemBytes, st, pdl != 0,
      reinterpret_cast<const half*>(x.data_ptr<at::Half>()), (const uint8_t*)ct.data_ptr<uint8_t>(),
      reinterpret_cast<const half*>(cb.data_ptr<at::Half>()), reinterpret_cast<const half*>(res.data_ptr<at::Half>()),
      (const uint8_t*)dense.data_ptr<uint8_t>(), reinterpret_cast<half*>(y.data_ptr<at::Half>()), part.data_ptr<float>(),
      cnt.data_ptr<int32_t>(), (float)t, M, N, K, KS, S, (int)has_res, (int)f));
}
#endif
