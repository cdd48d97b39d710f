/* The AVX-512 paths of the host GEMV (avx512, avx512vbmi, avx512fp16). codebook_host.c has the design, the
   contracts and the path choice; codebook_host.h the work item. */
#include "codebook_host.h"

#if TP_X86
/* ---------------------------------------------------------------- AVX-512 path */
#define T512 "avx512f,avx512bw,avx512vl,avx2,fma,f16c"

/* 4-bit, the row's first K / 128 blocks of 128 columns = 64 code bytes, one load each: dword i of the load holds
   columns 8i .. 8i + 7 (nibble s: column 8i + s); shifted right by 4s it has column 8i + s in index bits 3:0, the
   only bits vpermps reads, so xp[128b + 16s + i] = x[128b + 8i + s] and vector s feeds accumulator s % 4.
   Per 128 codes: 1 load, 7 shifts, 8 vpermps, 8 FMAs (in 32-column steps: 4 vpmovzxbd, 4 shifts, 8 vpermps).
   The remaining K % 128 columns in blocks of 32 (STEP4_512): 16 code bytes widened to dwords;
   xp[32b + i] = x[32b + 2i], xp[32b + 16 + i] = x[32b + 2i + 1]; even blocks into a0/a1, odd blocks into a2/a3. */
#define L128_512(S, A)                                                                              \
  do {                                                                                              \
    const __m512 w = _mm512_permutexvar_ps((S) ? _mm512_srli_epi32(v, 4 * (S)) : v, tab);           \
    for (int r = 0; r < R; r++)                                                                     \
      A[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(j->xp + (m0 + r) * j->Kp + b * 128 + 16 * (S)), A[r]); \
  } while (0)
#define STEP4_512(B, A, C)                                                                          \
  do {                                                                                              \
    const uint8_t *p = c + (B) * 16;                                                                \
    if (!((B) & PF_MASK4)) _mm_prefetch((const char *)p + PF, _MM_HINT_T0);                         \
    if ((B) >= full) { memset(tail, 0, 16); memcpy(tail, p, (j->K + 1) / 2 - (B) * 16); p = tail; } \
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));                          \
    __m512 w0 = _mm512_permutexvar_ps(v, tab); /* vpermps reads index bits 3:0: the low nibble */                              \
    __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tab);                                \
    for (int r = 0; r < R; r++) {                                                                   \
      const float *x = j->xp + (m0 + r) * j->Kp + (B) * 32;                                         \
      A[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), A[r]);                                         \
      C[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), C[r]);                                    \
    }                                                                                               \
  } while (0)

__attribute__((target(T512), always_inline)) static inline void row4_512(const job_t *j, long n, long m0, int R,
                                                                        const __m512 tab) {
  const uint8_t *c = j->codes + n * j->ldc;
  const long nb = j->Kp / 32, full = j->K / 32;
  __m512 a0[4], a1[4], a2[4], a3[4];
  for (int r = 0; r < R; r++) a0[r] = a1[r] = a2[r] = a3[r] = _mm512_setzero_ps();
  uint8_t tail[16];
  const long nb128 = j->K / 128;
  for (long b = 0; b < nb128; b++) {
    const uint8_t *p = c + b * 64;
    _mm_prefetch((const char *)p + PF, _MM_HINT_T1);  /* into L2: x stays in L1 (PF note above) */
    const __m512i v = _mm512_loadu_si512((const void *)p);
    L128_512(0, a0); L128_512(1, a1); L128_512(2, a2); L128_512(3, a3);
    L128_512(4, a0); L128_512(5, a1); L128_512(6, a2); L128_512(7, a3);
  }
  long b = 4 * nb128;
  for (; b + 1 < nb; b += 2) { STEP4_512(b, a0, a1); STEP4_512(b + 1, a2, a3); }
  if (b < nb) STEP4_512(b, a0, a1);
  for (int r = 0; r < R; r++)
    j->y[(m0 + r) * j->ldy + n] =
        _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[r], a1[r]), _mm512_add_ps(a2[r], a3[r])));
}

