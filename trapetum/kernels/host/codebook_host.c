/* Host (CPU) GEMV of per-row scalar codebooks, decoding the stored codes in place (kernels/host_gemv.py).

   y[m, n] = sum_k x[m, k] * cb[n, idx(n, k)]      x fp32 [M, K] (row stride ldx), y fp32 [M, N] (stride ldy)
   codes: the canonical packing of kernels/pack.py, read where they lie (no copy, no dense weight):
     4-bit  uint8 [N, ldc >= ceil(K/2)]  column 2j in the low nibble of byte j, 2j+1 in the high nibble
     8-bit  uint8 [N, ldc >= K]          one index per byte
   cb: the fp16 tables (uint16 bits, 16 or 256 entries a row), in one of the two storages of a .cbk
     per-row   (scale NULL)  cb [N, 2^bits]: row n's table, converted exactly to fp32;
     shared    (scale given) cb [ceil(N / G), 2^bits] the groups' tables and scale fp16 [N]: row n's table is
               fp16(float32(scale[n]) * float32(cb[n / G, e])), formed on the fly (the fp32 product of two fp16
               values is exact; one round to nearest even: F16C / AVX-512 vcvtps2ph, f2h in C), bitwise the
               table that schemes/codebook_store.py decode_shared gives, so a row's result is bitwise the per-row
               storage's on the decoded tables; the per-row tables are never read from memory (the 8-bit head
               of a 151,936-token vocabulary: 78 MB a token less).

   Contracts (tests/test_host_gemv.py):
   - batch invariance: row m of y is bitwise what a call with x[m] alone gives, for every M: each output is one
     fixed sequence of fp32 FMAs / adds that depends only on (n, K, the code path), never on M or on the thread
     count; rows of x are processed in register groups of up to 4, every group member running the same sequence;
   - threads: chunks of output rows are claimed by the caller and up to `threads` - 1 pool workers
     (host/host_pool.c); each element is computed by one thread in a fixed order: results are identical for
     every thread count, every schedule and run to run;
   - code paths: AVX-512 with FP16 and VBMI (avx512fp16: 4-bit as avx512; 8-bit: byte permutes of the table's
     low / high byte planes, row8_bytes), AVX-512 with VBMI (avx512vbmi: 4-bit avx512's results bit for bit, 8-bit
     avx512fp16's: the same byte lookup on the same tables), AVX-512 (4-bit: the 16-entry table in one register, vpermps;
     8-bit: 16-bit permutes of the fp16 table), AVX2 (4-bit: two 8-entry halves, vpermps + blend; 8-bit:
     gathers), portable C, chosen at run time from the CPU (tp_path); results differ between paths only in
     rounding; on each path the two table storages give the same bits.
   x is copied once per call into a zero-padded buffer, permuted per block so that the low / high nibbles of
   consecutive code bytes meet consecutive x entries (AVX2: blocks of 16 columns, AVX-512: 128 by nibble
   position, then 32; row4_512); a row's
   last partial block of codes is copied into a zeroed local block (padding indices multiply x's zeros).
   Build: gcc -O3 -shared -fPIC -pthread -ffp-contract=off (no FMA contraction outside the intrinsics). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TP_X86 1
#else
#define TP_X86 0
#endif

/* ---------------------------------------------------------------- fp16 -> fp32 (exact, portable) */
static float h2f(uint16_t h) {
  uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
  if (e == 0) {
    if (m == 0) { u = s; }
    else { /* subnormal: normalise */
      e = 127 - 15 + 1;
      while (!(m & 0x400)) { m <<= 1; e--; }
      u = s | (e << 23) | ((m & 0x3ff) << 13);
    }
  } else if (e == 31) { u = s | 0x7f800000u | (m << 13); }
  else { u = s | ((e + 127 - 15) << 23) | (m << 13); }
  float f; memcpy(&f, &u, 4); return f;
}

/* fp32 -> fp16, round to nearest even (overflow to inf; the finite inputs of the shared tables), portable:
   F. Giesen's float_to_half_fast3_rtne (its subnormal branch rounds by one fp32 add in the default mode) */
