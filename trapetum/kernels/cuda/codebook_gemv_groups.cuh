// The grouped mma GEMV with one dequantization for several groups of 16 rows (batched decode, M > 16 on tiled
// codes): included by codebook_gemv_mma.cu after its device code (CodeStream, build_table, dequant_tile,
// reduce_store), whose file comment has the design and the batch-invariance argument this kernel keeps.
#pragma once

namespace trapetum_mma {

// The grouped kernel with one dequantization for several groups (M > 16, tiled codes; x in the group-wise fragment
// order of x_fragments_groups_kernel, group j at element offset 16 j K in the fragment order of its own row count
// min(16, M - 16 j)). The G = ceil(M / 16) groups form S = ceil(G / GB) super-groups of GB groups (the last one
// shorter); block b computes weight tile b / S for super-group b % S. Per chunk and k-step j the A fragment is built
// once (dequant_tile) and fed to the two n-tile mmas of each group of the super-group in turn: group i's accumulators
// acc[i] see exactly the mma chain of a 16-row call on its rows (the same A, the same k order, its own x columns,
// zeros in columns past its rows) and reduce_store reduces and stores them as that call does, so every row keeps the
// bits of its one-row call. In flight: codes one chunk ahead, x one 16-byte piece (k-steps 2i, 2i + 1) of every
// group ahead of the one in use. GB = 2: two blocks an SM, GB = 4: one (registers: NOTES-kernels.md, session 11).
// The grid of cb_gemv_mma_groups_kernel: 16-row weight tiles (N rows) x super-groups of GB groups of 16 rows.
__host__ __device__ inline int groups_grid(int N, int M, int GB) {
  return (N + 15) / 16 * (((M + 15) / 16 + GB - 1) / GB);
}

// Block b of the grouped grid (groups_grid): its weight tile, its first group g0 and its number of groups ng >= 1.
__host__ __device__ __forceinline__ void groups_block(int b, int M, int GB, int& tile, int& g0, int& ng) {
  const int G = (M + 15) >> 4, S = (G + GB - 1) / GB;
  tile = b / S;
  g0 = (b % S) * GB;
  ng = min(GB, G - g0);
}

// uint4 index, from the first group g0 of the block, of 16-byte piece p of chunk c of row 0 of group g0 + i (of mg
// rows) for lane t in the group-wise fragment order of x_fragments_groups_kernel (K features a row; row m: + 4 m).
__host__ __device__ __forceinline__ size_t groups_x_piece(int i, int mg, int K, int PT, int c, int p, int t) {
  return (size_t)i * 2 * K + ((size_t)(c * PT + p) * mg) * 4 + t;
}

template <int BITS, int EPI, int GB>
__global__ void __launch_bounds__(kThreads, GB <= 2 ? 2 : 1)
cb_gemv_mma_groups_kernel(const half* __restrict__ x, const uint8_t* __restrict__ codes,
                          const half* __restrict__ cb, const half* __restrict__ res,
                          half* __restrict__ y, int M, int N, int K, int KB, int has_res, int F, int ypt) {
  trapetum_pdl::allow_dependents();
  uint32_t* smem = trapetum_cbgemv_smem;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  int tile, g0, ng;
  groups_block((int)blockIdx.x, M, GB, tile, g0, ng);
  const int row0 = tile * 16;
  const CodeStream<true> cs(codes, N, KB, row0, g, t);
  const int nchunks = cs.nchunks;

  uint4 qa0, qb0, qa1, qb1;  // chunk in use, chunk ahead (chunks past the end are never loaded nor computed)
  cs.load(warp, qa0, qb0);
  build_table<BITS>(smem, cb, N, row0, tid);
  __syncthreads();
  trapetum_pdl::wait_inputs();  // as cb_gemv_mma_kernel: weights only above

  uint32_t sb;
  asm("mov.u32 %0, trapetum_cbgemv_smem;" : "=r"(sb));
  const uint32_t lane4 = (uint32_t)lane * 4u;
  constexpr int PT = XPieces<BITS>::value;
  float acc[GB][2][4];
#pragma unroll
  for (int i = 0; i < GB; ++i)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) acc[i][nt][0] = acc[i][nt][1] = acc[i][nt][2] = acc[i][nt][3] = 0.0f;

  // piece p of chunk c of every group of the super-group: rows g (nt = 0) and g + 8 (nt = 1); lanes whose row is
  // past their group's rows (all lanes of an absent group) skip the load and keep zeros.
  const uint4* xg = reinterpret_cast<const uint4*>(x) + (size_t)g0 * 2 * K;  // 16 K halves = 2 K uint4 per group
  auto load_piece = [&](uint32_t (&xp)[GB][2][4], int c, int p) {
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
  uint32_t xc[GB][2][4] = {}, xn[GB][2][4] = {};
  load_piece(xc, min(warp, nchunks - 1), 0);
  for (int c = warp; c < nchunks; c += kWarps) {
    cs.load(c + kWarps, qa1, qb1);
    const uint32_t wa4[4] = {qa0.x, qa0.y, qa0.z, qa0.w};
    const uint32_t wb4[4] = {qb0.x, qb0.y, qb0.z, qb0.w};
#pragma unroll
    for (int p = 0; p < PT; ++p) {
      if (p + 1 < PT) load_piece(xn, c, p + 1);
      else load_piece(xn, min(c + kWarps, nchunks - 1), 0);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t A[4];
        dequant_tile<BITS>(A, wa4, wb4, 2 * p + h, sb, lane4);
#pragma unroll
        for (int i = 0; i < GB; ++i) {
          if (i >= ng) continue;  // block-uniform
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) mma16816(acc[i][nt], A, xc[i][nt][2 * h], xc[i][nt][2 * h + 1]);
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
  }

  __syncthreads();  // every warp is done with the table: reuse it for the reductions, one group after the other
#pragma unroll
  for (int i = 0; i < GB; ++i) {
    if (i >= ng) continue;  // block-uniform (reduce_store synchronizes)
    const int grp = g0 + i;
    reduce_store<2, EPI>(reinterpret_cast<float*>(smem), acc[i], tid, lane, warp, row0, min(16, M - 16 * grp), N, F,
                         has_res, ypt, res + (size_t)grp * 16 * N, y + (size_t)grp * 16 * (EPI == 0 ? N : F), tile);
  }
}

}  // namespace trapetum_mma
