// Session 15 experiment: x reuse across two weight tiles a warp (cb_xr2_kernel, cb_xr2p_kernel), included by
// codebook_gemv_ablation.cu after its copy of the grouped kernel (it uses that file's kBits and the production device
// code). Measurements only (scripts/dev/gemv_ablation.py; NOTES-kernels.md "x reuse across two weight tiles").
#pragma once

namespace trapetum_abl {
using namespace trapetum_mma;

// x reuse across T = 2 adjacent weight tiles (session 15, NOTES-kernels.md "x reuse across two weight tiles"):
// block b covers tiles 2 (b / S) and 2 (b / S) + 1 (rows row0 .. row0 + 31; the second one absent past N) for
// super-group b % S of GB groups (groups_block on tile pairs). Warp w runs the production chunk loop (chunks w,
// w + 8, ...; pieces p, k-steps h in the same order), but loads each x piece once and feeds it to the mmas of both
// tiles, each tile's A fragment from its own table (two 64 KB tables, 4x replicated as production: one block an
// SM). Every accumulator acc[T][i][nt] sees exactly the production kernel's mma chain for its tile and group (same
// A, same k order, same x columns), and each is reduced by reduce_store as production does: the production bits.
// NT = 1 (M <= 8 only) leaves n-tile 1 out as cb_gemv_mma_kernel<4, 1, ...> does.
template <int GB, int NT>
__global__ void __launch_bounds__(kThreads, 1)
cb_xr2_kernel(const half* __restrict__ x, const uint8_t* __restrict__ codes, const half* __restrict__ cb,
              half* __restrict__ y, int M, int N, int K, int KB) {
  uint32_t* smem = trapetum_cbgemv_smem;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  int pair, g0, ng;
  groups_block((int)blockIdx.x, M, GB, pair, g0, ng);
  const int row0 = pair * 32;
  const bool two = row0 + 16 < N;  // block-uniform: the second tile exists (its codes are never read otherwise)
  const CodeStream<true> cs0(codes, N, KB, row0, g, t), cs1(codes, N, KB, two ? row0 + 16 : row0, g, t);
  const int nchunks = cs0.nchunks;

  uint4 qa0 = make_uint4(0, 0, 0, 0), qb0 = qa0, ra0 = qa0, rb0 = qa0, qa1, qb1, ra1 = qa0, rb1 = qa0;
  cs0.load(warp, qa0, qb0);
  if (two) cs1.load(warp, ra0, rb0);
  build_table<kBits>(smem, cb, N, row0, tid);
  if (two) build_table<kBits>(smem + kTabWords, cb, N, row0 + 16, tid);
  __syncthreads();

  uint32_t sb;
  asm("mov.u32 %0, trapetum_cbgemv_smem;" : "=r"(sb));
  const uint32_t sb1 = sb + kTabWords * 4;
  const uint32_t lane4 = (uint32_t)lane * 4u;
  constexpr int PT = XPieces<kBits>::value;
  float acc[2][GB][NT][4];
#pragma unroll
  for (int T = 0; T < 2; ++T)
#pragma unroll
    for (int i = 0; i < GB; ++i)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[T][i][nt][0] = acc[T][i][nt][1] = acc[T][i][nt][2] = acc[T][i][nt][3] = 0.0f;

  const uint4* xg = reinterpret_cast<const uint4*>(x) + (size_t)g0 * 2 * K;
  auto load_piece = [&](uint32_t (&xp)[GB][NT][4], int c, int p) {
#pragma unroll
    for (int i = 0; i < GB; ++i) {
      const int mg = min(16, M - 16 * (g0 + i));
      const uint4* q = xg + groups_x_piece(i, mg, K, PT, c, p, t);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (nt * 8 + g >= mg) continue;
        const uint4 v = trapetum_pdl::ld_input(q + (nt * 8 + g) * 4);
        xp[i][nt][0] = v.x; xp[i][nt][1] = v.y; xp[i][nt][2] = v.z; xp[i][nt][3] = v.w;
      }
    }
  };
  uint32_t xc[GB][NT][4] = {}, xn[GB][NT][4] = {};
  load_piece(xc, min(warp, nchunks - 1), 0);
  for (int c = warp; c < nchunks; c += kWarps) {
    cs0.load(c + kWarps, qa1, qb1);
    if (two) cs1.load(c + kWarps, ra1, rb1);
    const uint32_t wa4[4] = {qa0.x, qa0.y, qa0.z, qa0.w}, wb4[4] = {qb0.x, qb0.y, qb0.z, qb0.w};
    const uint32_t va4[4] = {ra0.x, ra0.y, ra0.z, ra0.w}, vb4[4] = {rb0.x, rb0.y, rb0.z, rb0.w};
#pragma unroll
    for (int p = 0; p < PT; ++p) {
      if (p + 1 < PT) load_piece(xn, c, p + 1);
      else load_piece(xn, min(c + kWarps, nchunks - 1), 0);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t A0[4], A1[4];
        dequant_tile<kBits>(A0, wa4, wb4, 2 * p + h, sb, lane4);
        dequant_tile<kBits>(A1, va4, vb4, 2 * p + h, sb1, lane4);
#pragma unroll
        for (int i = 0; i < GB; ++i) {
          if (i >= ng) continue;  // block-uniform
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            mma16816(acc[0][i][nt], A0, xc[i][nt][2 * h], xc[i][nt][2 * h + 1]);
            mma16816(acc[1][i][nt], A1, xc[i][nt][2 * h], xc[i][nt][2 * h + 1]);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < GB; ++i)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int w = 0; w < 4; ++w) xc[i][nt][w] = xn[i][nt][w];
    }
    qa0 = qa1; qb0 = qb1; ra0 = ra1; rb0 = rb1;
  }

  __syncthreads();  // both tables done with: the reductions reuse the first, one (tile, group) after the other
