/* Session 14: software-prefetch sweep of the AVX-512 row kernels (codebook_host.c row4_512 / row8_512, one row of x),
   cold (a code set larger than the L3) and warm (one matrix, repeated), against plain C reads of the same bytes.
     gcc -O3 -march=native -ffp-contract=off scripts/dev/s14_gemv_mb.c -o /tmp/mb
     /tmp/mb BITS K N NMAT REPS VARIANT DIST [WARM]
   VARIANT: k0 kernel with prefetch T0 at DIST bytes ahead (once per 64 code bytes; DIST 0: none), k1 T1, k2 T2,
   kn NTA, kr T0 of the next row's first lines (DIST lines of the row n + 1 .. prefetched at row start, then T0 at
   4096 bytes ahead), r plain vpaddd read (DIST prefetch, 0 none), s fp32 sum of the bytes as floats (numpy-like).
   Prints GB/s of codes (best of REPS). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define T "avx512f,avx512bw,avx512vl,avx2,fma,f16c,avx512vbmi"
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

#define PFH(H, p) _mm_prefetch((const char *)(p), H)
#define L128(S, A) A = _mm512_fmadd_ps(_mm512_permutexvar_ps((S) ? _mm512_srli_epi32(v, 4 * (S)) : v, tab), \
                                       _mm512_loadu_ps(x + b * 128 + 16 * (S)), A)
#define ROW4(NAME, H)                                                                                     \
  __attribute__((target(T))) static float NAME(const uint8_t *c, const float *x, long nb, __m512 tab, long d) { \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                           \
    for (long b = 0; b < nb; b++) {                                                                       \
      const uint8_t *p = c + b * 64;                                                                      \
      if (d) PFH(H, p + d);                                                                               \
      const __m512i v = _mm512_loadu_si512((const void *)p);                                              \
      L128(0, a0); L128(1, a1); L128(2, a2); L128(3, a3); L128(4, a0); L128(5, a1); L128(6, a2); L128(7, a3); \
    }                                                                                                     \
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));              \
  }
ROW4(row4_t0, _MM_HINT_T0)
ROW4(row4_t1, _MM_HINT_T1)
ROW4(row4_t2, _MM_HINT_T2)
ROW4(row4_nta, _MM_HINT_NTA)

/* 8-bit as row8_512: 16-bit permutes of the fp16 table, blocks of 32, a prefetch per 64 code bytes */
#define ROW8(NAME, H)                                                                                     \
  __attribute__((target(T))) static float NAME(const uint8_t *c, const float *x, long nb, const __m512i *t, long d) { \
    const __m512i b6 = _mm512_set1_epi16(64), b7 = _mm512_set1_epi16(128);                               \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;                                                             \
    for (long b = 0; b < nb; b++) {                                                                       \
      const uint8_t *p = c + b * 32;                                                                      \
      if (d && !(b & 1)) PFH(H, p + d);                                                                   \
      __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));                           \
      __mmask32 k6 = _mm512_test_epi16_mask(v, b6), k7 = _mm512_test_epi16_mask(v, b7);                   \
      __m512i q0 = _mm512_mask_blend_epi16(k6, _mm512_permutex2var_epi16(t[0], v, t[1]),                  \
                                           _mm512_permutex2var_epi16(t[2], v, t[3]));                     \
      __m512i q1 = _mm512_mask_blend_epi16(k6, _mm512_permutex2var_epi16(t[4], v, t[5]),                  \
                                           _mm512_permutex2var_epi16(t[6], v, t[7]));                     \
      __m512i w = _mm512_mask_blend_epi16(k7, q0, q1);                                                    \
      a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(w)), _mm512_loadu_ps(x + b * 32), a0);  \
      a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1)), _mm512_loadu_ps(x + b * 32 + 16), a1); \
    }                                                                                                     \
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));                                                   \
  }
ROW8(row8_t0, _MM_HINT_T0)
ROW8(row8_t1, _MM_HINT_T1)
ROW8(row8_t2, _MM_HINT_T2)
ROW8(row8_nta, _MM_HINT_NTA)

/* 8-bit by byte permutes (VBMI), the same sums as row8_512: per 64 codes the low / high byte planes looked up by
   two vpermt2b each and a blend on bit 7, then re-interleaved into fp16 words in column order by two vpermt2b
   (not unpacks), so 16-column quarters q feed a0, a1, a0, a1 exactly as two 32-column blocks of row8_512 do */
__attribute__((target(T))) static float row8_vbmi(const uint8_t *c, const float *x, long nb64, const __m512i *lb,
                                                  const __m512i *hb, const __m512i i0, const __m512i i1, long d) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  for (long b = 0; b < nb64; b++) {
    const uint8_t *p = c + b * 64;
    if (d) PFH(_MM_HINT_T0, p + d);
    const __m512i v = _mm512_loadu_si512((const void *)p);
    const __mmask64 k7 = _mm512_movepi8_mask(v);
    const __m512i lo = _mm512_mask_blend_epi8(k7, _mm512_permutex2var_epi8(lb[0], v, lb[1]),
                                              _mm512_permutex2var_epi8(lb[2], v, lb[3]));
    const __m512i hi = _mm512_mask_blend_epi8(k7, _mm512_permutex2var_epi8(hb[0], v, hb[1]),
                                              _mm512_permutex2var_epi8(hb[2], v, hb[3]));
    const __m512i w0 = _mm512_permutex2var_epi8(lo, i0, hi), w1 = _mm512_permutex2var_epi8(lo, i1, hi);
    const float *xb = x + b * 64;
    a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(w0)), _mm512_loadu_ps(xb), a0);
    a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(w0, 1)), _mm512_loadu_ps(xb + 16), a1);
    a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(w1)), _mm512_loadu_ps(xb + 32), a0);
    a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(w1, 1)), _mm512_loadu_ps(xb + 48), a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

