// Host check of the grouped codebook GEMV's helpers (trapetum/kernels/cuda/codebook_gemv_groups.cuh), built by
// tests/test_kernels_gemv_grouped.py with nvcc and run on the CPU: the grid covers every (weight tile, row group)
// once, and every lane reads its group's fragment-order x. Prints "OK n" or a FAIL line (exit 1).
#ifndef TRAPETUM_CBGEMV_CU
#define TRAPETUM_CBGEMV_CU "codebook_gemv_mma.cu"
#endif
#include TRAPETUM_CBGEMV_CU
#include <algorithm>
#include <cstdio>
#include <vector>
int main() {
  using namespace trapetum_mma;
  long long checked = 0;
  // every (weight tile, row group) is computed by exactly one block of the grid, which holds 1..GB groups
  for (int GB : {2, 4})
    for (int M = 17; M <= kMaxGroupedRows; ++M)
      for (int N : {16, 48, 4096 + 16}) {
        const int G = (M + 15) / 16, tiles = N / 16, grid = groups_grid(N, M, GB);
        std::vector<int> seen(tiles * G, 0);
        for (int b = 0; b < grid; ++b) {
          int tile, g0, ng;
          groups_block(b, M, GB, tile, g0, ng);
          if (tile < 0 || tile >= tiles || ng < 1 || ng > GB || g0 < 0 || g0 + ng > G) {
            printf("FAIL block %d M %d N %d GB %d: tile %d g0 %d ng %d\n", b, M, N, GB, tile, g0, ng);
            return 1;
          }
          for (int i = 0; i < ng; ++i) seen[tile * G + g0 + i]++;
        }
        for (int v : seen)
          if (v != 1) { printf("FAIL coverage M %d N %d GB %d\n", M, N, GB); return 1; }
        ++checked;
      }
  // what lane t reads for row m of group g0 + i (groups_x_piece + 4 m, from the block's first group g0) is what
  // x_fragments_groups_kernel wrote there: group g0 + i's rows at element offset 16 (g0 + i) K, in the 16-row
  // call's fragment order (frag_index) of the group's own row count
  for (int PT : {4, 2})
    for (int M : {17, 31, 32, 48, 63, 64, 65, 100, 255, 256})
      for (int K : {64 * PT, 512, 4096 + 64 * PT}) {
        const int G = (M + 15) / 16, nch = K / (32 * PT);
        for (int g0 = 0; g0 < G; g0 += 4)
          for (int i = 0; i < 4 && g0 + i < G; ++i) {
            const int grp = g0 + i, mg = std::min(16, M - 16 * grp);
            for (int c = 0; c < nch; ++c)
              for (int p = 0; p < PT; ++p)
                for (int t = 0; t < 4; ++t)
                  for (int m = 0; m < mg; ++m) {
                    const size_t got = ((size_t)g0 * 2 * K + groups_x_piece(i, mg, K, PT, c, p, t) + m * 4) * 8;
                    const int k0 = 8 * ((c * 4 + t) * PT + p);  // lane t's piece p of chunk c: features k0 .. k0+7
                    if (got != (size_t)grp * 16 * K + frag_index(m, k0, mg, PT)) {
                      printf("FAIL x M %d K %d grp %d c %d p %d t %d m %d\n", M, K, grp, c, p, t, m);
                      return 1;
                    }
                    ++checked;
                  }
          }
      }
  printf("OK %lld\n", checked);
  return 0;
}