static uint16_t f2h(float f) {
  uint32_t u, sign;
  memcpy(&u, &f, 4);
  sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u >= (143u << 23)) return (uint16_t)(sign | (u > (255u << 23) ? 0x7e00u : 0x7c00u)); /* >= 2^16, inf, nan */
  if (u < (113u << 23)) { /* below 2^-14: an fp16 subnormal or zero */
    const uint32_t magic = 126u << 23;  /* 0.5: adding it leaves round(f * 2^24) in the low mantissa bits */
    float a, m;
    memcpy(&a, &u, 4); memcpy(&m, &magic, 4);
    a += m;
    memcpy(&u, &a, 4);
    return (uint16_t)(sign | (u - magic));
  }
  u += (((uint32_t)(15 - 127)) << 23) + 0xfffu + ((u >> 13) & 1u);
  return (uint16_t)(sign | (u >> 13));
}

/* code paths (host_gemv.PATHS): avx512vbmi is avx512 (4-bit, bit for bit) with the 8-bit lookup by byte permutes
   in its own column order (row8_bytes); avx512fp16 is avx512vbmi forming the shared storage's tables by fp16
   multiplies (the same bits) */
enum { PATH_C = 0, PATH_AVX2 = 1, PATH_AVX512 = 2, PATH_VBMI = 3, PATH_FP16 = 4 };

/* the avx512fp16 8-bit lookup's column order: the column (within a block of 64) of quarter q's element i */
static inline long xorder64(long q, long i) { return 16 * (2 * (q & 1) + i / 8) + 8 * (q >> 1) + i % 8; }

/* ---------------------------------------------------------------- the work item */
typedef struct {
  const float *xp; long M, K, Kp;  /* xp: prepared x [M, Kp] */
  const uint8_t *codes; long ldc; const uint16_t *cb; long N;
  float *y; long ldy; int bits, path;
  const uint16_t *scale; long G;   /* shared storage: row scales [N], G rows a group (scale NULL: per-row cb) */
} job_t;

/* a call over several weights of one input (tp_gemv_multi): segment s holds global rows off[s] .. off[s+1]-1 */
#define MAX_SEGS 4
typedef struct {
  job_t seg[MAX_SEGS];  /* each segment's job: its codes, codebooks, N and y already offset to its columns */
  long off[MAX_SEGS + 1];
  int nseg;
  long N;               /* all rows */
} multi_t;

/* ---------------------------------------------------------------- portable path */
/* row n's table of ne entries as fp32 into t (the header's two storages) */
static void table_c(const uint16_t *cb, const uint16_t *scale, long G, long n, int ne, float *t) {
  if (scale) {
    const float s = h2f(scale[n]);
    const uint16_t *sh = cb + (n / G) * ne;
    for (int e = 0; e < ne; e++) t[e] = h2f(f2h(s * h2f(sh[e])));
  } else {
    for (int e = 0; e < ne; e++) t[e] = h2f(cb[n * ne + e]);
  }
}

static void rows_c(const job_t *j, long n0, long n1) {
  float t[256];
  const int ne = 1 << j->bits;
  for (long n = n0; n < n1; n++) {
    table_c(j->cb, j->scale, j->G, n, ne, t);
    const uint8_t *c = j->codes + n * j->ldc;
    for (long m = 0; m < j->M; m++) {
      const float *x = j->xp + m * j->Kp;
      float a[4] = {0, 0, 0, 0};
      if (j->bits == 4) {
        for (long k = 0; k < j->K; k++) a[k & 3] += t[(c[k >> 1] >> ((k & 1) * 4)) & 15] * x[k];
      } else {
        for (long k = 0; k < j->K; k++) a[k & 3] += t[c[k]] * x[k];
      }
      j->y[m * j->ldy + n] = (a[0] + a[1]) + (a[2] + a[3]);
    }
  }
}