__attribute__((target(T))) static float readr(const uint8_t *c, long nb, long d) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0;
  for (long b = 0; b < nb; b += 2) {
    const uint8_t *p = c + b * 64;
    if (d) { PFH(_MM_HINT_T0, p + d); PFH(_MM_HINT_T0, p + d + 64); }
    a0 = _mm512_add_epi32(a0, _mm512_loadu_si512((const void *)p));
    a1 = _mm512_add_epi32(a1, _mm512_loadu_si512((const void *)(p + 64)));
  }
  return (float)_mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
}
__attribute__((target(T))) static float sumf(const uint8_t *c, long nb) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const float *f = (const float *)c;
  for (long b = 0; b < nb; b += 4) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(f + 16 * b)); a1 = _mm512_add_ps(a1, _mm512_loadu_ps(f + 16 * b + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(f + 16 * b + 32)); a3 = _mm512_add_ps(a3, _mm512_loadu_ps(f + 16 * b + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

int main(int argc, char **argv) {
  if (argc < 8) { fprintf(stderr, "usage: mb BITS K N NMAT REPS VARIANT DIST [WARM]\n"); return 1; }
  int bits = atoi(argv[1]); long K = atol(argv[2]), N = atol(argv[3]), nmat = atol(argv[4]), reps = atol(argv[5]);
  const char *var = argv[6]; long d = atol(argv[7]); int warm = argc > 8 && atoi(argv[8]);
  long rb = bits == 4 ? K / 2 : K;
  size_t per = (size_t)N * rb, tot = per * (size_t)nmat + 8192;
  uint8_t *codes = aligned_alloc(64, (tot + 63) / 64 * 64);
  for (size_t i = 0; i < tot; i++) codes[i] = (uint8_t)(i * 2654435761u >> 13);
  float *x = aligned_alloc(64, (size_t)K * 4);
  for (long i = 0; i < K; i++) x[i] = (float)((i * 37) % 101) / 101.0f;
  __m512i t8[8], lb[4], hb[4];
  for (int e = 0; e < 8; e++) t8[e] = _mm512_set1_epi16((short)(0x3c00 + 3 * e));
  uint8_t ev[64], i0b[64], i1b[64];
  for (int i = 0; i < 64; i++) ev[i] = (uint8_t)(2 * i);
  for (int i = 0; i < 32; i++) { i0b[2 * i] = (uint8_t)i; i0b[2 * i + 1] = (uint8_t)(64 + i);
                                 i1b[2 * i] = (uint8_t)(32 + i); i1b[2 * i + 1] = (uint8_t)(96 + i); }
  __m512i evv = _mm512_loadu_si512(ev), odv = _mm512_add_epi8(evv, _mm512_set1_epi8(1));
  __m512i i0 = _mm512_loadu_si512(i0b), i1 = _mm512_loadu_si512(i1b);
  for (int i = 0; i < 4; i++) { lb[i] = _mm512_permutex2var_epi8(t8[2 * i], evv, t8[2 * i + 1]);
                                hb[i] = _mm512_permutex2var_epi8(t8[2 * i], odv, t8[2 * i + 1]); }
  const __m512 tab = _mm512_set_ps(16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1);
  volatile float sink = 0;
  double best = 1e9;
  for (long r = 0; r < reps; r++) {
    double t0 = now();
    for (long m = 0; m < nmat; m++) {
      const uint8_t *cm = codes + (warm ? 0 : (size_t)m * per);
      float acc = 0;
      if (var[0] == 'r') { acc += readr(cm, (long)(per / 64), d); }
      else if (var[0] == 's') { acc += sumf(cm, (long)(per / 64)); }
      else for (long n = 0; n < N; n++) {
        const uint8_t *cn = cm + n * rb;
        if (bits == 4) {
          long nb = K / 128;
          switch (var[1]) {
            case '0': acc += row4_t0(cn, x, nb, tab, d); break;
            case '1': acc += row4_t1(cn, x, nb, tab, d); break;
            case '2': acc += row4_t2(cn, x, nb, tab, d); break;
            case 'n': acc += row4_nta(cn, x, nb, tab, d); break;
            case 'r': /* next row's lines first, then the in-row stream at 4096 */
              for (long l = 0; l < d; l++) PFH(_MM_HINT_T0, cn + rb + 64 * l);
              acc += row4_t0(cn, x, nb, tab, 4096); break;
          }
        } else {
          switch (var[1]) {
            case '0': acc += row8_t0(cn, x, K / 32, t8, d); break;
            case '1': acc += row8_t1(cn, x, K / 32, t8, d); break;
            case '2': acc += row8_t2(cn, x, K / 32, t8, d); break;
            case 'n': acc += row8_nta(cn, x, K / 32, t8, d); break;
            case 'v': acc += row8_vbmi(cn, x, K / 64, lb, hb, i0, i1, d); break;
          }
        }
      }
      sink += acc;
    }
    double dt = now() - t0;
    if (dt < best) best = dt;
  }
  printf("%s bits=%d K=%ld N=%ld nmat=%ld warm=%d dist=%ld: %.2f GB/s\n", var, bits, K, N, nmat, warm, d,
         (double)nmat * per / best / 1e9);
  return 0;
}
