/* Host (CPU) GEMV of GGUF "legacy" block-quantized weights, read where they lie (kernels/ggml_host.py).

   y[m, n] = sum_k x[m, k] * w[n, k]     x fp32 [M, K] (row stride ldx), y fp32 [M, N] (row stride ldy)
   blocks: uint8 [N, ldb >= K / 32 * bytes], row n = its K / 32 blocks of 32 weights, as a GGUF file stores them
   (d, m: little-endian fp16; element j < 16 in the low nibble of qs[j], element j + 16 in its high nibble):
     type 0 Q4_0  18 bytes: d, qs[16]            w = d * (q - 8)
     type 1 Q4_1  20 bytes: d, m, qs[16]         w = d * q + m       (d * q is exact: one rounding, fmaf(d, q, m))
     type 2 Q5_0  22 bytes: d, qh (uint32 LE: bit j = bit 4 of element j), qs[16]; q = nibble | bit << 4,
                                                 w = d * (q - 16)
     type 3 Q8_0  34 bytes: d, q[32] int8        w = d * q
   Every w is an fp32 value fixed by the bytes, bitwise gguf.quants.dequantize's (the products of an fp16 d with
   these q are exact in fp32; Q4_1's sum its one rounding); tp_ggml_dequant writes them.

   Numerics, one fixed definition on every path: 16 fp32 lane accumulators acc[l] = +0; for each block b in order,
   for i = 0..31: acc[i % 16] = fmaf(w_i, x_i, acc[i % 16]) (lane l: (b 0, i = l), (b 0, i = l + 16), (b 1, i = l),
   ..); then h[l] = acc[l] + acc[l + 8] (l < 8) and y = ((h0 + h4) + (h2 + h6)) + ((h1 + h5) + (h3 + h7)).
   Contracts (tests/test_ggml_host.py):
   - every code path gives these bits: portable C (path 0, libm fmaf), AVX2 + FMA (1: a block as four ymm of 8,
     two accumulators of lanes 0..7 / 8..15), AVX-512 F/BW/VL (2 and higher: two zmm of 16, one accumulator; the
     4-bit types' 16 (Q5_0: 32) values d (i - c) or d i + m formed once a block, looked up by the nibbles with
     vpermps / vpermt2ps), chosen at run time; path < 0: tp_path(); a path is capped at what the CPU runs;
   - batch invariance: row m of y is bitwise a call with x[m] alone, for every M: rows of x in register groups of
     up to 4 sharing a decoded block, up to 8 weight rows a step (independent FMA chains), each output its own
     one-row sequence;
   - threads: output rows are split over the pool (host/host_pool.c), each element computed by one thread in
     its fixed order: identical for every thread count, schedule and run to run.
   Software prefetch two steps ahead (2 NR rows down), the line of every block's last byte: codebook PF's 4096
   bytes ahead ran a 38 MB Q4_0 matrix at 7.7 GB/s against 22 here, once per 64 bytes the 30 MB Q8_0 head at 27
   against 37 (Zen 5, one thread). Nothing is allocated; returns 0 or -1 (bad arguments).
   Build: codebook_host.c's flags (-ffp-contract=off: every FMA is an explicit fmaf or intrinsic). */
#include "codebook_host.h"

enum { GQ4_0 = 0, GQ4_1 = 1, GQ5_0 = 2, GQ8_0 = 3, GTYPES = 4 };
static const int gg_bytes[GTYPES] = {18, 20, 22, 34};

int tp_path(void);
void tp_pool_run(void (*fn)(const void *, long, long), const void *arg, long N, int nt);

typedef struct {
  const float *x; long ldx, M, K;
  const uint8_t *b; long ldb; int type, path;
  float *y; long ldy;
} gg_job_t;

static inline float gg_tree(const float *acc) {
  float h[8];
  for (int l = 0; l < 8; l++) h[l] = acc[l] + acc[l + 8];
  return ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]));
}

/* ---------------------------------------------------------------- portable path */
static inline float gg_h(const uint8_t *p) { return h2f((uint16_t)(p[0] | p[1] << 8)); }