#if TP_X86
/* ---------------------------------------------------------------- AVX2 path */
#ifndef PF
#define PF 4096
#endif
#ifndef PF_MASK4
#define PF_MASK4 3 /* 4-bit AVX-512: one prefetch per 4 blocks of 16 code bytes (a cache line) */
#endif
#ifndef PF_MASK8
#define PF_MASK8 1 /* 8-bit AVX-512: one per 2 blocks of 32 */
#endif
/* PF: software prefetch distance along the codes (bytes): the hardware streamers alone leave the
                   kernel latency-bound on DRAM. The 4-bit AVX-512 blocks of 128 prefetch into L2 only (T1): into L1
   (T0) the code lines pushed out the row of x that every code row reads again (19 KB at K = 4864), and a cold
   896 x 4864 matrix ran 8.8-9.4 GB/s against 12.2-12.4 with T1 (Zen 4, K = 896: the same within the noise;
   scripts/dev/s14_lib_mb.c, session 14) */
__attribute__((target("avx2,fma,f16c"))) static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma,f16c"))) static inline __m256 look16(__m256 lo, __m256 hi, __m256i idx) {
  __m256 a = _mm256_permutevar8x32_ps(lo, idx), b = _mm256_permutevar8x32_ps(hi, idx);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

/* 4-bit, R x rows: blocks of 16 columns = 8 code bytes; xp[16g + i] = x[16g + 2i], xp[16g + 8 + i] = x[16g + 2i + 1] */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void row4_avx2(
    const job_t *j, long n, long m0, int R, const float *t) {
  const __m256 lo = _mm256_load_ps(t), hi = _mm256_load_ps(t + 8);
  const uint8_t *c = j->codes + n * j->ldc;
  const long nb = j->Kp / 16, full = j->K / 16;  /* blocks; full blocks lie inside the stored row */
  __m256 a0[4], a1[4];
  for (int r = 0; r < R; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
  uint8_t tail[8];
  for (long b = 0; b < nb; b++) {
    const uint8_t *p = c + b * 8;
    if (!(b & 7)) _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
    if (b >= full) { /* the row's partial last block */
      long have = (j->K + 1) / 2 - b * 8;
      memset(tail, 0, 8); memcpy(tail, p, have); p = tail;
    }
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256 w0 = look16(lo, hi, v); /* bits 2:0 pick, bit 3 blends; the high nibble is shifted out */
    __m256 w1 = look16(lo, hi, _mm256_srli_epi32(v, 4));
    for (int r = 0; r < R; r++) {
      const float *x = j->xp + (m0 + r) * j->Kp + b * 16;
      a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), a0[r]);
      a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), a1[r]);
    }
  }
  for (int r = 0; r < R; r++) j->y[(m0 + r) * j->ldy + n] = hsum8(_mm256_add_ps(a0[r], a1[r]));
}

/* 8-bit, R x rows: blocks of 8 columns, 256-entry fp32 table on the stack, gathered */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void row8_avx2(
    const job_t *j, long n, long m0, int R, const float *t) {
  const uint8_t *c = j->codes + n * j->ldc;
  const long nb = j->Kp / 8, full = j->K / 8;
  __m256 a0[4], a1[4];
  for (int r = 0; r < R; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
  uint8_t tail[8];
#define STEP8_AVX2(B, A)                                                                      \
  do {                                                                                        \
    const uint8_t *p = c + (B) * 8;                                                           \
    if (!((B) & 7)) _mm_prefetch((const char *)p + PF, _MM_HINT_T0);                           \
    if ((B) >= full) { memset(tail, 0, 8); memcpy(tail, p, j->K - (B) * 8); p = tail; }       \
    __m256 w = _mm256_i32gather_ps(t, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), 4); \
    for (int r = 0; r < R; r++)                                                               \
      A[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(j->xp + (m0 + r) * j->Kp + (B) * 8), A[r]);   \
  } while (0)
  long b = 0;
  for (; b + 1 < nb; b += 2) { STEP8_AVX2(b, a0); STEP8_AVX2(b + 1, a1); }
  if (b < nb) STEP8_AVX2(b, a0);
  for (int r = 0; r < R; r++) j->y[(m0 + r) * j->ldy + n] = hsum8(_mm256_add_ps(a0[r], a1[r]));
}

/* row n's table as fp32 into t[2^bits]: its stored fp16 entries widened, or (shared storage) the group's fp32
   table gt (refreshed into gt when the group changes; *g: the group it holds) times the row scale, rounded to
   fp16 (RNE) and widened */
