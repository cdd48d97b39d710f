// The mma GEMV with blocks over kTiles = 2 adjacent 16-row weight tiles sharing each x piece (M >= 3 on tiled codes;
// KernelOptions.grouped_gemv_tiles = 2): included by codebook_gemv_mma.cu after codebook_gemv_groups.cuh, whose
// kernel this one is with the x traffic halved (NOTES-kernels.md, session 14: the multi-row GEMV is bound by x
// re-read from L2, 4 KB of x per 1 KB of codes per 16-row group, no block sharing it).
#pragma once

namespace trapetum_mma {

constexpr int kTiles = 2;                       // weight tiles a block
constexpr int kTilesThreads = kTiles * kThreads;  // 512: warps 0..7 tile 0, 8..15 tile 1
// x pieces in flight (cp.async) ahead of the one in use, and the ring of staged pieces a warp pair (why + 2: below):
// 6 / 2 pieces of 1 / 2 KB at GB = 1 / 2, 48 / 32 KB in flight an SM (today's kernels hold one piece a warp
// in registers: 16 / 32 KB an SM at two blocks); slot counts powers of two.
template <int GB>
struct XRing {
  static constexpr int ahead = GB == 1 ? 6 : 2;
  static constexpr int slots = ahead + 2;
};

// The grid of cb_gemv_mma_tiles_kernel: pairs of 16-row weight tiles x super-groups of GB groups of 16 rows (block
// b: pair b / S, super-group b % S, groups_block's mapping with pairs for tiles; a pair's super-groups neighbours).
__host__ __device__ inline int tiles_grid(int N, int M, int GB) {
  return ((N + 15) / 16 + kTiles - 1) / kTiles * (((M + 15) / 16 + GB - 1) / GB);
}

// Dynamic shared memory: kTiles 64 KB tables, then per warp pair (warp w of each tile) XRing<GB>::slots staged
// pieces of GB KB each ([group i][n-tile nt][lane] uint4: 2 GB x 512 bytes): 192 KB at GB = 1 and 2.
template <int GB>
struct TilesSmem { static constexpr int bytes = kTiles * kTabWords * 4 + kWarps * XRing<GB>::slots * GB * 1024; };

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  // src-size 0 (rows past the group's): 16 zero bytes, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void bar_pair(int id) { asm volatile("bar.sync %0, 64;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void lds128(uint32_t a, uint32_t (&v)[4]) {
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(a));
}

