// The 4-bit per-row codebook GEMV for M = 17..256 rows (batched decode, issue 20) on Hopper's warpgroup MMA,
// keeping every row's bits of its one-row call (codebook_gemv_mma.cu). KernelOptions.many_rows "wgmma"; built as an
// extension of its own for sm_90a (kernels/codebook_gemm_wgmma.py), where wgmma exists.
//
// Why: the production grouped kernel (codebook_gemv_groups.cuh) gives each warp one 16-row weight tile and loads
// every x fragment it multiplies through the LSU (session 15: its x loads are half of the 64-row time; reuse of x
// in registers needs more tiles a warp, which the 64 KB lookup table a tile forbids). Here x comes to the tensor
// core from shared memory (wgmma's B operand), staged once per block and read by the 64 weight rows of the
// warpgroup; the weights are dequantized in registers (byte-permute lookups in the row's codebook held as byte
// planes, as cb_dequant4_kernel does), so there is no table in shared memory at all.
//
// Bits. The canonical result (codebook_gemv_mma.cu, "Batch invariance") of output (m, r) is
//   y = round(((0 + P_0) + P_1) + ... + P_7 (+ residual)),  P_w = mma chain over the chunks c = w, w + 8, ...
// (k-steps j = 0..7 of each chunk in order, A = the pair (cb[lo nibble], cb[hi nibble]) of code byte
// (j & 1) * 2 (+1) of word j >> 1 of lane t's 16 code bytes, B = x columns c*128 + t*32 + j*4 + {0,1} / {2,3}).
// This kernel computes the same chains one after another (residue w = 0..7, accumulators reset per residue) and
// adds each finished P_w into S in that order (with a residue split, Split below, in a workspace first, then by the
// last block in the same order); A and the k order are those of the mma kernel, B holds the same x values in the
// same k positions. It is exact iff wgmma.m64nNk16 accumulates a k-step as mma.sync.m16n8k16 does: observed on the
// H100 in every case of scripts/dev/wgmma_gemm_check.py and pinned by tests/test_kernels_gemv_wgmma.py (not a
// documented guarantee: the Python side runs it on sm_90 only).
//
// Layout: block = WG warpgroups (4 WG warps) = 64 WG weight rows (warp q: tiled 16-row tile 4 WG b + q) x NX activation
// rows (grid.y: groups of NX rows). The warpgroups of a block share its x stages: x is read from L2 once per 64 WG
// weight rows (at 64 rows of 4096x11008 and WG = 1, x is 4x the weights' bytes). x is read in "wgmma order" (x_wgmma_kernel below): per group and chunk c, NX * 256
// bytes, for k-step j, n-group ng (8 rows), half hi: a core matrix of 8 rows x 16 bytes at ((j*NG + ng)*2 + hi)*128,
// row r holding x[8 ng + r][c*128 + t*32 + j*4 + hi*2 + {0,1}] for t = 0..3; descriptor LBO 128 (hi), SBO 256 (ng).
// Chunks stream through kStages shared buffers by cp.async, two chunks ahead; codes two chunks ahead in registers;
// two groups of 4 wgmmas a chunk, each half-chunk's A dequantized while the other half's wgmmas run.
#include <cuda_fp16.h>
#include <stdint.h>
#include "pdl.cuh"
#include "act.cuh"
#include "ptx.cuh"
#include "lut4.cuh"

