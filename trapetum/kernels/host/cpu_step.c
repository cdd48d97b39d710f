/* Host (CPU) small ops of a decode step (models/cpu_ops.py), fp32, one thread (they are tiny next to the GEMVs).

   tp_rmsnorm    y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * (w + offset)     rows of D features
                 (the mean accumulated in double; x and y may be the same memory)
   tp_rope_kv    rows m = 0 .. M-1 at positions start + m: q, k rotated by RoPE (cos / sin [M, rd] of each row,
                 the first rd of hd features; rotate-half, or the interleaved pairs written de-interleaved as
                 models/rope.py does), q into qo [M, Hq, hd], k and v into the cache (kc, vc: [Hkv, *, hd] with
                 head stride hs and position stride ps, fp32) at start + m
   tp_attend     tp_rope_kv, then each row's attention: query row m (head h reads kv head h / (Hq / Hkv)) over the
                 cache positions lo .. start + m (lo: start + m + 1 - window, or 0), fp32 scores times scale
                 (softcap: tanh(s / cap) * cap), softmax (max subtracted, sums in double), weighted values ->
                 out [M, Hq * hd]; each row alone, as the decode step at its position computes it
   tp_gemv_multi_norm   host/codebook_host.c's tp_gemv_multi of tp_rmsnorm(x) (the norm into a scratch, then the
                 GEMV: bitwise the two calls one after the other; one call from Python instead of two)
   tp_dense_layer   one dense decoder layer (tp_layer_t below): norm + q/k/v GEMV, tp_attend reading q / k / v out
                 of the fused rows, o GEMV + residual, norm + gate/up GEMV with act(gate) * up, down GEMV +
                 residual: the calls models/cpu_ops.py makes one by one, in one call (the same bits)
   The RoPE is the reference's own arithmetic (x * c + (-x') * s with no contraction: -ffp-contract=off), so
   its bits equal torch's elementwise ops. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int tp_rmsnorm(const float *x, long ldx, long rows, long D, const float *w, float offset, float eps, float *y,
               long ldy) {
  if (rows < 0 || D < 1 || ldx < D || ldy < D) return -1;
  for (long r = 0; r < rows; r++) {
    const float *xr = x + r * ldx;
    float *yr = y + r * ldy;
    double s = 0.0;
    for (long i = 0; i < D; i++) s += (double)xr[i] * (double)xr[i];
    float inv = 1.0f / sqrtf((float)(s / (double)D) + eps);
    for (long i = 0; i < D; i++) yr[i] = (xr[i] * inv) * (w[i] + offset);
  }
  return 0;
}

static void rope_row(const float *x, float *o, long hd, long rd, int interleave, const float *c, const float *s) {
  long h = rd / 2;
  if (interleave) {
    for (long i = 0; i < h; i++) {
      float x1 = x[2 * i], x2 = x[2 * i + 1];
      o[i] = x1 * c[i] - x2 * s[i];
      o[h + i] = x2 * c[i] + x1 * s[i];
    }
  } else {
    for (long i = 0; i < h; i++) {
      float x1 = x[i], x2 = x[h + i];
      o[i] = x1 * c[i] + (-x2) * s[i];
      o[h + i] = x2 * c[h + i] + x1 * s[h + i];
    }
  }
  for (long i = rd; i < hd; i++) o[i] = x[i];
}

int tp_rope_kv(const float *q, long ldq, const float *k, long ldk, const float *v, long ldv, long M, long Hq,
               long Hkv, long hd, long rd, int interleave, const float *cos, const float *sin, float *kc, float *vc,
               long hs, long ps, long start, float *qo) {
  if (M < 0 || Hq < 1 || Hkv < 1 || hd < 1 || rd < 0 || rd > hd || (rd & 1) || start < 0) return -1;
  for (long m = 0; m < M; m++) {
    const float *c = cos + m * rd, *s = sin + m * rd;
    for (long h = 0; h < Hq; h++) rope_row(q + m * ldq + h * hd, qo + (m * Hq + h) * hd, hd, rd, interleave, c, s);
    for (long h = 0; h < Hkv; h++) {
      float *kd = kc + h * hs + (start + m) * ps, *vd = vc + h * hs + (start + m) * ps;
      rope_row(k + m * ldk + h * hd, kd, hd, rd, interleave, c, s);
      memcpy(vd, v + m * ldv + h * hd, (size_t)hd * sizeof(float));
    }
  }
  return 0;
}

/* dot and axpy over one head's features: 16 fixed lanes, reduced in a fixed order (vectorised by the compiler
   under the target attribute of the caller's clone; the same arithmetic on every path) */