/* 8-bit: blocks of 32 columns; the row's 256 fp16 entries (as stored) in 8 registers, looked up by 4 two-table
   16-bit permutes (index bits 0..5) and a blend tree on bits 6, 7, then widened to fp32 (no gather: slow where
   microcode mitigates it); even / odd 16-column halves into a0 / a1 */
/* blocks b0 .. of 32 columns into a0 / a1, then the row's outputs */
__attribute__((target(T512), always_inline)) static inline void row8_512_from(const job_t *j, long n, long m0, int R,
                                                                             const __m512i *t, long b0, __m512 *a0,
                                                                             __m512 *a1) {
  const uint8_t *c = j->codes + n * j->ldc;
  const long nb = j->Kp / 32, full = j->K / 32;
  const __m512i b6 = _mm512_set1_epi16(64), b7 = _mm512_set1_epi16(128);
  uint8_t tail[32];
  for (long b = b0; b < nb; b++) {
    const uint8_t *p = c + b * 32;
    if (!(b & PF_MASK8)) _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
    if (b >= full) { memset(tail, 0, 32); memcpy(tail, p, j->K - b * 32); p = tail; }
    __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    __mmask32 k6 = _mm512_test_epi16_mask(v, b6), k7 = _mm512_test_epi16_mask(v, b7);
    __m512i q0 = _mm512_mask_blend_epi16(k6, _mm512_permutex2var_epi16(t[0], v, t[1]),
                                         _mm512_permutex2var_epi16(t[2], v, t[3]));
    __m512i q1 = _mm512_mask_blend_epi16(k6, _mm512_permutex2var_epi16(t[4], v, t[5]),
                                         _mm512_permutex2var_epi16(t[6], v, t[7]));
    __m512i w = _mm512_mask_blend_epi16(k7, q0, q1);
    __m512 w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(w)), w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
    for (int r = 0; r < R; r++) {
      const float *x = j->xp + (m0 + r) * j->Kp + b * 32;
      a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), a0[r]);
      a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), a1[r]);
    }
  }
  for (int r = 0; r < R; r++) j->y[(m0 + r) * j->ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}

__attribute__((target(T512), always_inline)) static inline void row8_512(const job_t *j, long n, long m0, int R,
                                                                        const __m512i *t) {
  __m512 a0[4], a1[4];
  for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
  row8_512_from(j, n, m0, R, t, 0, a0, a1);
}

#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* the group's fp32 table into gt (when row n leaves the group *g holds) and row n's scale, broadcast */
__attribute__((target(T512), always_inline)) static inline __m512 group_512(const job_t *j, long n, float *gt,
                                                                           long *g) {
  const int ne = 1 << j->bits;
  if (n / j->G != *g) {
    *g = n / j->G;
    for (int e = 0; e < ne; e += 16)
      _mm512_store_ps(gt + e, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(j->cb + *g * ne + e))));
  }
  return _mm512_set1_ps(h2f(j->scale[n]));
}

/* row n's 8-bit table, 256 fp16 in 8 registers: loaded as stored or (shared storage) formed from the group's fp32
   table gt: fp16(scale * gt) (RNE) */
__attribute__((target(T512), always_inline)) static inline void table8_512(const job_t *j, long n, float *gt, long *g,
                                                                          __m512i *t) {
  if (j->scale) {
    __m512 s = group_512(j, n, gt, g);
    for (int e = 0; e < 8; e++)
      t[e] = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm512_cvtps_ph(_mm512_mul_ps(s, _mm512_load_ps(gt + 32 * e)), RNE)),
          _mm512_cvtps_ph(_mm512_mul_ps(s, _mm512_load_ps(gt + 32 * e + 16)), RNE), 1);
  } else {
    const uint16_t *cbn = j->cb + n * 256;
    for (int e = 0; e < 8; e++) t[e] = _mm512_loadu_si512((const void *)(cbn + 32 * e));
    for (int e = 0; e < 8; e++) _mm_prefetch((const char *)(cbn + 4 * 256 + 32 * e), _MM_HINT_T0);
  }
}