#pragma unroll
  for (int T = 0; T < 2; ++T) {
    if (T == 1 && !two) continue;  // block-uniform (reduce_store synchronizes)
#pragma unroll
    for (int i = 0; i < GB; ++i) {
      if (i >= ng) continue;
      const int grp = g0 + i;
      reduce_store<NT, 0>(reinterpret_cast<float*>(smem), acc[T][i], tid, lane, warp, row0 + 16 * T,
                          min(16, M - 16 * grp), N, N, 0, 0, y, y + (size_t)grp * 16 * N);
    }
  }
}

// xr2p: cb_xr2_kernel made persistent (grid = min(items, SMs), item = blockIdx.x + k gridDim.x), so that one block an
// SM does not expose every item's prologue: the next item's codebooks are loaded during this item's chunk loop and
// its first codes during this item's reductions; only the table stores stay between items. Per item the same
// instructions as cb_xr2_kernel (the same table words, chains and reductions): exact.
struct CbRegs { uint4 c0, c1; uint32_t lov; };
// build_table<4>'s loads (rows clamped to N - 1: always valid) / its stores, split so the loads can run ahead.
__device__ __forceinline__ CbRegs cb_load(const half* __restrict__ cb, int N, int row0, int tid) {
  const int gg = tid & 7, h = (tid >> 3) & 1, sIdx = tid >> 4;
  const int r = min(row0 + h * 8 + gg, N - 1);
  const uint4* cp = reinterpret_cast<const uint4*>(cb + (size_t)r * 16);
  CbRegs o;
  o.c0 = __ldg(cp);
  o.c1 = __ldg(cp + 1);
  o.lov = __half_as_ushort(cb[(size_t)r * 16 + sIdx]);
  return o;
}
__device__ __forceinline__ void cb_store(uint32_t* smem, const CbRegs& c, int tid) {
  const int gg = tid & 7, h = (tid >> 3) & 1, sIdx = tid >> 4;
  const uint32_t cw[8] = {c.c0.x, c.c0.y, c.c0.z, c.c0.w, c.c1.x, c.c1.y, c.c1.z, c.c1.w};
#pragma unroll
  for (int hi = 0; hi < 16; ++hi) {
    const uint32_t hv = (hi & 1) ? (cw[hi >> 1] & 0xFFFF0000u) : (cw[hi >> 1] << 16);
    const uint32_t v = c.lov | hv;
    const int e = hi * 16 + sIdx;
    *reinterpret_cast<uint4*>(&smem[e * 64 + h * 32 + gg * 4]) = make_uint4(v, v, v, v);
  }
}