/* block p's 32 weights (the fp32 values of the file comment) into w */
static void block_c(const uint8_t *p, int type, float *w) {
  const float d = gg_h(p);
  switch (type) {
    case GQ4_0:
      for (int j = 0; j < 16; j++) {
        w[j] = d * (float)((p[2 + j] & 15) - 8);
        w[j + 16] = d * (float)((p[2 + j] >> 4) - 8);
      }
      break;
    case GQ4_1: { /* d * q exact: the add is the one rounding of fmaf(d, q, m) */
      const float m = gg_h(p + 2);
      for (int j = 0; j < 16; j++) {
        w[j] = d * (float)(p[4 + j] & 15) + m;
        w[j + 16] = d * (float)(p[4 + j] >> 4) + m;
      }
      break;
    }
    case GQ5_0: {
      const uint32_t qh = (uint32_t)p[2] | (uint32_t)p[3] << 8 | (uint32_t)p[4] << 16 | (uint32_t)p[5] << 24;
      for (int j = 0; j < 16; j++) {
        w[j] = d * (float)((int)((p[6 + j] & 15) | ((qh >> j) & 1) << 4) - 16);
        w[j + 16] = d * (float)((int)((p[6 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
      }
      break;
    }
    default:
      for (int j = 0; j < 32; j++) w[j] = d * (float)(int8_t)p[2 + j];
  }
}

static void rows_c(const gg_job_t *j, long n0, long n1) {
  const int bs = gg_bytes[j->type];
  const long nb = j->K / 32;
  float w[32];
  for (long n = n0; n < n1; n++) {
    const uint8_t *row = j->b + n * j->ldb;
    for (long m0 = 0; m0 < j->M; m0 += 4) {
      const int R = j->M - m0 < 4 ? (int)(j->M - m0) : 4;
      float acc[4][16] = {{0}};
      for (long b = 0; b < nb; b++) {
        block_c(row + b * bs, j->type, w);
        for (int r = 0; r < R; r++) {
          const float *x = j->x + (m0 + r) * j->ldx + b * 32;
          for (int i = 0; i < 32; i++) acc[r][i & 15] = fmaf(w[i], x[i], acc[r][i & 15]);
        }
      }
      for (int r = 0; r < R; r++) j->y[(m0 + r) * j->ldy + n] = gg_tree(acc[r]);
    }
  }
}

#if TP_X86
/* ---------------------------------------------------------------- AVX2 path */
#define T2 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

T2 __m256 d256(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _mm256_set1_ps(_cvtsh_ss(h)); }

/* the 8 signed bytes of v's low half as fp32 */
T2 __m256 i8f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* block p's 32 weights: w[0..3] = elements 0..7, 8..15, 16..23, 24..31 */
T2 void block_avx2(const uint8_t *p, int type, __m256 *w) {
  const __m256 d = d256(p);
  if (type == GQ8_0) {
    for (int q = 0; q < 4; q++) w[q] = _mm256_mul_ps(d, i8f(_mm_loadl_epi64((const __m128i *)(p + 2 + 8 * q))));
    return;
  }
  const __m128i m4 = _mm_set1_epi8(15);
  const __m128i v = _mm_loadu_si128((const __m128i *)(p + (type == GQ4_0 ? 2 : type == GQ4_1 ? 4 : 6)));
  __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
  if (type == GQ4_0) {
    lo = _mm_sub_epi8(lo, _mm_set1_epi8(8)); hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
  } else if (type == GQ5_0) { /* q - 16 = nibble | (bit ? 0 : 0xf0) as int8; byte i of bits: 0xff where bit i */
    uint32_t qh; memcpy(&qh, p + 2, 4);
    const __m256i sel = _mm256_set_epi64x(0x0303030303030303ll, 0x0202020202020202ll, 0x0101010101010101ll, 0);
    __m256i bits = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), sel);
    bits = _mm256_cmpeq_epi8(_mm256_or_si256(bits, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfell)), _mm256_set1_epi64x(-1));
    const __m256i off = _mm256_andnot_si256(bits, _mm256_set1_epi8((char)0xf0));
    lo = _mm_or_si128(lo, _mm256_castsi256_si128(off)); hi = _mm_or_si128(hi, _mm256_extracti128_si256(off, 1));
  }
  if (type == GQ4_1) {
    const __m256 m = d256(p + 2);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
    return;
  }
  w[0] = _mm256_mul_ps(d, i8f(lo)); w[1] = _mm256_mul_ps(d, i8f(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_mul_ps(d, i8f(hi)); w[3] = _mm256_mul_ps(d, i8f(_mm_srli_si128(hi, 8)));
}

T2 float tree256(__m256 lo, __m256 hi) { /* lanes 0..7 in lo, 8..15 in hi: the file comment's tree */
  const __m256 h = _mm256_add_ps(lo, hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)); /* h0 + h4, h1 + h5, .. */
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                        /* (h0 + h4) + (h2 + h6), .. */
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* weight rows n .. n + NR - 1 against x rows m0 .. m0 + R - 1; each block prefetches the line of its last byte in
   the row 2 NR rows down (two steps ahead; every line of a row holds some block's last byte) */
T2 void kern_avx2(const gg_job_t *j, long n, long m0, const int R, const int NR, const int type) {
  const int bs = gg_bytes[type];
  const long end = j->K / 32 * bs, ldb = j->ldb, pfd = 2 * NR * ldb;
  __m256 a0[8][4], a1[8][4];
  for (int q = 0; q < NR; q++)
    for (int r = 0; r < R; r++) { a0[q][r] = _mm256_setzero_ps(); a1[q][r] = _mm256_setzero_ps(); }
  const uint8_t *rp[8];
  for (int q = 0; q < NR; q++) rp[q] = j->b + (n + q) * ldb;
  const float *xr[4];
  for (int r = 0; r < R; r++) xr[r] = j->x + (m0 + r) * j->ldx;
  for (long o = 0; o < end; o += bs) {
    for (int q = 0; q < NR; q++) _mm_prefetch((const char *)rp[q] + o + pfd + bs - 1, _MM_HINT_T0);
    for (int q = 0; q < NR; q++) {
      __m256 w[4];
      block_avx2(rp[q] + o, type, w);
      for (int r = 0; r < R; r++) {
        a0[q][r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr[r]), a0[q][r]);
        a1[q][r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr[r] + 8), a1[q][r]);
        a0[q][r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr[r] + 16), a0[q][r]);
        a1[q][r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr[r] + 24), a1[q][r]);
      }
    }
    for (int r = 0; r < R; r++) xr[r] += 32;
  }
  for (int q = 0; q < NR; q++)
    for (int r = 0; r < R; r++) j->y[(m0 + r) * j->ldy + n + q] = tree256(a0[q][r], a1[q][r]);
}