#define LANES 16
#define ATTEND_BODY                                                                                         \
  {                                                                                                         \
    long rep = Hq / Hkv;                                                                                    \
    for (long m = 0; m < M; m++) {                                                                          \
      long S = start + m + 1, lo = window > 0 && S > window ? S - window : 0, L = S - lo;                   \
      for (long h = 0; h < Hq; h++) {                                                                       \
        const float *qh = qo + (m * Hq + h) * hd;                                                           \
        const float *kb = kc + (h / rep) * hs + lo * ps, *vb = vc + (h / rep) * hs + lo * ps;               \
        float mx = -INFINITY;                                                                               \
        for (long j = 0; j < L; j++) {                                                                      \
          const float *kj = kb + j * ps;                                                                    \
          float acc[LANES] = {0};                                                                           \
          long i = 0;                                                                                       \
          for (; i + LANES <= hd; i += LANES)                                                               \
            for (int l = 0; l < LANES; l++) acc[l] += qh[i + l] * kj[i + l];                                \
          for (; i < hd; i++) acc[i % LANES] += qh[i] * kj[i];                                              \
          for (int w = LANES / 2; w > 0; w /= 2)                                                            \
            for (int l = 0; l < w; l++) acc[l] += acc[l + w];                                               \
          float sc = acc[0] * scale;                                                                        \
          if (softcap > 0) sc = tanhf(sc / softcap) * softcap;                                              \
          sbuf[j] = sc;                                                                                     \
          if (sc > mx) mx = sc;                                                                             \
        }                                                                                                   \
        double tot = 0.0;                                                                                   \
        for (long j = 0; j < L; j++) { sbuf[j] = expf(sbuf[j] - mx); tot += sbuf[j]; }                      \
        float inv = (float)(1.0 / tot);                                                                     \
        float *o = out + m * ldo + h * hd;                                                                  \
        for (long i = 0; i < hd; i++) o[i] = 0.0f;                                                          \
        for (long j = 0; j < L; j++) {                                                                      \
          const float *vj = vb + j * ps;                                                                    \
          float pj = sbuf[j] * inv;                                                                         \
          for (long i = 0; i < hd; i++) o[i] += pj * vj[i];                                                 \
        }                                                                                                   \
      }                                                                                                     \
    }                                                                                                       \
  }

#define ATTEND_ARGS                                                                                         \
  (const float *qo, long M, long Hq, long Hkv, long hd, const float *kc, const float *vc, long hs, long ps,  \
   long start, long window, float scale, float softcap, float *out, long ldo, float *sbuf)

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512vl,avx2,fma"))) static void attend_512 ATTEND_ARGS ATTEND_BODY
__attribute__((target("avx2,fma"))) static void attend_avx2 ATTEND_ARGS ATTEND_BODY
#endif
static void attend_c ATTEND_ARGS ATTEND_BODY

int tp_path(void);

/* path: as tp_codebook_gemv's (< 0: the best); window <= 0: none; softcap <= 0: none */
int tp_attend(const float *q, long ldq, const float *k, long ldk, const float *v, long ldv, long M, long Hq,
              long Hkv, long hd, long rd, int interleave, const float *cos, const float *sin, float *kc, float *vc,
              long hs, long ps, long start, long window, float scale, float softcap, float *qo, float *out,
              long ldo, int path) {
  if (Hkv < 1 || Hq % Hkv || ldo < Hq * hd) return -1;
  int rc = tp_rope_kv(q, ldq, k, ldk, v, ldv, M, Hq, Hkv, hd, rd, interleave, cos, sin, kc, vc, hs, ps, start, qo);
  if (rc) return rc;
  float *sbuf = (float *)malloc((size_t)(start + M) * sizeof(float));
  if (!sbuf) return -2;
  if (path < 0) path = tp_path();
#if defined(__x86_64__)
  if (path >= 2) attend_512(qo, M, Hq, Hkv, hd, kc, vc, hs, ps, start, window, scale, softcap, out, ldo, sbuf);
  else if (path == 1) attend_avx2(qo, M, Hq, Hkv, hd, kc, vc, hs, ps, start, window, scale, softcap, out, ldo, sbuf);
  else
#endif
  attend_c(qo, M, Hq, Hkv, hd, kc, vc, hs, ps, start, window, scale, softcap, out, ldo, sbuf);
  free(sbuf);
  return 0;
}