template <int GB, int NT>
__global__ void __launch_bounds__(kThreads, 1)
cb_xr2p_kernel(const half* __restrict__ x, const uint8_t* __restrict__ codes, const half* __restrict__ cb,
               half* __restrict__ y, int M, int N, int K, int KB, int items) {
  uint32_t* smem = trapetum_cbgemv_smem;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint32_t sb;
  asm("mov.u32 %0, trapetum_cbgemv_smem;" : "=r"(sb));
  const uint32_t sb1 = sb + kTabWords * 4;
  const uint32_t lane4 = (uint32_t)lane * 4u;
  constexpr int PT = XPieces<kBits>::value;
  int item = (int)blockIdx.x;
  if (item >= items) return;
  int pair, g0, ng;
  groups_block(item, M, GB, pair, g0, ng);
  int row0 = pair * 32;
  bool two = row0 + 16 < N;
  CodeStream<true> cs0(codes, N, KB, row0, g, t), cs1(codes, N, KB, two ? row0 + 16 : row0, g, t);
  const int nchunks = cs0.nchunks;
  uint4 qa0 = make_uint4(0, 0, 0, 0), qb0 = qa0, ra0 = qa0, rb0 = qa0, qa1, qb1, ra1 = qa0, rb1 = qa0;
  cs0.load(warp, qa0, qb0);
  if (two) cs1.load(warp, ra0, rb0);
  CbRegs k0 = cb_load(cb, N, row0, tid), k1 = cb_load(cb, N, row0 + 16, tid);

  while (true) {
    cb_store(smem, k0, tid);
    cb_store(smem + kTabWords, k1, tid);
    __syncthreads();
    const int next = item + (int)gridDim.x;
    int npair = 0, ng0 = 0, nng = 0;
    if (next < items) {  // the next item's codebooks, in flight during this item's chunk loop
      groups_block(next, M, GB, npair, ng0, nng);
      k0 = cb_load(cb, N, npair * 32, tid);
      k1 = cb_load(cb, N, npair * 32 + 16, tid);
    }

    float acc[2][GB][NT][4];
#pragma unroll
    for (int T = 0; T < 2; ++T)
#pragma unroll
      for (int i = 0; i < GB; ++i)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          acc[T][i][nt][0] = acc[T][i][nt][1] = acc[T][i][nt][2] = acc[T][i][nt][3] = 0.0f;
    const uint4* xg = reinterpret_cast<const uint4*>(x) + (size_t)g0 * 2 * K;
    auto load_piece = [&](uint32_t (&xp)[GB][NT][4], int c, int p) {
#pragma unroll
      for (int i = 0; i < GB; ++i) {
        const int mg = min(16, M - 16 * (g0 + i));
        const uint4* q = xg + groups_x_piece(i, mg, K, PT, c, p, t);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if (nt * 8 + g >= mg) continue;
          const uint4 v = trapetum_pdl::ld_input(q + (nt * 8 + g) * 4);
          xp[i][nt][0] = v.x; xp[i][nt][1] = v.y; xp[i][nt][2] = v.z; xp[i][nt][3] = v.w;
        }
      }
    };
    uint32_t xc[GB][NT][4] = {}, xn[GB][NT][4] = {};
    load_piece(xc, min(warp, nchunks - 1), 0);
    for (int c = warp; c < nchunks; c += kWarps) {
      cs0.load(c + kWarps, qa1, qb1);
      if (two) cs1.load(c + kWarps, ra1, rb1);
      const uint32_t wa4[4] = {qa0.x, qa0.y, qa0.z, qa0.w}, wb4[4] = {qb0.x, qb0.y, qb0.z, qb0.w};
      const uint32_t va4[4] = {ra0.x, ra0.y, ra0.z, ra0.w}, vb4[4] = {rb0.x, rb0.y, rb0.z, rb0.w};
#pragma unroll
      for (int p = 0; p < PT; ++p) {
        if (p + 1 < PT) load_piece(xn, c, p + 1);
        else load_piece(xn, min(c + kWarps, nchunks - 1), 0);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t A0[4], A1[4];
          dequant_tile<kBits>(A0, wa4, wb4, 2 * p + h, sb, lane4);
          dequant_tile<kBits>(A1, va4, vb4, 2 * p + h, sb1, lane4);
#pragma unroll
          for (int i = 0; i < GB; ++i) {
            if (i >= ng) continue;  // block-uniform
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              mma16816(acc[0][i][nt], A0, xc[i][nt][2 * h], xc[i][nt][2 * h + 1]);
              mma16816(acc[1][i][nt], A1, xc[i][nt][2 * h], xc[i][nt][2 * h + 1]);
            }
          }
        }
#pragma unroll
        for (int i = 0; i < GB; ++i)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int w = 0; w < 4; ++w) xc[i][nt][w] = xn[i][nt][w];
      }
      qa0 = qa1; qb0 = qb1; ra0 = ra1; rb0 = rb1;
    }

    // the next item's first codes, in flight during this item's reductions
    const int nrow0 = npair * 32;
    const bool ntwo = next < items && nrow0 + 16 < N;
    const CodeStream<true> ncs0(codes, N, KB, next < items ? nrow0 : row0, g, t),
        ncs1(codes, N, KB, ntwo ? nrow0 + 16 : row0, g, t);
    if (next < items) ncs0.load(warp, qa0, qb0);
    if (ntwo) ncs1.load(warp, ra0, rb0);

    __syncthreads();  // both tables done with: the reductions reuse the first
#pragma unroll
    for (int T = 0; T < 2; ++T) {
      if (T == 1 && !two) continue;  // block-uniform (reduce_store synchronizes)
#pragma unroll
      for (int i = 0; i < GB; ++i) {
        if (i >= ng) continue;
        const int grp = g0 + i;
        reduce_store<NT, 0>(reinterpret_cast<float*>(smem), acc[T][i], tid, lane, warp, row0 + 16 * T,
                            min(16, M - 16 * grp), N, N, 0, 0, y, y + (size_t)grp * 16 * N);
      }
    }
    if (next >= items) break;
    __syncthreads();  // the reductions' reads are done before the next tables overwrite shared memory
    item = next; pair = npair; g0 = ng0; ng = nng; row0 = nrow0; two = ntwo; cs0 = ncs0; cs1 = ncs1;
  }
}

// The grid of cb_xr2_kernel: pairs of 16-row weight tiles x super-groups of GB groups.
__host__ __device__ inline int xr2_grid(int N, int M, int GB) {
  return ((N + 15) / 16 + 1) / 2 * (((M + 15) / 16 + GB - 1) / GB);
}

}  // namespace trapetum_abl
