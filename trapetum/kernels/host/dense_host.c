/* Host (CPU) GEMV of dense fp32 weights over M rows, each row's result independent of the others
   (kernels/dense_host.py).

   y[m, n] = sum_k x[m, k] * w[n, k]  (+ bias[n])  (+ res[m, n])
   x fp32 [M, K] (row stride ldx), w fp32 [N, K] (row stride ldw), y fp32 [M, N] (row stride ldy),
   bias fp32 [N] or NULL, res fp32 [M, N] (row stride ldr) or NULL.

   Contracts (tests/test_dense_host.py):
   - batch invariance: every output element is one fixed sequence of fp32 operations that depends only on
     (its x row, its w row, K): 16 lane accumulators over k = 16 j + l (a product, then an add: no FMA, built
     with -ffp-contract=off), the K % 16 tail into lanes 0.., the lanes summed in a fixed tree, then + bias, then
     + res. So row m of y is bitwise what a call with x[m] alone gives, for every M;
   - the clones the compiler makes per instruction set (AVX-512, AVX2, baseline) vectorize across the lanes only,
     so every clone gives the same bits;
   - threads: output columns are split in contiguous ranges over `threads` threads; each element is computed by
     one thread: results are identical for every thread count.
   A weight row is read once for all M rows (it stays in the L1 cache while the rows pass over it, four rows at a
   time in registers: each of the four runs exactly the one-row sequence). */
#include <pthread.h>
#include <stdlib.h>

#define LANES 16
#define MAX_THREADS 64

typedef struct {
  const float *x; long ldx, M, K;
  const float *w; long ldw, n0, n1;
  float *y; long ldy;
  const float *bias, *res; long ldr;
} dense_job_t;

__attribute__((target_clones("avx512f", "avx2", "default")))
static float dot_lanes(const float *a, const float *b, long K) {
  float acc[LANES];
  for (int l = 0; l < LANES; l++) acc[l] = 0.0f;
  long k = 0;
  for (; k + LANES <= K; k += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += a[k + l] * b[k + l];
  for (int l = 0; k < K; k++, l++) acc[l] += a[k] * b[k];
  for (int s = LANES / 2; s > 0; s /= 2)
    for (int l = 0; l < s; l++) acc[l] += acc[l + s];
  return acc[0];
}

/* four rows against one weight row: each row's lanes exactly as dot_lanes computes them (the weight loaded once) */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void dot_lanes4(const float *a0, const float *a1, const float *a2, const float *a3, const float *b, long K,
                       float *out) {
  float acc[4][LANES];
  for (int r = 0; r < 4; r++)
    for (int l = 0; l < LANES; l++) acc[r][l] = 0.0f;
  long k = 0;
  for (; k + LANES <= K; k += LANES)
    for (int l = 0; l < LANES; l++) {
      float w = b[k + l];
      acc[0][l] += a0[k + l] * w;
      acc[1][l] += a1[k + l] * w;
      acc[2][l] += a2[k + l] * w;
      acc[3][l] += a3[k + l] * w;
    }
  for (int l = 0; k < K; k++, l++) {
    acc[0][l] += a0[k] * b[k];
    acc[1][l] += a1[k] * b[k];
    acc[2][l] += a2[k] * b[k];
    acc[3][l] += a3[k] * b[k];
  }
  for (int r = 0; r < 4; r++) {
    for (int s = LANES / 2; s > 0; s /= 2)
      for (int l = 0; l < s; l++) acc[r][l] += acc[r][l + s];
    out[r] = acc[r][0];
  }
}

static void store(const dense_job_t *j, long m, long n, float v) {
  if (j->bias) v += j->bias[n];
  if (j->res) v += j->res[m * j->ldr + n];
  j->y[m * j->ldy + n] = v;
}

static void run_cols(const dense_job_t *j) {
  long M4 = j->M / 4 * 4;
  for (long n = j->n0; n < j->n1; n++) {
    const float *wr = j->w + n * j->ldw;
    long m = 0;
    for (; m < M4; m += 4) {
      float v[4];
      const float *x0 = j->x + m * j->ldx;
      dot_lanes4(x0, x0 + j->ldx, x0 + 2 * j->ldx, x0 + 3 * j->ldx, wr, j->K, v);
      for (int r = 0; r < 4; r++) store(j, m + r, n, v[r]);
    }
    for (; m < j->M; m++) store(j, m, n, dot_lanes(j->x + m * j->ldx, wr, j->K));
  }
}

static void *worker(void *arg) {
  run_cols((const dense_job_t *)arg);
  return NULL;
}

/* returns 0, or -1 (bad arguments) */
int tp_dense_gemv(const float *x, long ldx, long M, long K, const float *w, long ldw, long N, float *y, long ldy,
                  const float *bias, const float *res, long ldr, int threads) {
  if (M < 0 || K < 1 || N < 0 || ldx < K || ldw < K || ldy < N || (res && ldr < N)) return -1;
  if (M == 0 || N == 0) return 0;
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  if (threads > N) threads = (int)N;
  dense_job_t jobs[MAX_THREADS];
  pthread_t tids[MAX_THREADS];
  int joined[MAX_THREADS] = {0};
  long per = (N + threads - 1) / threads;
  for (int t = 0; t < threads; t++) {
    long n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
    jobs[t] = (dense_job_t){x, ldx, M, K, w, ldw, n0 < N ? n0 : N, n1, y, ldy, bias, res, ldr};
  }
  for (int t = 1; t < threads; t++) {
    if (jobs[t].n0 >= jobs[t].n1) continue;
    if (pthread_create(&tids[t], NULL, worker, &jobs[t]) == 0) joined[t] = 1;
    else run_cols(&jobs[t]);  /* no thread: this one does it */
  }
  run_cols(&jobs[0]);
  for (int t = 1; t < threads; t++)
    if (joined[t]) pthread_join(tids[t], NULL);
  return 0;
}