namespace trapetum_wg {

constexpr int kWarpgroup = 128;  // threads of one warpgroup
constexpr int kResidues = 8;  // the mma kernel's warps: chunk c belongs to partial c % 8
constexpr int kStages = 4;

using trapetum_lut::load_planes;
using trapetum_lut::lut4_piece;

__device__ __forceinline__ uint64_t desc(uint32_t saddr) {  // no swizzle, LBO 128 B, SBO 256 B
  return (uint64_t)((saddr >> 4) & 0x3FFF) | ((uint64_t)(128 >> 4) << 16) | ((uint64_t)(256 >> 4) << 32);
}

template <int NX> struct Wg;
template <> struct Wg<32> {
  static __device__ __forceinline__ void mma(float* d, const uint32_t* a, uint64_t dsc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(dsc));
  }
};
template <> struct Wg<64> {
  static __device__ __forceinline__ void mma(float* d, const uint32_t* a, uint64_t dsc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(dsc));
  }
};

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async16(uint32_t saddr, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Residue split (blockIdx.z = s of RS): the block computes the partials of residues [s * 8 / RS, (s + 1) * 8 / RS).
// Segment 0 keeps their in-order sum S = ((0 + P_0) + P_1) ...; with RS > 1 every block stores its result in a
// workspace (segment 0: that prefix in slot 0; segment s > 0: each P_w in slot w - 8 / RS + 1), and the last block
// of a (tile block, row group) to finish, whichever it is, adds the slots to the prefix in residue order: the
// canonical sum, whatever the finishing order. The counter it takes is reset by that block (graph replays).
template <int NX>
struct Split {
  float* ws;         // [slots][blocks][NX / 2][threads a block] fp32
  int* counters;     // [blocks], zero between launches
  int rs;            // 1, 2, 4 or 8
};

// y[m, r] for the rows r of 64-row block blockIdx.x and activation rows m of group blockIdx.y (EPI 0; EPI 1 / 2:
// act(gate) * up as the mma kernel's gate/up epilogue, 8 gate then 8 up rows per 16-row tile).
template <int EPI, int NX, int WG>
__global__ void __launch_bounds__(WG * kWarpgroup)
cb_gemm_wgmma_kernel(const half* __restrict__ xw, const uint8_t* __restrict__ codes, const half* __restrict__ cb,
                     const half* __restrict__ res, half* __restrict__ y, int M, int N, int Npad, int KB,
                     int has_res, int F, Split<NX> sp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  trapetum_pdl::allow_dependents();
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int last_block;
  constexpr int kChunkBytes = NX * 256;
  constexpr int R = NX / 2;  // accumulator registers a thread
  constexpr int kThreads = WG * kWarpgroup;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tiles = Npad >> 4;
  const int tile = min((int)blockIdx.x * 4 * WG + warp, tiles - 1);  // a warp past the last tile repeats it (not stored)
  const int row0 = tile * 16;
  const int nchunks = KB >> 6;
  const int per = kResidues / sp.rs, w0 = (int)blockIdx.z * per, w1 = w0 + per;
  // tiled codes: chunk c of the tile is [h][g][t][16 B] at row0 * KB + c * 1024
  const uint8_t* pa = codes + (size_t)row0 * KB + (g * 4 + t) * 16;
  const uint8_t* pb = pa + 512;
  uint32_t La[4], Ha[4], Lb[4], Hb[4];
  load_planes(cb, min(row0 + g, N - 1), La, Ha);
  load_planes(cb, min(row0 + g + 8, N - 1), Lb, Hb);

  // the block's chunks in order: residue w0 (w0, w0 + 8, ...), then w0 + 1, ... up to w1 - 1
  auto next = [&](int c) -> int {
    if (c < 0) return -1;
    if (c + kResidues < nchunks) return c + kResidues;
    const int w = c % kResidues + 1;
    return (w < w1 && w < nchunks) ? w : -1;
  };
  const int first = w0 < nchunks ? w0 : -1;
  int c1 = next(first), c2 = next(c1);
  uint4 qa0 = make_uint4(0, 0, 0, 0), qb0 = qa0, qa1 = qa0, qb1 = qa0;
  if (first >= 0) { qa0 = trapetum_ptx::ld_stream(pa + (size_t)first * 1024); qb0 = trapetum_ptx::ld_stream(pb + (size_t)first * 1024); }
  if (c1 >= 0) { qa1 = trapetum_ptx::ld_stream(pa + (size_t)c1 * 1024); qb1 = trapetum_ptx::ld_stream(pb + (size_t)c1 * 1024); }

  trapetum_pdl::wait_inputs();  // x, the residual, the workspace belong to the previous kernels
  const half* xg = xw + (size_t)blockIdx.y * NX * 128 * (size_t)nchunks;  // this group's chunks, NX * 128 halves each
  const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
  auto stage_in = [&](int c, int slot) {  // chunk c's x into buffer slot (one commit group, empty if c < 0)
    if (c >= 0) {
      const uint8_t* src = reinterpret_cast<const uint8_t*>(xg + (size_t)c * NX * 128);
#pragma unroll
      for (int i = tid * 16; i < kChunkBytes; i += kThreads * 16) cp_async16(sbase + slot * kChunkBytes + i, src + i);
    }
    cp_commit();
  };
  stage_in(first, 0);
  stage_in(c1, 1);

  const int nblk = (int)(gridDim.x * gridDim.y), blk = (int)(blockIdx.y * gridDim.x + blockIdx.x);
  auto ws_at = [&](int slot, int i) -> float* { return sp.ws + (((size_t)slot * nblk + blk) * R + i) * kThreads + tid; };
  float S[R], acc[R];
#pragma unroll
  for (int i = 0; i < R; ++i) S[i] = acc[i] = 0.0f;
  uint32_t A[2][4][4];  // two half-chunks of A fragments (k-steps 4h .. 4h + 3)
  int q = 0;  // chunk counter (buffer slot q % kStages)
  int c = first;
  for (int w = w0; w < w1; ++w) {
    for (; c >= 0 && c % kResidues == w; ++q) {  // the chunks of residue w: one mma chain P_w
      cp_wait<1>();  // chunk c staged (the chunk after it may still be in flight)
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();
      stage_in(c2, (q + 2) % kStages);  // its buffer was last read by chunk q - 2's wgmmas, all retired
      uint4 qa2 = qa1, qb2 = qb1;
      const int c3 = next(c2);
      if (c2 >= 0) { qa2 = trapetum_ptx::ld_stream(pa + (size_t)c2 * 1024); qb2 = trapetum_ptx::ld_stream(pb + (size_t)c2 * 1024); }
      const uint32_t wa[4] = {qa0.x, qa0.y, qa0.z, qa0.w}, wb[4] = {qb0.x, qb0.y, qb0.z, qb0.w};
      const uint32_t sb = sbase + (q % kStages) * kChunkBytes;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wg_wait<1>();  // the group that last read A[h] (two groups ago) is done; the latest may still run
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int j = 4 * h + jj;
          const uint32_t va = (j & 1) ? (wa[j >> 1] >> 16) : (wa[j >> 1] & 0xFFFFu);
          const uint32_t vb = (j & 1) ? (wb[j >> 1] >> 16) : (wb[j >> 1] & 0xFFFFu);
          lut4_piece(va, La, Ha, A[h][jj][0], A[h][jj][2]);
          lut4_piece(vb, Lb, Hb, A[h][jj][1], A[h][jj][3]);
        }
        wg_fence();
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) Wg<NX>::mma(acc, A[h][jj], desc(sb + (4 * h + jj) * (NX / 8) * 256));
        wg_commit();
      }
      c = c1; c1 = c2; c2 = c3;
      qa0 = qa1; qb0 = qb1; qa1 = qa2; qb1 = qb2;
    }
    wg_wait<0>();  // P_w complete (zero for a residue without chunks, as the mma kernel's idle warps)
    if (blockIdx.z == 0) {
#pragma unroll
      for (int i = 0; i < R; ++i) S[i] += acc[i];
    } else {
#pragma unroll
      for (int i = 0; i < R; ++i) *ws_at(w - per + 1, i) = acc[i];
    }
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.0f;
  }

  if (sp.rs > 1) {
    if (blockIdx.z == 0) {
#pragma unroll
      for (int i = 0; i < R; ++i) *ws_at(0, i) = S[i];
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) last_block = atomicAdd(sp.counters + blk, 1) == sp.rs - 1;
    __syncthreads();
    if (!last_block) return;
    __threadfence();
#pragma unroll
    for (int i = 0; i < R; ++i) S[i] = __ldcg(ws_at(0, i));
    for (int slot = 1; slot <= kResidues - per; ++slot)
#pragma unroll
      for (int i = 0; i < R; ++i) S[i] += __ldcg(ws_at(slot, i));
    if (tid == 0) sp.counters[blk] = 0;
  }

  // accumulator (n8 tile i): S[4i+0,1] row g, activation rows 8i+2t, +1; S[4i+2,3] row g+8
  const int mbase = (int)blockIdx.y * NX;