int tp_gemv_multi(const float *x, long ldx, long M, long K, int nseg, const long *segs, int bits, float *y,
                  long ldy, const float *bias, const float *res, long ldr, int act, int threads, int path);

/* x [M, K] (row stride ldx), norm weight nw [K], offset noff, eps neps; the rest as tp_gemv_multi's */
int tp_gemv_multi_norm(const float *x, long ldx, long M, long K, const float *nw, float noff, float neps, int nseg,
                       const long *segs, int bits, float *y, long ldy, const float *bias, const float *res, long ldr,
                       int act, int threads, int path) {
  if (M < 0 || K < 1 || ldx < K) return -1;
  if (M == 0) return 0;
  float *h = (float *)malloc((size_t)(M * K) * sizeof(float));
  if (!h) return -2;
  int rc = tp_rmsnorm(x, ldx, M, K, nw, noff, neps, h, K);
  if (rc == 0) rc = tp_gemv_multi(h, K, M, K, nseg, segs, bits, y, ldy, bias, res, ldr, act, threads, path);
  free(h);
  return rc;
}

/* A dense layer's weights and constants (kernels/host_ops.py DenseLayer builds it; the segment arrays are
   tp_gemv_multi's, kept alive there). Every GEMV reads fp32 rows of unit stride. */
typedef struct {
  long D, Hq, Hkv, hd, F, window;   /* model dim, heads, head dim, gate/up rows each (F), sliding window (0: none) */
  const float *n1w, *n2w;           /* the two RMSNorm weights [D] */
  float n1off, n1eps, n2off, n2eps, scale, softcap;
  int act, bits[4], nseg[4];        /* act: tp_gemv_multi's (1 SiLU, 2 GELU tanh); per GEMV: q/k/v, o, gate/up, down */
  const long *segs[4];
  const float *bias[4];             /* NULL: none */
} tp_layer_t;

/* x [M, D] (row stride ldx) -> out [M, D] (row stride ldo; not x); cos / sin [M, rd], the cache as tp_attend's */
int tp_dense_layer(const tp_layer_t *L, const float *x, long ldx, long M, float *out, long ldo, long rd,
                   int interleave, const float *cos, const float *sin, float *kc, float *vc, long hs, long ps,
                   long start, int threads) {
  long D = L->D, qd = L->Hq * L->hd, nq = (L->Hq + 2 * L->Hkv) * L->hd, F = L->F;
  if (M < 1 || ldx < D || ldo < D) return -1;
  float *qkv = (float *)malloc((size_t)(M * nq) * sizeof(float)), *qo = (float *)malloc((size_t)(M * qd) * sizeof(float));
  float *a = (float *)malloc((size_t)(M * qd) * sizeof(float)), *x1 = (float *)malloc((size_t)(M * D) * sizeof(float));
  float *g = (float *)malloc((size_t)(M * F) * sizeof(float));
  int rc = qkv && qo && a && x1 && g ? 0 : -2;
  if (!rc) rc = tp_gemv_multi_norm(x, ldx, M, D, L->n1w, L->n1off, L->n1eps, L->nseg[0], L->segs[0], L->bits[0],
                                   qkv, nq, L->bias[0], NULL, 0, 0, threads, -1);
  if (!rc) rc = tp_attend(qkv, nq, qkv + qd, nq, qkv + qd + L->Hkv * L->hd, nq, M, L->Hq, L->Hkv, L->hd, rd,
                          interleave, cos, sin, kc, vc, hs, ps, start, L->window, L->scale, L->softcap, qo, a, qd, -1);
  if (!rc) rc = tp_gemv_multi(a, qd, M, qd, L->nseg[1], L->segs[1], L->bits[1], x1, D, L->bias[1], x, ldx, 0,
                              threads, -1);
  if (!rc) rc = tp_gemv_multi_norm(x1, D, M, D, L->n2w, L->n2off, L->n2eps, L->nseg[2], L->segs[2], L->bits[2], g,
                                   F, L->bias[2], NULL, 0, L->act, threads, -1);
  if (!rc) rc = tp_gemv_multi(g, F, M, F, L->nseg[3], L->segs[3], L->bits[3], out, ldo, L->bias[3], x1, D, 0,
                              threads, -1);
  free(qkv); free(qo); free(a); free(x1); free(g);
  return rc;
}