/* ---------------------------------------------------------------- AVX-512 path */
#define T5 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), always_inline)) static inline

/* block p's 32 weights: w0 = elements 0..15, w1 = 16..31 */
T5 void block_512(const uint8_t *p, int type, __m512 *w0, __m512 *w1) {
  const __m128 h = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p)); /* d, then (Q4_1) m */
  const __m512 d = _mm512_broadcastss_ps(h);
  if (type == GQ8_0) {
    *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2)))));
    *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18)))));
    return;
  }
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const uint8_t *qs = p + (type == GQ4_0 ? 2 : type == GQ4_1 ? 4 : 6);
  const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
  const __m512i hi = _mm512_srli_epi32(lo, 4); /* the high nibbles; the lookups read the low 4 (5) bits of lo */
  if (type == GQ5_0) { /* 32 values d * (q - 16): q < 16 in t0, q >= 16 in t1; the index's bit 4 from qh */
    uint32_t qh; memcpy(&qh, p + 2, 4);
    const __m512 t0 = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(16.0f))), t1 = _mm512_mul_ps(d, iota);
    const __m512i q = _mm512_set1_epi32((int)qh), f = _mm512_set1_epi32(15);
    const __m512i r = _mm512_setr_epi32(28, 29, 30, 31, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11); /* bit l to bit 4 */
    const __m512i ilo = _mm512_ternarylogic_epi32(lo, _mm512_rorv_epi32(q, r), f, 0xe4); /* f ? lo : rot */
    const __m512i r16 = _mm512_add_epi32(r, _mm512_set1_epi32(16)); /* bit l + 16 to bit 4 */
    const __m512i ihi = _mm512_ternarylogic_epi32(hi, _mm512_rorv_epi32(q, r16), f, 0xe4);
    *w0 = _mm512_permutex2var_ps(t0, ilo, t1);
    *w1 = _mm512_permutex2var_ps(t0, ihi, t1);
    return;
  }
  const __m512 t = type == GQ4_0 ? _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f))) /* d (i - 8) */
      : _mm512_fmadd_ps(d, iota, _mm512_permutexvar_ps(_mm512_set1_epi32(1), _mm512_castps128_ps512(h)));
  *w0 = _mm512_permutexvar_ps(lo, t);
  *w1 = _mm512_permutexvar_ps(hi, t);
}

