/* Session 16: the per-call cost of host_pool.c's tp_pool_run at 1 and 2 threads, a dummy row function spinning W
   steps a row. The chunking variants of BENCHMARKS.md "Session 16" were this file built against copies of
   host_pool.c with 8L in `long chunk = (N + 8L * nt - 1) / (8L * nt);` replaced by 4L or 2L.
     gcc -O2 -pthread scripts/dev/s16_pool_mb.c -o /tmp/pool; /tmp/pool N W REPS */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "../../trapetum/kernels/host/host_pool.c"
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static volatile long sink;
static long W;
static void fn(const void *a, long n0, long n1) {
  (void)a; long s = 0;
  for (long n = n0; n < n1; n++) for (long i = 0; i < W; i++) s += i ^ n;
  sink += s;
}
int main(int argc, char **argv) {
  long N = atol(argv[1]); W = atol(argv[2]); int reps = atoi(argv[3]);
  for (int nt = 1; nt <= 2; nt++) {
    tp_pool_run(fn, NULL, N, nt);
    double best = 1e9;
    for (int r = 0; r < 5; r++) {
      double t0 = now();
      for (int i = 0; i < reps; i++) tp_pool_run(fn, NULL, N, nt);
      double dt = (now() - t0) / reps; if (dt < best) best = dt;
    }
    printf("N=%ld W=%ld nt=%d: %.2f us a call\n", N, W, nt, best * 1e6);
  }
  return 0;
}