__attribute__((target("avx2,fma,f16c"))) static inline void table_avx2(const job_t *j, long n, float *t, float *gt,
                                                                       long *g) {
  const int ne = 1 << j->bits;
  if (!j->scale) {
    const uint16_t *cbn = j->cb + n * ne;
    for (int e = 0; e < ne; e += 8) _mm256_store_ps(t + e, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cbn + e))));
    for (int e = 0; e < ne; e += 32) _mm_prefetch((const char *)(cbn + (ne == 16 ? 16 : 4) * ne + e), _MM_HINT_T0);
    return;
  }
  if (n / j->G != *g) {
    *g = n / j->G;
    for (int e = 0; e < ne; e += 8)
      _mm256_store_ps(gt + e, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(j->cb + *g * ne + e))));
  }
  const __m256 s = _mm256_set1_ps(h2f(j->scale[n]));
  for (int e = 0; e < ne; e += 8)
    _mm256_store_ps(t + e, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_mul_ps(s, _mm256_load_ps(gt + e)),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
}

__attribute__((target("avx2,fma,f16c"))) static void rows_avx2(const job_t *j, long n0, long n1) {
  float t[256] __attribute__((aligned(32))), gt[256] __attribute__((aligned(32)));
  long g = -1;
  for (long n = n0; n < n1; n++) {
    table_avx2(j, n, t, gt, &g);
    for (long m = 0; m < j->M; m += 4) {
      long R = j->M - m < 4 ? j->M - m : 4;
      if (j->bits == 4) {
        switch (R) { case 4: row4_avx2(j, n, m, 4, t); break; case 3: row4_avx2(j, n, m, 3, t); break;
                     case 2: row4_avx2(j, n, m, 2, t); break; default: row4_avx2(j, n, m, 1, t); }
      } else {
        switch (R) { case 4: row8_avx2(j, n, m, 4, t); break; case 3: row8_avx2(j, n, m, 3, t); break;
                     case 2: row8_avx2(j, n, m, 2, t); break; default: row8_avx2(j, n, m, 1, t); }
      }
    }
  }
}

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
__attribute__((target(T512))) static void rows_512(const job_t *j, long n0, long n1) {
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
__attribute__((target(TVBMI))) static void rows_vbmi(const job_t *j, long n0, long n1) {
  if (j->bits == 4) { rows_512(j, n0, n1); return; }
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

__attribute__((target(TSPR))) static void rows_spr(const job_t *j, long n0, long n1) {
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

/* ---------------------------------------------------------------- path choice */

int tp_path(void) { /* the best path this CPU runs */
#if TP_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
      && __builtin_cpu_supports("fma"))
    return !__builtin_cpu_supports("avx512vbmi") ? PATH_AVX512 : __builtin_cpu_supports("avx512fp16") ? PATH_FP16
                                                                                                   : PATH_VBMI;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return PATH_AVX2;
#endif
  return PATH_C;
}

static void run_rows1(const job_t *j, long n0, long n1) {
#if TP_X86
  if (j->path == PATH_FP16) { rows_spr(j, n0, n1); return; }
  if (j->path == PATH_VBMI) { rows_vbmi(j, n0, n1); return; }
  if (j->path == PATH_AVX512) { rows_512(j, n0, n1); return; }
  if (j->path == PATH_AVX2) { rows_avx2(j, n0, n1); return; }
#endif
  rows_c(j, n0, n1);
}

/* global rows n0 .. n1 - 1 of a multi-segment call: each segment's part by its own job (same sequence per row) */
static void run_rows(const multi_t *mj, long n0, long n1) {
  for (int s = 0; s < mj->nseg; s++) {
    long a = n0 > mj->off[s] ? n0 : mj->off[s], b = n1 < mj->off[s + 1] ? n1 : mj->off[s + 1];
    if (a < b) run_rows1(&mj->seg[s], a - mj->off[s], b - mj->off[s]);
  }
}

/* the thread pool (host/host_pool.c): fn(arg, n0, n1) over chunks of rows 0 .. N - 1 on up to nt threads */
void tp_pool_run(void (*fn)(const void *, long, long), const void *arg, long N, int nt);

static void run_rows_cb(const void *arg, long n0, long n1) { run_rows((const multi_t *)arg, n0, n1); }

/* ---------------------------------------------------------------- dequantize (prefill) */
/* out fp32 [n1 - n0, K] (row stride ldo) = the weight rows n0 .. n1 - 1 (exact: fp16 centroids widened; either
   storage, scale NULL or G rows a group) */
int tp_codebook_dequant(const uint8_t *codes, long ldc, const uint16_t *cb, const uint16_t *scale, long G, long n0,
                        long n1, long K, int bits, float *out, long ldo) {
  if ((bits != 4 && bits != 8) || K < 1 || ldo < K || n1 < n0 || (scale && G < 1)) return -1;
  const int ne = 1 << bits;
  float t[256];
  for (long n = n0; n < n1; n++) {
    table_c(cb, scale, G, n, ne, t);
    const uint8_t *c = codes + n * ldc;
    float *o = out + (n - n0) * ldo;
    if (bits == 8) {
      for (long k = 0; k < K; k++) o[k] = t[c[k]];
    } else {
      for (long k = 0; k + 1 < K; k += 2) { o[k] = t[c[k >> 1] & 15]; o[k + 1] = t[c[k >> 1] >> 4]; }
      if (K & 1) o[K - 1] = t[c[K >> 1] & 15];
    }
  }
  return 0;
}

/* ---------------------------------------------------------------- entry points */
static float *prepare_x(const float *x, long ldx, long M, long K, int bits, int path, long *Kp_out) {
  long blk = path >= PATH_VBMI && bits == 8 ? 64 : path >= PATH_AVX512 ? 32 : path == PATH_AVX2 ? (bits == 4 ? 16 : 8) : 1;
  long Kp = (K + blk - 1) / blk * blk;
  float *xp = (float *)calloc((size_t)(M * Kp), sizeof(float));
  if (!xp) return NULL;
  for (long m = 0; m < M; m++) {
    const float *src = x + m * ldx;
    float *dst = xp + m * Kp;
    if (bits == 4 && blk == 32) { /* AVX-512: blocks of 128 by nibble position, the rest as below (row4_512) */
      long k128 = K / 128 * 128;
      for (long k = 0; k < k128; k++) dst[(k / 128) * 128 + 16 * (k % 8) + (k % 128) / 8] = src[k];
      for (long k = k128; k < K; k++) dst[(k / 32) * 32 + (k & 1) * 16 + (k % 32) / 2] = src[k];
    } else if (bits == 4 && blk > 1) { /* de-interleave even / odd columns per block */
      long h = blk / 2;
      for (long k = 0; k < K; k++) dst[(k / blk) * blk + (k & 1) * h + (k % blk) / 2] = src[k];
    } else if (blk == 64) { /* the byte lookup's column order (xorder64) */
      for (long k0 = 0; k0 < K; k0 += 64)
        for (long p = 0; p < 64; p++) {
          long k = k0 + xorder64(p / 16, p % 16);
          if (k < K) dst[k0 + p] = src[k];
        }
    } else {
      memcpy(dst, src, (size_t)K * sizeof(float));
    }
  }
  *Kp_out = Kp;
  return xp;
}

static void run_all(const multi_t *mj, int threads) {
  if (threads < 1) threads = 1;
  if (threads > mj->N) threads = (int)mj->N;
  if (threads == 1) run_rows(mj, 0, mj->N); else tp_pool_run(run_rows_cb, mj, mj->N, threads);
}

/* returns 0, or -1 (bad arguments), -2 (out of memory); path < 0: tp_path(); scale NULL: per-row tables cb, else
   the shared storage (cb the groups' tables, G rows a group) */
int tp_codebook_gemv(const float *x, long ldx, long M, long K, const uint8_t *codes, long ldc,
                     const uint16_t *cb, const uint16_t *scale, long G, long N, int bits, float *y, long ldy,
                     int threads, int path) {
  if ((bits != 4 && bits != 8) || M < 0 || K < 1 || N < 0 || ldx < K || ldy < N || (scale && G < 1)) return -1;
  if (ldc < (bits == 4 ? (K + 1) / 2 : K)) return -1;
  if (M == 0 || N == 0) return 0;
  if (path < 0) path = tp_path();
  long Kp;
  float *xp = prepare_x(x, ldx, M, K, bits, path, &Kp);
  if (!xp) return -2;
  multi_t mj;
  mj.nseg = 1; mj.off[0] = 0; mj.off[1] = N; mj.N = N;
  mj.seg[0] = (job_t){xp, M, K, Kp, codes, ldc, cb, N, y, ldy, bits, path, scale, G};
  run_all(&mj, threads);
  free(xp);
  return 0;
}

static float act_f(float g, int act) {
  if (act == 1) return g / (1.0f + expf(-g));                                  /* SiLU */
  const float c = 0.7978845608028654f;                                         /* GELU, tanh form */
  return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
}

/* Several weights of one input in one call: their output rows side by side, y fp32 [M, N_0 + .. + N_{n-1}].
   segs: nseg x (codes pointer, ldc, table pointer, N, row-scale pointer or 0, G) as longs (the two storages of
   tp_codebook_gemv, per segment); every segment has `bits`, K columns.
   Epilogue, in this order, per element: + bias[n] (bias NULL: none); then
     act 0: y = res[m, n] + y (res NULL: none)
     act 1 (SiLU) / 2 (GELU tanh): nseg 2, N_0 == N_1 = F: y [M, F] (stride ldy) = act(g) * u, the gate / up
     outputs (bias included) computed into a scratch first.
   Each output element is its row's one fixed sequence (batch-invariant, any thread count). */
#define SEG 6 /* longs per segment */
int tp_gemv_multi(const float *x, long ldx, long M, long K, int nseg, const long *segs, int bits, float *y,
                  long ldy, const float *bias, const float *res, long ldr, int act, int threads, int path) {
  if ((bits != 4 && bits != 8) || M < 0 || K < 1 || nseg < 1 || nseg > MAX_SEGS || ldx < K) return -1;
  if (act < 0 || act > 2 || (act && (nseg != 2 || segs[3] != segs[SEG + 3]))) return -1;
  multi_t mj;
  long N = 0;
  for (int s = 0; s < nseg; s++) {
    const long *g = segs + SEG * s;
    if (g[1] < (bits == 4 ? (K + 1) / 2 : K) || g[3] < 0 || (g[4] && g[5] < 1)) return -1;
    mj.off[s] = N; N += g[3];
  }
  mj.off[nseg] = N; mj.nseg = nseg; mj.N = N;
  if (act ? ldy < N / 2 : ldy < N) return -1;
  if (M == 0 || N == 0) return 0;
  if (path < 0) path = tp_path();
  long Kp;
  float *xp = prepare_x(x, ldx, M, K, bits, path, &Kp);
  if (!xp) return -2;
  float *out = y;
  long ldo = ldy;
  if (act) {
    out = (float *)malloc((size_t)(M * N) * sizeof(float));
    if (!out) { free(xp); return -2; }
    ldo = N;
  }
  for (int s = 0; s < nseg; s++) {
    const long *g = segs + SEG * s;
    mj.seg[s] = (job_t){xp, M, K, Kp, (const uint8_t *)g[0], g[1], (const uint16_t *)g[2], g[3], out + mj.off[s],
                        ldo, bits, path, (const uint16_t *)g[4], g[5]};
  }
  run_all(&mj, threads);
  free(xp);
  for (long m = 0; m < M; m++) {
    float *o = out + m * ldo;
    if (bias) for (long n = 0; n < N; n++) o[n] = o[n] + bias[n];
    if (act) {
      long F = N / 2;
      float *d = y + m * ldy;
      for (long n = 0; n < F; n++) d[n] = act_f(o[n], act) * o[F + n];
    } else if (res) {
      const float *r = res + m * ldr;
      for (long n = 0; n < N; n++) o[n] = r[n] + o[n];
    }
  }
  if (act) free(out);
  return 0;
}