T5 float tree512(__m512 a) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), hi); /* h[l] = acc[l] + acc[l + 8] */
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

T5 void kern_512(const gg_job_t *j, long n, long m0, const int R, const int NR, const int type) {
  const int bs = gg_bytes[type];
  const long end = j->K / 32 * bs, ldb = j->ldb, pfd = 2 * NR * ldb; /* prefetch: the rows 2 steps below */
  __m512 acc[8][4];
  for (int q = 0; q < NR; q++)
    for (int r = 0; r < R; r++) acc[q][r] = _mm512_setzero_ps();
  const uint8_t *rp[8];
  for (int q = 0; q < NR; q++) rp[q] = j->b + (n + q) * ldb;
  const float *xr[4];
  for (int r = 0; r < R; r++) xr[r] = j->x + (m0 + r) * j->ldx;
  for (long o = 0; o < end; o += bs) {
    for (int q = 0; q < NR; q++) _mm_prefetch((const char *)rp[q] + o + pfd + bs - 1, _MM_HINT_T0);
    __m512 x0[4], x1[4];
    for (int r = 0; r < R; r++) { x0[r] = _mm512_loadu_ps(xr[r]); x1[r] = _mm512_loadu_ps(xr[r] + 16); xr[r] += 32; }
    for (int q = 0; q < NR; q++) {
      __m512 w0, w1;
      block_512(rp[q] + o, type, &w0, &w1);
      for (int r = 0; r < R; r++) {
        acc[q][r] = _mm512_fmadd_ps(w0, x0[r], acc[q][r]);
        acc[q][r] = _mm512_fmadd_ps(w1, x1[r], acc[q][r]);
      }
    }
  }
  for (int q = 0; q < NR; q++)
    for (int r = 0; r < R; r++) j->y[(m0 + r) * j->ldy + n + q] = tree512(acc[q][r]);
}

/* weight rows a step, their outputs independent FMA chains (hiding the FMA latency): AVX2 (two chains an output,
   16 registers) M = 1: 4, M = 2: 2, else 1; AVX-512 (one chain an output, 32 registers) M = 1: 8, else 4 */
static inline int nr_avx2(long M) { return M == 1 ? 4 : M == 2 ? 2 : 1; }
static inline int nr_512(long M) { return M == 1 ? 8 : 4; }

/* rows n0 .. n1 - 1 on one path: NR weight rows a step (the last rows 4, then 1 at a time), x rows in groups of
   R <= 4; only the (R, NR) that occur are compiled: AVX2 (1, 4), (2, 2), (R, 1); AVX-512 (1, 8), (R, 4), (R, 1) */
