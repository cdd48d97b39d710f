/* Session 14: what bounds the 4-bit AVX-512 row kernel (row4_512, blocks of 128 columns) on this CPU: variants that
   drop parts of it, warm (one matrix repeated) or cold (NMAT matrices in turn).
     gcc -O3 -march=native -ffp-contract=off scripts/dev/s14_gemv4_ceil.c -o /tmp/ceil; /tmp/ceil K N NMAT REPS WARM
   A production form; N no vpermps (the shifted codes used as floats); P vpermps only (xor-accumulated, no FMA);
   F FMAs only (on one loaded vector); G two rows at once (each row's sums as A's); H vpshufb byte-plane lookup of
   the 16-entry table (not the same sums: a speed probe only); I A with the row loop unrolled by 2 rows (G without
   sharing the x loads); session 16: M six of A's seven shifts as vpmulhuw (A's indices exactly), L as M with the high
   word by a load at byte offset 2, R A with x held in registers (wrong sums: the x loads' cost). Prints GB/s of
   codes, best of REPS. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define T "avx512f,avx512bw,avx512vl,avx2,fma,f16c,avx512vbmi"
#define PF 4096
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define SH(S) ((S) ? _mm512_srli_epi32(v, 4 * (S)) : v)
#define XL(S) _mm512_loadu_ps(x + b * 128 + 16 * (S))
#define RED(a0, a1, a2, a3) _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)))

#define LA(S, A) A = _mm512_fmadd_ps(_mm512_permutexvar_ps(SH(S), tab), XL(S), A)
__attribute__((target(T))) static float rowA(const uint8_t *c, const float *x, long nb, __m512 tab) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (long b = 0; b < nb; b++) {
    const uint8_t *p = c + b * 64; _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(p);
    LA(0, a0); LA(1, a1); LA(2, a2); LA(3, a3); LA(4, a0); LA(5, a1); LA(6, a2); LA(7, a3);
  }
  return RED(a0, a1, a2, a3);
}
#define LN(S, A) A = _mm512_fmadd_ps(_mm512_castsi512_ps(SH(S)), XL(S), A)
__attribute__((target(T))) static float rowN(const uint8_t *c, const float *x, long nb, __m512 tab) {
  __m512 a0 = tab, a1 = a0, a2 = a0, a3 = a0;
  for (long b = 0; b < nb; b++) {
    const uint8_t *p = c + b * 64; _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(p);
    LN(0, a0); LN(1, a1); LN(2, a2); LN(3, a3); LN(4, a0); LN(5, a1); LN(6, a2); LN(7, a3);
  }
  return RED(a0, a1, a2, a3);
}
#define LP(S, A) A = _mm512_xor_si512(_mm512_castps_si512(_mm512_permutexvar_ps(SH(S), tab)), A)
__attribute__((target(T))) static float rowP(const uint8_t *c, const float *x, long nb, __m512 tab) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0; (void)x;
  for (long b = 0; b < nb; b++) {
    const uint8_t *p = c + b * 64; _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(p);
    LP(0, a0); LP(1, a1); LP(2, a2); LP(3, a3); LP(4, a0); LP(5, a1); LP(6, a2); LP(7, a3);
  }
  return (float)_mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
}
#define LF(S, A) A = _mm512_fmadd_ps(w, XL(S), A)
__attribute__((target(T))) static float rowF(const uint8_t *c, const float *x, long nb, __m512 tab) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0; (void)tab;
  for (long b = 0; b < nb; b++) {
    const uint8_t *p = c + b * 64; _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
    const __m512 w = _mm512_loadu_ps((const float *)p);
    LF(0, a0); LF(1, a1); LF(2, a2); LF(3, a3); LF(4, a0); LF(5, a1); LF(6, a2); LF(7, a3);
  }
  return RED(a0, a1, a2, a3);
}
#define LG(S, A, B) do { const __m512 xs = XL(S); A = _mm512_fmadd_ps(_mm512_permutexvar_ps(SH(S), tab), xs, A); \
                         B = _mm512_fmadd_ps(_mm512_permutexvar_ps(SH2(S), tab2), xs, B); } while (0)
#define SH2(S) ((S) ? _mm512_srli_epi32(u, 4 * (S)) : u)
__attribute__((target(T))) static void rowG(const uint8_t *c, const uint8_t *c2, const float *x, long nb, __m512 tab,
                                            __m512 tab2, float *o) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (long b = 0; b < nb; b++) {
    const uint8_t *p = c + b * 64, *q = c2 + b * 64;
    _mm_prefetch((const char *)p + PF, _MM_HINT_T0); _mm_prefetch((const char *)q + PF, _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(p), u = _mm512_loadu_si512(q);
    LG(0, a0, b0); LG(1, a1, b1); LG(2, a2, b2); LG(3, a3, b3); LG(4, a0, b0); LG(5, a1, b1); LG(6, a2, b2); LG(7, a3, b3);
  }
  o[0] = RED(a0, a1, a2, a3); o[1] = RED(b0, b1, b2, b3);
}
/* C: offset loads: the dwords at byte offsets 1, 2, 3 hold columns 8i + 2o in bits 3:0, so 4 loads and 4 shifts
   give A's 8 index vectors (A's sums, bit for bit; reads 3 bytes past the row) */