/* row n's 4-bit table, 16 fp32 in one register: widened as stored or (shared storage) fp16(scale * gt) (RNE) */
__attribute__((target(T512), always_inline)) static inline __m512 table4_512(const job_t *j, long n, float *gt,
                                                                            long *g) {
  if (j->scale) {
    __m512 s = group_512(j, n, gt, g);
    return _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_mul_ps(s, _mm512_load_ps(gt)), RNE));
  }
  _mm_prefetch((const char *)(j->cb + (n + 16) * 16), _MM_HINT_T0);
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(j->cb + n * 16)));
}

/* 4-bit with one row of x (the decode step's GEMVs): rows_512's arithmetic in a function of its own, so that the
   row loop keeps its state in registers (inside rows_512, beside the 4-row cases, it spilled to the stack: +15-20%
   GB/s warm on Zen 4, scripts/dev/s14_lib_mb.c) */
__attribute__((target(T512), noinline)) static void rows4_512_m1(const job_t *j, long n0, long n1) {
  float gt[256] __attribute__((aligned(64)));
  long g = -1;
  for (long n = n0; n < n1; n++) row4_512(j, n, 0, 1, table4_512(j, n, gt, &g));
}

/* per row: its table in registers (4-bit: 16 fp32 in one; 8-bit: 256 fp16 in 8), loaded as stored or (shared
   storage) formed from the group's fp32 table gt: fp16(scale * gt) (RNE) */
__attribute__((target(T512))) void tp_rows_512(const job_t *j, long n0, long n1) {
  float gt[256] __attribute__((aligned(64)));
  long g = -1;
  if (j->bits == 4 && j->M == 1) { rows4_512_m1(j, n0, n1); return; }
  for (long n = n0; n < n1; n++) {
    if (j->bits == 4) {
      const __m512 tab = table4_512(j, n, gt, &g);
      for (long m = 0; m < j->M; m += 4) {
        long R = j->M - m < 4 ? j->M - m : 4;
        switch (R) { case 4: row4_512(j, n, m, 4, tab); break; case 3: row4_512(j, n, m, 3, tab); break;
                     case 2: row4_512(j, n, m, 2, tab); break; default: row4_512(j, n, m, 1, tab); }
      }
    } else {
      __m512i t[8];
      table8_512(j, n, gt, &g, t);
      for (long m = 0; m < j->M; m += 4) {
        long R = j->M - m < 4 ? j->M - m : 4;
        switch (R) { case 4: row8_512(j, n, m, 4, t); break; case 3: row8_512(j, n, m, 3, t); break;
                     case 2: row8_512(j, n, m, 2, t); break; default: row8_512(j, n, m, 1, t); }
      }
    }
  }
}
/* ---------------------------------------------------------------- the 8-bit byte-plane lookup (avx512vbmi, avx512fp16) */
/* Zen 4, Ice Lake and later (VBMI); Sapphire Rapids and later also with FP16. 8-bit: blocks of 64 columns looked up
   as bytes: the row's 256 fp16 entries split once into low- and high-byte planes (4 + 4 registers of 64 bytes,
   planes8), each looked up by two 128-entry byte permutes (vpermt2b on index bits 0..6) and a blend on bit 7, the
   planes interleaved back into fp16 words by two unpacks and widened. The unpacks leave 128-bit lane j of word
   vector h holding columns 16j + 8h + 0..7, so x is prepared in that order (xorder64; K padded to a multiple of 64,
   the row's partial last block copied into a zeroed local block) and the four fp32 quarters q = 2h + half feed four
   accumulators: per 64 columns 4 byte permutes, 2 blends, 1 mask, 2 unpacks, 2 extracts, 4 widenings, 4 FMAs.
   Both paths give the same bits (their tables are bitwise the same: the header's fp16(scale * shared), formed by
   fp32 multiplies and vcvtps2ph on avx512vbmi, by vmulph on avx512fp16). Until session 14's second part avx512vbmi
   put the planes back by two vpermt2b in row8_512's column order (avx512's bits); the unpacks ran the Qwen head
   (151,936 x 896, shared tables) 8-10% faster on Zen 4 (scripts/dev/s14_head8_probe.py). */