#define GG_ROWS(NAME, KERN, TGT, NRFN, W)                                                                  \
  TGT static void NAME##_t(const gg_job_t *j, long n0, long n1, const int type) {                          \
    const int NR = NRFN(j->M);                                                                             \
    for (long n = n0; n < n1;) {                                                                           \
      const int nr = n1 - n >= NR ? NR : NR > 4 && n1 - n >= 4 ? 4 : 1;                                    \
      for (long m0 = 0; m0 < j->M; m0 += 4) {                                                              \
        const long R = j->M - m0 < 4 ? j->M - m0 : 4;                                                      \
        if (W && nr == 8) KERN(j, n, m0, 1, 8, type);                                                      \
        else if (nr == 4 && R == 1) KERN(j, n, m0, 1, 4, type);                                            \
        else if (W && nr == 4 && R == 2) KERN(j, n, m0, 2, 4, type);                                       \
        else if (W && nr == 4 && R == 3) KERN(j, n, m0, 3, 4, type);                                       \
        else if (W && nr == 4) KERN(j, n, m0, 4, 4, type);                                                 \
        else if (!W && nr == 2) KERN(j, n, m0, 2, 2, type);                                                \
        else if (R == 4) KERN(j, n, m0, 4, 1, type);                                                       \
        else if (R == 3) KERN(j, n, m0, 3, 1, type);                                                       \
        else if (R == 2) KERN(j, n, m0, 2, 1, type);                                                       \
        else KERN(j, n, m0, 1, 1, type);                                                                   \
      }                                                                                                    \
      n += nr;                                                                                             \
    }                                                                                                      \
  }                                                                                                        \
  TGT static void NAME(const gg_job_t *j, long n0, long n1) {                                              \
    switch (j->type) {                                                                                     \
      case GQ4_0: NAME##_t(j, n0, n1, GQ4_0); break;                                                       \
      case GQ4_1: NAME##_t(j, n0, n1, GQ4_1); break;                                                       \
      case GQ5_0: NAME##_t(j, n0, n1, GQ5_0); break;                                                       \
      default: NAME##_t(j, n0, n1, GQ8_0);                                                                 \
    }                                                                                                      \
  }
GG_ROWS(rows_avx2, kern_avx2, __attribute__((target("avx2,fma,f16c"))), nr_avx2, 0)
GG_ROWS(rows_512, kern_512, __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), nr_512, 1)
#undef GG_ROWS

/* dequantize: rows n0 .. n1 - 1 into out (the same exact values as block_c) */
__attribute__((target("avx2,fma,f16c"))) static void deq_avx2(const uint8_t *b, long ldb, int type, long n0, long n1,
                                                              long K, float *out, long ldo) {
  const int bs = gg_bytes[type];
  for (long n = n0; n < n1; n++)
    for (long k = 0; k < K; k += 32) {
      __m256 w[4];
      switch (type) {
        case GQ4_0: block_avx2(b + n * ldb + k / 32 * bs, GQ4_0, w); break;
        case GQ4_1: block_avx2(b + n * ldb + k / 32 * bs, GQ4_1, w); break;
        case GQ5_0: block_avx2(b + n * ldb + k / 32 * bs, GQ5_0, w); break;
        default: block_avx2(b + n * ldb + k / 32 * bs, GQ8_0, w);
      }
      float *o = out + (n - n0) * ldo + k;
      for (int q = 0; q < 4; q++) _mm256_storeu_ps(o + 8 * q, w[q]);
    }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) static void deq_512(
    const uint8_t *b, long ldb, int type, long n0, long n1, long K, float *out, long ldo) {
  const int bs = gg_bytes[type];
  for (long n = n0; n < n1; n++)
    for (long k = 0; k < K; k += 32) {
      __m512 w0, w1;
      switch (type) {
        case GQ4_0: block_512(b + n * ldb + k / 32 * bs, GQ4_0, &w0, &w1); break;
        case GQ4_1: block_512(b + n * ldb + k / 32 * bs, GQ4_1, &w0, &w1); break;
        case GQ5_0: block_512(b + n * ldb + k / 32 * bs, GQ5_0, &w0, &w1); break;
        default: block_512(b + n * ldb + k / 32 * bs, GQ8_0, &w0, &w1);
      }
      float *o = out + (n - n0) * ldo + k;
      _mm512_storeu_ps(o, w0); _mm512_storeu_ps(o + 16, w1);
    }
}
#endif