__attribute__((target(T))) static float rowC(const uint8_t *c, const float *x, long nb, __m512 tab) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (long b = 0; b < nb; b++) {
    const uint8_t *p = c + b * 64; _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
    const __m512i v0 = _mm512_loadu_si512(p), v1 = _mm512_loadu_si512(p + 1), v2 = _mm512_loadu_si512(p + 2),
                  v3 = _mm512_loadu_si512(p + 3);
#define LC(V, S, A) A = _mm512_fmadd_ps(_mm512_permutexvar_ps(V, tab), XL(S), A)
    LC(v0, 0, a0); LC(_mm512_srli_epi32(v0, 4), 1, a1); LC(v1, 2, a2); LC(_mm512_srli_epi32(v1, 4), 3, a3);
    LC(v2, 4, a0); LC(_mm512_srli_epi32(v2, 4), 5, a1); LC(v3, 6, a2); LC(_mm512_srli_epi32(v3, 4), 7, a3);
  }
  return RED(a0, a1, a2, a3);
}
/* H: vpshufb probe: 4 byte planes of the fp32 table, 64 nibbles a step as bytes, 8 unpacks to 4 fp32 vectors */
__attribute__((target(T))) static float rowH(const uint8_t *c, const float *x, long nb, const __m512i *pl) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const __m512i m4 = _mm512_set1_epi8(15);
  for (long b = 0; b < nb; b++) {
    const uint8_t *p = c + b * 64; _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(p);
    for (int h = 0; h < 2; h++) {
      const __m512i i = h ? _mm512_and_si512(_mm512_srli_epi16(v, 4), m4) : _mm512_and_si512(v, m4);
      const __m512i b0 = _mm512_shuffle_epi8(pl[0], i), b1 = _mm512_shuffle_epi8(pl[1], i);
      const __m512i b2 = _mm512_shuffle_epi8(pl[2], i), b3 = _mm512_shuffle_epi8(pl[3], i);
      const __m512i l01 = _mm512_unpacklo_epi8(b0, b1), h01 = _mm512_unpackhi_epi8(b0, b1);
      const __m512i l23 = _mm512_unpacklo_epi8(b2, b3), h23 = _mm512_unpackhi_epi8(b2, b3);
      const float *xb = x + b * 128 + 64 * h;
      a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(l01, l23)), _mm512_loadu_ps(xb), a0);
      a1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(l01, l23)), _mm512_loadu_ps(xb + 16), a1);
      a2 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(h01, h23)), _mm512_loadu_ps(xb + 32), a2);
      a3 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(h01, h23)), _mm512_loadu_ps(xb + 48), a3);
    }
  }
  return RED(a0, a1, a2, a3);
}


/* M: A's index vectors with 6 of the 7 shifts done as vpmulhuw by 2^(16-4s) (word-wise: the dword's bits 3:0 are
   then the low word's bits 4s+3..4s) and one 16-bit dword shift for the high word: A's indices exactly */
#define MH(V, S) _mm512_mulhi_epu16(V, _mm512_set1_epi16((short)(1 << (16 - 4 * (S)))))
#define LM(I, S, A) A = _mm512_fmadd_ps(_mm512_permutexvar_ps(I, tab), XL(S), A)
__attribute__((target(T))) static float rowM(const uint8_t *c, const float *x, long nb, __m512 tab) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (long b = 0; b < nb; b++) {
    const uint8_t *p = c + b * 64; _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(p), h = _mm512_srli_epi32(v, 16);
    LM(v, 0, a0); LM(MH(v, 1), 1, a1); LM(MH(v, 2), 2, a2); LM(MH(v, 3), 3, a3);
    LM(h, 4, a0); LM(MH(h, 1), 5, a1); LM(MH(h, 2), 6, a2); LM(MH(h, 3), 7, a3);
  }
  return RED(a0, a1, a2, a3);
}
/* L: as M but the high word by a load at byte offset 2 (no shift at all; line-crossing load) */
__attribute__((target(T))) static float rowL(const uint8_t *c, const float *x, long nb, __m512 tab) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (long b = 0; b < nb; b++) {
    const uint8_t *p = c + b * 64; _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(p), h = _mm512_loadu_si512(p + 2);
    LM(v, 0, a0); LM(MH(v, 1), 1, a1); LM(MH(v, 2), 2, a2); LM(MH(v, 3), 3, a3);
    LM(h, 4, a0); LM(MH(h, 1), 5, a1); LM(MH(h, 2), 6, a2); LM(MH(h, 3), 7, a3);
  }
  return RED(a0, a1, a2, a3);
}