#define TVBMI T512 ",avx512vbmi"

__attribute__((target(TVBMI), always_inline)) static inline void row8_bytes(const job_t *j, long n, long m0, int R,
                                                                           const __m512i *lb, const __m512i *hb) {
  const uint8_t *c = j->codes + n * j->ldc;
  const long nb = j->Kp / 64, full = j->K / 64;
  __m512 a[4][4];
  for (int r = 0; r < R; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm512_setzero_ps();
  uint8_t tail[64];
  for (long b = 0; b < nb; b++) {
    const uint8_t *p = c + b * 64;
    _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
    if (b >= full) { memset(tail, 0, 64); memcpy(tail, p, j->K - b * 64); p = tail; }
    const __m512i v = _mm512_loadu_si512((const void *)p);
    const __mmask64 k7 = _mm512_movepi8_mask(v);
    const __m512i lo = _mm512_mask_blend_epi8(k7, _mm512_permutex2var_epi8(lb[0], v, lb[1]),
                                              _mm512_permutex2var_epi8(lb[2], v, lb[3]));
    const __m512i hi = _mm512_mask_blend_epi8(k7, _mm512_permutex2var_epi8(hb[0], v, hb[1]),
                                              _mm512_permutex2var_epi8(hb[2], v, hb[3]));
    const __m512i w0 = _mm512_unpacklo_epi8(lo, hi), w1 = _mm512_unpackhi_epi8(lo, hi);
    const __m512 f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(w0)), f1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w0, 1));
    const __m512 f2 = _mm512_cvtph_ps(_mm512_castsi512_si256(w1)), f3 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w1, 1));
    for (int r = 0; r < R; r++) {
      const float *x = j->xp + (m0 + r) * j->Kp + b * 64;
      a[r][0] = _mm512_fmadd_ps(f0, _mm512_loadu_ps(x), a[r][0]);
      a[r][1] = _mm512_fmadd_ps(f1, _mm512_loadu_ps(x + 16), a[r][1]);
      a[r][2] = _mm512_fmadd_ps(f2, _mm512_loadu_ps(x + 32), a[r][2]);
      a[r][3] = _mm512_fmadd_ps(f3, _mm512_loadu_ps(x + 48), a[r][3]);
    }
  }
  for (int r = 0; r < R; r++)
    j->y[(m0 + r) * j->ldy + n] =
        _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3])));
}

/* a row's 256 fp16 entries t[8] (32 a register) split into their low- and high-byte planes lb[4], hb[4] */
__attribute__((target(TVBMI), always_inline)) static inline void planes8(const __m512i *t, __m512i *lb, __m512i *hb) {
  const __m512i ev = _mm512_set_epi8(126, 124, 122, 120, 118, 116, 114, 112, 110, 108, 106, 104, 102, 100, 98, 96,
                                     94, 92, 90, 88, 86, 84, 82, 80, 78, 76, 74, 72, 70, 68, 66, 64, 62, 60, 58, 56,
                                     54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26, 24, 22, 20, 18, 16,
                                     14, 12, 10, 8, 6, 4, 2, 0);  /* the low bytes of 64 words */
  const __m512i od = _mm512_add_epi8(ev, _mm512_set1_epi8(1));
  for (int i = 0; i < 4; i++) {
    lb[i] = _mm512_permutex2var_epi8(t[2 * i], ev, t[2 * i + 1]);
    hb[i] = _mm512_permutex2var_epi8(t[2 * i], od, t[2 * i + 1]);
  }
}