#pragma unroll
  for (int i = 0; i < NX / 8; ++i)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = mbase + 8 * i + 2 * t + e;
      if (m >= M) continue;
      if (EPI == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row0 + g + 8 * h;
          if ((int)blockIdx.x * 4 * WG + warp >= tiles || row >= N) continue;
          float s = S[4 * i + 2 * h + e];
          if (has_res) s += trapetum_pdl::ld_input_half(res + (size_t)m * N + row);
          y[(size_t)m * N + row] = __float2half(s);
        }
      } else {
        const int o = tile * 8 + g;
        if ((int)blockIdx.x * 4 * WG + warp >= tiles || o >= F) continue;
        const float a = trapetum_act::apply(EPI, S[4 * i + e]);
        y[(size_t)m * F + o] = __float2half(a * S[4 * i + 2 + e]);
      }
    }
#endif
}

// x [M, K] row-major -> wgmma order (file comment), groups of NX rows, rows past M zero. Thread = one 16-byte core
// row (group, chunk c, step j, n-group, half hi, row r): four 4-byte words x[n][c*128 + t*32 + j*4 + hi*2 ..], t = 0..3.
template <int NX>
__global__ void __launch_bounds__(256) x_wgmma_kernel(const half* __restrict__ x, half* __restrict__ xw, int M, int K) {
  trapetum_pdl::allow_dependents();
  trapetum_pdl::wait_inputs();
  const int nchunks = K >> 7, groups = (M + NX - 1) / NX;
  const long long q = (long long)blockIdx.x * 256 + threadIdx.x;  // index of the core row in xw (16 bytes)
  if (q >= (long long)groups * nchunks * NX * 16) return;
  const int per_chunk = NX * 16;  // core rows of one chunk: 8 steps x NX/8 n-groups x 2 halves x 8 rows
  const int gc = (int)(q / per_chunk), w = (int)(q % per_chunk);
  const int grp = gc / nchunks, c = gc % nchunks;
  const int r = w & 7, hi = (w >> 3) & 1, ng = (w >> 4) % (NX / 8), j = (w >> 4) / (NX / 8);
  const int n = grp * NX + ng * 8 + r;
  uint32_t v[4] = {0u, 0u, 0u, 0u};
  if (n < M) {
    const uint32_t* xr = reinterpret_cast<const uint32_t*>(x + (size_t)n * K + c * 128 + j * 4 + hi * 2);
#pragma unroll
    for (int tt = 0; tt < 4; ++tt) v[tt] = trapetum_pdl::ld_input(xr + tt * 16);
  }
  reinterpret_cast<uint4*>(xw)[q] = make_uint4(v[0], v[1], v[2], v[3]);
}

}  // namespace trapetum_wg