// Block = tiles 2 P, 2 P + 1 x the GB groups g0 .. g0 + ng - 1 of one super-group. Warp w of tile i (warp 8 i + w)
// runs the chunks w, w + 8, ... of its tile, its own table (tile i's 64 KB, built by the tile's 256 threads), the A
// fragment of each k-step once for the groups (dequant_tile) and each group's two n-tile mmas: exactly the
// instructions of cb_gemv_mma_groups_kernel on its tile, and each tile's 8 warps are reduced in order by
// reduce_store on that tile's own table memory. So every row keeps the bits of its one-row call; only the way x
// reaches the registers changes. x: warps w and w + 8 consume the same chunks in the same order, so for each 16-byte
// piece (k-steps 2p, 2p + 1 of a chunk) warp 8 i + w copies n-tile i (rows g + 8 i, lane (g, t): the global uint4 it
// would load itself, group-wise fragment order) of every group into the pair's staging slot with cp.async (16 bytes a
// lane, zero-filled past the group's rows), XRing<GB>::ahead pieces ahead; both wait for their own copies of the piece
// in use, meet at the pair's named barrier (id 1 + w, 64 threads) and read both n-tiles with ld.shared.v4 (512
// contiguous bytes a warp instruction: no conflicts). Slot reuse: piece s + ahead goes into the slot of piece s + ahead
// - slots = s - 2, which both warps read before the barrier of piece s - 1 that this warp has passed. A tile past N
// (odd tile count) builds no table, loads no codes and computes nothing, but its warps still stage their half of x and
// join the barriers; its reduce_store stores nothing (row0 >= N, o >= F).
// M <= 16 (3..16 rows, fragment-order x = group 0's group-wise order): GB = 1; the n-tile-1 mmas are skipped when the
// group has <= 8 rows (block-uniform; n-tile 0's chains are unchanged, as in the NT = 1 kernel).
template <int BITS, int EPI, int GB>
__global__ void __launch_bounds__(kTilesThreads, 1)
cb_gemv_mma_tiles_kernel(const half* __restrict__ x, const uint8_t* __restrict__ codes,
                         const half* __restrict__ cb, const half* __restrict__ res,
                         half* __restrict__ y, int M, int N, int K, int KB, int has_res, int F, int ypt) {
  trapetum_pdl::allow_dependents();
  uint32_t* smem = trapetum_cbgemv_smem;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int ti = warp >> 3, w = warp & (kWarps - 1), ttid = tid & (kThreads - 1);  // tile of the block, its warp
  const int g = lane >> 2, t = lane & 3;
  int pair, g0, ng;
  groups_block((int)blockIdx.x, M, GB, pair, g0, ng);
  const int tile = pair * kTiles + ti, row0 = tile * 16;
  const bool active = row0 < N;  // warp-uniform
  const CodeStream<true> cs(codes, N, KB, active ? row0 : 0, g, t);
  const int nchunks = cs.nchunks;

  uint4 qa0 = {}, qb0 = {}, qa1 = {}, qb1 = {};  // chunk in use, chunk ahead
  if (active) {
    cs.load(w, qa0, qb0);
    build_table<BITS>(smem + ti * kTabWords, cb, N, row0, ttid);
  }
  __syncthreads();
  trapetum_pdl::wait_inputs();  // weights only above; x, res, y below

  uint32_t sb;
  asm("mov.u32 %0, trapetum_cbgemv_smem;" : "=r"(sb));
  const uint32_t lane4 = (uint32_t)lane * 4u | ((uint32_t)ti << 8);  // sel_byte<true>: + ti * 64 KB
  constexpr int PT = XPieces<BITS>::value;
  constexpr int kSlotBytes = GB * 1024, kAhead = XRing<GB>::ahead, kSlots = XRing<GB>::slots;
  const uint32_t xs = sb + kTiles * kTabWords * 4 + w * (kSlots * kSlotBytes) + lane * 16;
  const uint4* xg = reinterpret_cast<const uint4*>(x) + (size_t)g0 * 2 * K;  // 16 K halves = 2 K uint4 per group
  const int niter = nchunks > w ? (nchunks - w + kWarps - 1) / kWarps : 0;  // the same for both warps of a pair
  const int npieces = niter * PT;
  int mg[GB];
#pragma unroll
  for (int i = 0; i < GB; ++i) mg[i] = min(16, M - 16 * (g0 + i));

  // this warp's half of piece s (chunk w + 8 (s / PT), piece s % PT): n-tile ti of every group; one commit group
  // per piece, empty past the end, so that wait_group counts pieces
  auto stage = [&](int s) {
    if (s < npieces) {
      const int c = w + kWarps * (s / PT), p = s % PT, row = ti * 8 + g;
      const uint32_t dst = xs + (uint32_t)((s % kSlots) * kSlotBytes + ti * 512);
#pragma unroll
      for (int i = 0; i < GB; ++i) {
        if (i >= ng) continue;  // block-uniform
        const bool ok = row < mg[i];
        const uint4* q = ok ? xg + groups_x_piece(i, mg[i], K, PT, c, p, t) + row * 4 : xg;
        cp_async16(dst + i * 1024, q, ok);
      }
    }
    cp_async_commit();
  };

  float acc[GB][2][4];
#pragma unroll
  for (int i = 0; i < GB; ++i)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) acc[i][nt][0] = acc[i][nt][1] = acc[i][nt][2] = acc[i][nt][3] = 0.0f;

#pragma unroll
  for (int s = 0; s < kAhead; ++s) stage(s);
  int s = 0;
  for (int it = 0; it < niter; ++it) {
    const int c = w + kWarps * it;
    if (active) cs.load(c + kWarps, qa1, qb1);
    const uint32_t wa4[4] = {qa0.x, qa0.y, qa0.z, qa0.w};
    const uint32_t wb4[4] = {qb0.x, qb0.y, qb0.z, qb0.w};
#pragma unroll
    for (int p = 0; p < PT; ++p, ++s) {
      stage(s + kAhead);
      cp_async_wait<kAhead>();  // this warp's copies of piece s have landed
      bar_pair(1 + w);           // and the partner's
      if (!active) continue;     // warp-uniform
      const uint32_t src = xs + (uint32_t)((s % kSlots) * kSlotBytes);
      uint32_t xc[GB][2][4];
#pragma unroll
      for (int i = 0; i < GB; ++i) {
        if (i >= ng) continue;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          if (nt == 1 && mg[i] <= 8) continue;  // block-uniform
          lds128(src + (uint32_t)((i * 2 + nt) * 512), xc[i][nt]);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t A[4];
        dequant_tile<BITS, true>(A, wa4, wb4, 2 * p + h, sb, lane4);
#pragma unroll
        for (int i = 0; i < GB; ++i) {
          if (i >= ng) continue;  // block-uniform
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            if (nt == 1 && mg[i] <= 8) continue;
            mma16816(acc[i][nt], A, xc[i][nt][2 * h], xc[i][nt][2 * h + 1]);
          }
        }
      }
    }
    qa0 = qa1; qb0 = qb1;
  }
  cp_async_wait<0>();  // (only empty groups can be left)

  __syncthreads();  // every warp is done with the tables: each tile reduces on its own table memory
  float* red = reinterpret_cast<float*>(smem + ti * kTabWords);
#pragma unroll
  for (int i = 0; i < GB; ++i) {
    if (i >= ng) continue;  // block-uniform (reduce_store synchronizes all 512 threads)
    const int grp = g0 + i;
    reduce_store<2, EPI>(red, acc[i], ttid, lane, w, row0, mg[i], N, F, has_res, ypt, res + (size_t)grp * 16 * N,
                         y + (size_t)grp * 16 * (EPI == 0 ? N : F), tile);
  }
}

}  // namespace trapetum_mma