__attribute__((target(TVBMI), always_inline)) static inline void rows8_bytes(const job_t *j, long n, const __m512i *t) {
  __m512i lb[4], hb[4];
  planes8(t, lb, hb);
  for (long m = 0; m < j->M; m += 4) {
    long R = j->M - m < 4 ? j->M - m : 4;
    switch (R) { case 4: row8_bytes(j, n, m, 4, lb, hb); break; case 3: row8_bytes(j, n, m, 3, lb, hb); break;
                 case 2: row8_bytes(j, n, m, 2, lb, hb); break; default: row8_bytes(j, n, m, 1, lb, hb); }
  }
}

/* path avx512vbmi: 4-bit as avx512; 8-bit: the row's table by table8_512 (fp32 products, vcvtps2ph), looked up as
   bytes */
__attribute__((target(TVBMI))) void tp_rows_vbmi(const job_t *j, long n0, long n1) {
  if (j->bits == 4) { tp_rows_512(j, n0, n1); return; }
  float gt[256] __attribute__((aligned(64)));
  long g = -1;
  for (long n = n0; n < n1; n++) {
    __m512i t[8];
    table8_512(j, n, gt, &g, t);
    rows8_bytes(j, n, t);
  }
}

/* ---------------------------------------------------------------- AVX-512 with FP16 and VBMI (path avx512fp16) */
/* Sapphire Rapids and later. The shared storage's tables formed by fp16 multiplies: vmulph rounds the exact
   product once to nearest even (FP16 arithmetic ignores MXCSR's FTZ / DAZ), the bits of the fp32 product rounded
   by vcvtps2ph. 8-bit: the byte-plane lookup above (row8_bytes). */
#define TSPR TVBMI ",avx512fp16"

__attribute__((target(TSPR))) void tp_rows_spr(const job_t *j, long n0, long n1) {
  for (long n = n0; n < n1; n++) {
    const uint16_t *sh = j->scale ? j->cb + (n / j->G) * (1 << j->bits) : j->cb + n * (1 << j->bits);
    if (j->bits == 4) {
      __m256i h = _mm256_loadu_si256((const __m256i *)sh);
      if (j->scale)
        h = _mm512_castsi512_si256(_mm512_castph_si512(_mm512_mul_round_ph(  /* the low 16 lanes */
            _mm512_castsi512_ph(_mm512_castsi256_si512(h)), _mm512_castsi512_ph(_mm512_set1_epi16((short)j->scale[n])),
            RNE)));
      else
        _mm_prefetch((const char *)(sh + 16 * 16), _MM_HINT_T0);
      const __m512 tab = _mm512_cvtph_ps(h);
      for (long m = 0; m < j->M; m += 4) {
        long R = j->M - m < 4 ? j->M - m : 4;
        switch (R) { case 4: row4_512(j, n, m, 4, tab); break; case 3: row4_512(j, n, m, 3, tab); break;
                     case 2: row4_512(j, n, m, 2, tab); break; default: row4_512(j, n, m, 1, tab); }
      }
      continue;
    }
    __m512i t[8];
    const __m512h sv = _mm512_castsi512_ph(_mm512_set1_epi16(j->scale ? (short)j->scale[n] : 0));
    for (int e = 0; e < 8; e++) {
      t[e] = _mm512_loadu_si512((const void *)(sh + 32 * e));
      if (j->scale) t[e] = _mm512_castph_si512(_mm512_mul_round_ph(_mm512_castsi512_ph(t[e]), sv, RNE));
    }
    if (!j->scale)
      for (int e = 0; e < 8; e++) _mm_prefetch((const char *)(sh + 4 * 256 + 32 * e), _MM_HINT_T0);
    rows8_bytes(j, n, t);
  }
}
#endif