#ifdef TRAPETUM_TORCH_LAUNCHER
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include "smem_once.cuh"

namespace trapetum_wg {
// The residue split (Split above) of a launch: 1 if the (64-row block, row group) grid already has two blocks an SM
// to offer, else doubled (at most 8 and the chunk count) until it does.
inline int residue_split(int blocks, int nchunks) {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  int rs = 1;
  while (rs < kResidues && (long long)blocks * rs < 2LL * sms && rs * 2 <= nchunks) rs *= 2;
  return rs;
}

constexpr int kCounters = 1 << 16;
inline int* counters(const torch::Device& d) {  // per device, zero between launches (each user resets its own)
  static torch::Tensor c[trapetum_launch::kAttrDevices];
  const int i = d.index() < 0 ? 0 : d.index();
  TORCH_CHECK(i < trapetum_launch::kAttrDevices, "device index");
  if (!c[i].defined()) c[i] = torch::zeros({kCounters}, torch::dtype(torch::kInt32).device(d));
  return c[i].data_ptr<int>();
}

template <int EPI, int NX, int WG>
void launch_gemm(const half* xw, const uint8_t* codes, const half* cb, const half* res, half* y, int M, int N, int Npad,
                 int KB, int has_res, int F, Split<NX> sp, dim3 grid, cudaStream_t s, bool pdl) {
  auto kern = cb_gemm_wgmma_kernel<EPI, NX, WG>;
  const int smem = kStages * NX * 256;
  static bool attr_set[trapetum_launch::kAttrDevices] = {};
  trapetum_launch::set_smem_once(kern, attr_set, smem, cudaSharedmemCarveoutDefault);  // the carveout it was timed at
  C10_CUDA_CHECK(trapetum_pdl::launch(kern, grid, WG * kWarpgroup, smem, s, pdl, xw, codes, cb, res, y, M, N, Npad, KB,
                                      has_res, F, sp));
}

template <int NX, int WG>
void launch_epi(int epi, const half* xw, const uint8_t* codes, const half* cb, const half* res, half* y, int M, int N,
                int Npad, int KB, int has_res, int F, Split<NX> sp, dim3 grid, cudaStream_t s, bool pdl) {
  if (epi == 0) launch_gemm<0, NX, WG>(xw, codes, cb, res, y, M, N, Npad, KB, has_res, F, sp, grid, s, pdl);
  else if (epi == 1) launch_gemm<1, NX, WG>(xw, codes, cb, res, y, M, N, Npad, KB, has_res, F, sp, grid, s, pdl);
  else launch_gemm<2, NX, WG>(xw, codes, cb, res, y, M, N, Npad, KB, has_res, F, sp, grid, s, pdl);
}
}  // namespace trapetum_wg

