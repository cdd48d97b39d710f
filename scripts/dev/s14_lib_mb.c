/* Session 14: the host library's tp_codebook_gemv alone (no Python), M = 1, warm (one matrix repeated) or cold
   (NMAT matrices in turn), per-row or shared tables, to set against s14_gemv_mb.c's bare row kernels.
     gcc -O3 -shared -fPIC -pthread -ffp-contract=off trapetum/kernels/host/codebook_host.c trapetum/kernels/host/codebook_host_512.c \
         trapetum/kernels/host/host_pool.c trapetum/kernels/host/cpu_step.c -o /tmp/lib.so -lm
     gcc -O2 scripts/dev/s14_lib_mb.c /tmp/lib.so -o /tmp/libmb -Wl,-rpath,/tmp
     /tmp/libmb BITS K N NMAT REPS WARM PATH THREADS [G]     (G > 0: shared tables, G rows a group)
   Prints GB/s of codes + tables as read (best of REPS). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int tp_codebook_gemv(const float *x, long ldx, long M, long K, const uint8_t *codes, long ldc, const uint16_t *cb,
                     const uint16_t *scale, long G, long N, int bits, float *y, long ldy, int threads, int path);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
  if (argc < 9) { fprintf(stderr, "usage: libmb BITS K N NMAT REPS WARM PATH THREADS [G]\n"); return 1; }
  int bits = atoi(argv[1]); long K = atol(argv[2]), N = atol(argv[3]), nmat = atol(argv[4]), reps = atol(argv[5]);
  int warm = atoi(argv[6]), path = atoi(argv[7]), thr = atoi(argv[8]); long G = argc > 9 ? atol(argv[9]) : 0;
  long ldc = bits == 4 ? (K + 1) / 2 : K, ne = 1L << bits, ntab = G ? (N + G - 1) / G : N;
  size_t per = (size_t)N * ldc;
  uint8_t *codes = malloc(per * nmat);
  for (size_t i = 0; i < per * nmat; i++) codes[i] = (uint8_t)(i * 2654435761u >> 13);
  uint16_t *cb = malloc(ntab * ne * 2), *sc = malloc(N * 2);
  for (long i = 0; i < ntab * ne; i++) cb[i] = (uint16_t)(0x3000 + (i * 7919) % 0x0fff);
  for (long i = 0; i < N; i++) sc[i] = (uint16_t)(0x3800 + i % 512);
  float *x = malloc(K * 4), *y = malloc(N * 4);
  for (long i = 0; i < K; i++) x[i] = (float)((i * 37) % 101) / 101.0f - 0.5f;
  double best = 1e9;
  for (long r = 0; r < reps; r++) {
    double t0 = now();
    for (long m = 0; m < nmat; m++)
      tp_codebook_gemv(x, K, 1, K, codes + (warm ? 0 : per * m), ldc, cb, G ? sc : NULL, G, N, bits, y, N, thr, path);
    double dt = now() - t0;
    if (dt < best) best = dt;
  }
  double bytes = (double)nmat * (per + (G ? ntab * ne * 2 + N * 2 : N * ne * 2));
  printf("lib bits=%d K=%ld N=%ld nmat=%ld warm=%d path=%d threads=%d G=%ld: %.2f GB/s (%.3f ms a matrix)\n", bits, K,
         N, nmat, warm, path, thr, G, bytes / best / 1e9, best / nmat * 1e3);
  return 0;
}