/* R: A with x held in 8 registers (the first block's x for every block: wrong sums, a probe of the x loads' cost) */
__attribute__((target(T))) static float rowR(const uint8_t *c, const float *x, long nb, __m512 tab) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16), x2 = _mm512_loadu_ps(x + 32), x3 = _mm512_loadu_ps(x + 48),
               x4 = _mm512_loadu_ps(x + 64), x5 = _mm512_loadu_ps(x + 80), x6 = _mm512_loadu_ps(x + 96), x7 = _mm512_loadu_ps(x + 112);
  for (long b = 0; b < nb; b++) {
    const uint8_t *p = c + b * 64; _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(p);
#define LR(S, X, A) A = _mm512_fmadd_ps(_mm512_permutexvar_ps(SH(S), tab), X, A)
    LR(0, x0, a0); LR(1, x1, a1); LR(2, x2, a2); LR(3, x3, a3); LR(4, x4, a0); LR(5, x5, a1); LR(6, x6, a2); LR(7, x7, a3);
  }
  return RED(a0, a1, a2, a3);
}

int main(int argc, char **argv) {
  long K = atol(argv[1]), N = atol(argv[2]), nmat = atol(argv[3]), reps = atol(argv[4]); int warm = atoi(argv[5]);
  const char *only = argc > 6 ? argv[6] : "ACNPFGHIMLR";
  _mm_setcsr(_mm_getcsr() | 0x8040); /* FTZ / DAZ: the probes N and F read raw bytes as floats */
  { /* clock probe: a chain of 1-cycle integer adds */
    double t0 = now(); unsigned long z = 1;
    for (long i = 0; i < 400000000; i++) __asm__ volatile("add $1, %0" : "+r"(z));
    printf("clock ~%.2f GHz (%lu)\n", 0.4 / (now() - t0), z);
  }
  long rb = K / 2, nb = K / 128; size_t per = (size_t)N * rb, tot = per * nmat + 8192;
  uint8_t *codes = aligned_alloc(64, (tot + 63) / 64 * 64);
  for (size_t i = 0; i < tot; i++) codes[i] = (uint8_t)(i * 2654435761u >> 13);
  float *x = aligned_alloc(64, K * 4); for (long i = 0; i < K; i++) x[i] = (float)((i * 37) % 101) / 101.0f;
  const __m512 tab = _mm512_set_ps(16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1);
  __m512i pl[4]; for (int i = 0; i < 4; i++) pl[i] = _mm512_set1_epi8((char)(i * 17));
  float *y = malloc(N * 8);
  for (const char *v = only; *v; v++) {
    double best = 1e9;
    for (long r = 0; r < reps; r++) {
      double t0 = now();
      for (long m = 0; m < nmat; m++) {
        const uint8_t *cm = codes + (warm ? 0 : per * m);
        if (*v == 'G') { for (long n = 0; n + 1 < N; n += 2) rowG(cm + n * rb, cm + (n + 1) * rb, x, nb, tab, tab, y + n); continue; }
        if (*v == 'I') { for (long n = 0; n + 1 < N; n += 2) { y[n] = rowA(cm + n * rb, x, nb, tab); y[n + 1] = rowA(cm + (n + 1) * rb, x, nb, tab); } continue; }
        for (long n = 0; n < N; n++) {
          const uint8_t *cn = cm + n * rb;
          y[n] = *v == 'A' ? rowA(cn, x, nb, tab) : *v == 'N' ? rowN(cn, x, nb, tab) : *v == 'P' ? rowP(cn, x, nb, tab)
               : *v == 'F' ? rowF(cn, x, nb, tab) : *v == 'C' ? rowC(cn, x, nb, tab) : *v == 'M' ? rowM(cn, x, nb, tab) : *v == 'R' ? rowR(cn, x, nb, tab) : *v == 'L' ? rowL(cn, x, nb, tab) : rowH(cn, x, nb, pl);
        }
      }
      double dt = now() - t0; if (dt < best) best = dt;
    }
    printf("%c K=%ld N=%ld nmat=%ld warm=%d: %.2f GB/s (y0 %g)\n", *v, K, N, nmat, warm, (double)nmat * per / best / 1e9, y[0]);
  }
  return 0;
}