// x [M, K] row-major; codes tiled uint8 [Npad, KB] (4-bit: K = 2 KB, KB % 64 == 0); cb [>= N, 16]; y [M, N] (epi 0)
// or [M, f] (epi 1, 2); res [M, N] when has_res; nx: activation rows per block (32 or 64; 0: 32 up to 32 rows, else
// 64); rs: residue split (1, 2, 4, 8; 0: residue_split); wg: warpgroups a block (1, 2 or 3; 0: 1). One launch copies x
// into wgmma order (a workspace), the second is the GEMM.
void cb_gemm_wgmma(torch::Tensor x, torch::Tensor codes, torch::Tensor cb, torch::Tensor res, torch::Tensor y,
                   int64_t epi, int64_t has_res, int64_t f, int64_t nx, int64_t rs, int64_t wg, int64_t pdl) {
  using namespace trapetum_wg;
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kHalf, "x");
  TORCH_CHECK(codes.is_cuda() && codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kByte, "codes");
  TORCH_CHECK(cb.is_contiguous() && cb.scalar_type() == at::kHalf && cb.size(1) == 16, "codebook");
  TORCH_CHECK(epi >= 0 && epi <= 2, "epi");
  const int M = x.size(0), K = x.size(1), Npad = codes.size(0), KB = codes.size(1);
  TORCH_CHECK(KB % 64 == 0 && K == 2 * KB && Npad % 16 == 0 && M >= 1, "shape");
  const int N = epi == 0 ? (int)y.size(1) : Npad;
  TORCH_CHECK(epi == 0 ? (y.numel() == (int64_t)M * N && N <= Npad && N > Npad - 16) : (y.numel() == (int64_t)M * f && f > 0 && 2 * f <= Npad), "y");
  TORCH_CHECK(cb.size(0) >= N, "codebook rows");
  TORCH_CHECK(!has_res || res.numel() == (int64_t)M * N, "residual");
  if (nx == 0) nx = M <= 32 ? 32 : 64;
  TORCH_CHECK(nx == 32 || nx == 64, "nx");
  if (wg == 0) wg = 1;
  TORCH_CHECK(wg >= 1 && wg <= 3, "wg");
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  const bool use_pdl = pdl != 0;
  const int groups = (M + (int)nx - 1) / (int)nx, tile_blocks = (Npad / 16 + 4 * (int)wg - 1) / (4 * (int)wg);
  const int blocks = tile_blocks * groups, nchunks = KB / 64;
  if (rs == 0) rs = residue_split(blocks, nchunks);
  TORCH_CHECK(rs == 1 || rs == 2 || rs == 4 || rs == 8, "rs");
  TORCH_CHECK(blocks <= kCounters, "too many blocks for the residue-split counters");
  auto xw = torch::empty({(int64_t)groups * nx * K}, x.options());
  const long long rows16 = (long long)groups * (K / 128) * nx * 16;
  auto* xp = reinterpret_cast<const half*>(x.data_ptr<at::Half>());
  auto* xwp = reinterpret_cast<half*>(xw.data_ptr<at::Half>());
  C10_CUDA_CHECK(trapetum_pdl::launch(nx == 32 ? x_wgmma_kernel<32> : x_wgmma_kernel<64>,
                                      (unsigned)((rows16 + 255) / 256), 256, 0, s, use_pdl, xp, xwp, M, K));
  const int slots = rs > 1 ? kResidues + 1 - kResidues / (int)rs : 0;
  auto ws = torch::empty({(int64_t)slots * blocks * (nx / 2) * wg * kWarpgroup + 1}, x.options().dtype(torch::kFloat32));
  int* cnt = counters(x.device());
  dim3 grid(tile_blocks, groups, (unsigned)rs);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const half* cbp = reinterpret_cast<const half*>(cb.data_ptr<at::Half>());
  const half* rp = reinterpret_cast<const half*>(res.data_ptr<at::Half>());
  half* yp = reinterpret_cast<half*>(y.data_ptr<at::Half>());
  float* wsp = ws.data_ptr<float>();
  const int e = (int)epi, hr = (int)has_res, F = (int)f, R = (int)rs;
  if (nx == 32) {
    Split<32> sp{wsp, cnt, R};
    if (wg == 1) launch_epi<32, 1>(e, xwp, cp, cbp, rp, yp, M, N, Npad, KB, hr, F, sp, grid, s, use_pdl);
    else if (wg == 2) launch_epi<32, 2>(e, xwp, cp, cbp, rp, yp, M, N, Npad, KB, hr, F, sp, grid, s, use_pdl);
    else launch_epi<32, 3>(e, xwp, cp, cbp, rp, yp, M, N, Npad, KB, hr, F, sp, grid, s, use_pdl);
  } else {
    Split<64> sp{wsp, cnt, R};
    if (wg == 1) launch_epi<64, 1>(e, xwp, cp, cbp, rp, yp, M, N, Npad, KB, hr, F, sp, grid, s, use_pdl);
    else if (wg == 2) launch_epi<64, 2>(e, xwp, cp, cbp, rp, yp, M, N, Npad, KB, hr, F, sp, grid, s, use_pdl);
    else launch_epi<64, 3>(e, xwp, cp, cbp, rp, yp, M, N, Npad, KB, hr, F, sp, grid, s, use_pdl);
  }
}
#endif