/* ---------------------------------------------------------------- entry points */
static int gg_cpu(void) { /* the best of this file's paths the CPU runs */
#if TP_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
      && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return PATH_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return PATH_AVX2;
#endif
  return PATH_C;
}

static int gg_path(int path) { /* path < 0: tp_path(); then capped at the CPU's best; >= PATH_AVX512 as it */
  const int best = gg_cpu();
  if (path < 0) path = tp_path();
  if (path > PATH_AVX512) path = PATH_AVX512;
  return path > best ? best : path;
}

static void gg_rows(const gg_job_t *j, long n0, long n1) {
#if TP_X86
  if (j->path == PATH_AVX512) { rows_512(j, n0, n1); return; }
  if (j->path == PATH_AVX2) { rows_avx2(j, n0, n1); return; }
#endif
  rows_c(j, n0, n1);
}

static void gg_rows_cb(const void *arg, long n0, long n1) { gg_rows((const gg_job_t *)arg, n0, n1); }

/* rows n0 .. n1 - 1 of y = x times the block rows (tp_gemv_multi's segments of GGUF blocks, bits TP_BITS_GGML, in
   the calling thread; arguments checked there): the same sequences as tp_ggml_gemv */
void tp_ggml_rows(const float *x, long ldx, long M, long K, const uint8_t *blocks, long ldb, int type, int path,
                  float *y, long ldy, long n0, long n1) {
  const gg_job_t j = {x, ldx, M, K, blocks, ldb, type, gg_path(path), y, ldy};
  gg_rows(&j, n0, n1);
}

/* bytes a block of 32 of `type`, or 0 for a type this file does not read */
int tp_ggml_block_bytes(int type) { return type >= 0 && type < GTYPES ? gg_bytes[type] : 0; }

/* y [M, N] = x [M, K] times the block rows' weights transposed; path < 0: tp_path() */
int tp_ggml_gemv(const float *x, long ldx, long M, long K, const uint8_t *blocks, long ldb, int type, long N,
                 float *y, long ldy, int threads, int path) {
  if (type < 0 || type >= GTYPES || K < 32 || K % 32 || M < 0 || N < 0 || ldx < K || ldy < N) return -1;
  if (ldb < K / 32 * gg_bytes[type]) return -1;
  if (M == 0 || N == 0) return 0;
  if (!x || !blocks || !y) return -1;
  const gg_job_t j = {x, ldx, M, K, blocks, ldb, type, gg_path(path), y, ldy};
  if (threads < 1) threads = 1;
  if (threads > N) threads = (int)N;
  if (threads == 1) gg_rows(&j, 0, N); else tp_pool_run(gg_rows_cb, &j, N, threads);
  return 0;
}

/* out fp32 [n1 - n0, K] (row stride ldo) = the exact weights of block rows n0 .. n1 - 1 */
int tp_ggml_dequant(const uint8_t *blocks, long ldb, int type, long n0, long n1, long K, float *out, long ldo) {
  if (type < 0 || type >= GTYPES || K < 32 || K % 32 || n0 < 0 || n1 < n0 || ldo < K) return -1;
  if (ldb < K / 32 * gg_bytes[type]) return -1;
  if (n1 == n0) return 0;
  if (!blocks || !out) return -1;
#if TP_X86
  const int path = gg_path(-1);
  if (path == PATH_AVX512) { deq_512(blocks, ldb, type, n0, n1, K, out, ldo); return 0; }
  if (path == PATH_AVX2) { deq_avx2(blocks, ldb, type, n0, n1, K, out, ldo); return 0; }
#endif
  const int bs = gg_bytes[type];
  for (long n = n0; n < n1; n++)
    for (long k = 0; k < K; k += 32) block_c(blocks + n * ldb + k / 32 * bs, type, out + (n - n0) * ldo + k);
  return 0;
}
