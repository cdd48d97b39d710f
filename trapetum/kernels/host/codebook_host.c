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
     8-bit: 16-bit permutes of the fp16 table), AVX2 (4-bit: the fp16 table's two byte planes, vpshufb; 8-bit:
     scalar loads and inserts), portable C, chosen at run time from the CPU (tp_path); results differ between paths only in
     rounding; on each path the two table storages give the same bits.
   x is copied once per call into a zero-padded buffer, permuted per block so that the low / high nibbles of
   consecutive code bytes meet consecutive x entries (AVX2: blocks of 16 columns, AVX-512: 128 by nibble
   position, then 32; row4_512); a row's
   last partial block of codes is copied into a zeroed local block (padding indices multiply x's zeros).
   Build: gcc -O3 -shared -fPIC -pthread -ffp-contract=off (no FMA contraction outside the intrinsics). */
#include "codebook_host.h"


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
__attribute__((target("avx2,fma,f16c"))) static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

/* row n's 16-entry table (fp32 t, every entry an fp16 value) as its fp16 bits in two byte planes, low bytes
   and high bytes, for 16-entry byte lookups (vpshufb) */
__attribute__((target("avx2,fma,f16c"))) static inline void planes4_avx2(const float *t, __m128i *plo, __m128i *phi) {
  const __m128i sel = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m128i a = _mm_shuffle_epi8(_mm256_cvtps_ph(_mm256_load_ps(t), _MM_FROUND_TO_NEAREST_INT), sel);
  const __m128i b = _mm_shuffle_epi8(_mm256_cvtps_ph(_mm256_load_ps(t + 8), _MM_FROUND_TO_NEAREST_INT), sel);
  *plo = _mm_unpacklo_epi64(a, b);  /* entries 0..7 are exact fp16 values: the round trip is exact */
  *phi = _mm_unpackhi_epi64(a, b);
}

/* 4-bit, R x rows: blocks of 16 columns = 8 code bytes; xp[16g + i] = x[16g + 2i], xp[16g + 8 + i] = x[16g + 2i + 1].
   The 16 indices of a block (8 low nibbles, then 8 high) look up both byte planes at once (two vpshufb), the
   bytes interleave back into fp16 weights, widened exactly (vcvtph2ps): the table's fp32 entries, as the
   permute-and-blend lookup of sessions before 18 gave them (two vpermps, a blend, per 8), with 128-bit shuffles
   only (a 256-bit vpermps costs 3 ops on AMD Zen 1; that lookup ran 2.8 GB/s a core there). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void row4_avx2(
    const job_t *j, long n, long m0, int R, const float *t) {
  __m128i plo, phi;
  planes4_avx2(t, &plo, &phi);
  const __m128i m4 = _mm_set1_epi8(15);
  const uint8_t *c = j->codes + n * j->ldc;
  const long nb = j->Kp / 16, full = j->K / 16;  /* blocks; full blocks lie inside the stored row */
  __m256 a0[4], a1[4];
  for (int r = 0; r < R; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
  uint8_t tail[8];
#define BLOCK4_AVX2(IDX, B)                                                                   \
  do {                                                                                        \
    const __m128i lb = _mm_shuffle_epi8(plo, IDX), hb = _mm_shuffle_epi8(phi, IDX);           \
    const __m256 w0 = _mm256_cvtph_ps(_mm_unpacklo_epi8(lb, hb)); /* the low nibbles' weights */ \
    const __m256 w1 = _mm256_cvtph_ps(_mm_unpackhi_epi8(lb, hb)); /* the high nibbles' */     \
    for (int r = 0; r < R; r++) {                                                             \
      const float *x = j->xp + (m0 + r) * j->Kp + (B) * 16;                                   \
      a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), a0[r]);                                 \
      a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), a1[r]);                             \
    }                                                                                         \
  } while (0)
  long b = 0;
  for (; b + 2 <= full; b += 2) { /* two full blocks from one 16-byte load */
    if (!(b & 7)) _mm_prefetch((const char *)(c + b * 8) + PF, _MM_HINT_T0);
    const __m128i v = _mm_loadu_si128((const __m128i *)(c + b * 8));
    const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    const __m128i i0 = _mm_unpacklo_epi64(lo, hi), i1 = _mm_unpackhi_epi64(lo, hi);
    BLOCK4_AVX2(i0, b);
    BLOCK4_AVX2(i1, b + 1);
  }
  for (; b < nb; b++) { /* an odd last full block, then the row's partial last block (Kp: K rounded up to 16) */
    const uint8_t *p = c + b * 8;
    if (b >= full) {
      long have = (j->K + 1) / 2 - b * 8;
      memset(tail, 0, 8); memcpy(tail, p, have); p = tail;
    }
    const __m128i v = _mm_loadl_epi64((const __m128i *)p);
    const __m128i idx = _mm_unpacklo_epi64(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    BLOCK4_AVX2(idx, b);
  }
#undef BLOCK4_AVX2
  for (int r = 0; r < R; r++) j->y[(m0 + r) * j->ldy + n] = hsum8(_mm256_add_ps(a0[r], a1[r]));
}

/* the table entries of 8 code bytes as 8 fp32: 8 scalar loads put together by inserts (vgatherdps gives the
   same values, but costs ~20 cycles a call on AMD Zen 1, 1.9 GB/s a core for the 8-bit head there) */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256 look8_avx2(const float *t,
                                                                                        const uint8_t *p) {
  uint64_t q;
  memcpy(&q, p, 8);
  const __m128 l = _mm_setr_ps(t[q & 255], t[(q >> 8) & 255], t[(q >> 16) & 255], t[(q >> 24) & 255]);
  const __m128 h = _mm_setr_ps(t[(q >> 32) & 255], t[(q >> 40) & 255], t[(q >> 48) & 255], t[q >> 56]);
  return _mm256_insertf128_ps(_mm256_castps128_ps256(l), h, 1);
}

/* 8-bit, R x rows: blocks of 8 columns, 256-entry fp32 table on the stack, looked up by look8_avx2 */
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
    __m256 w = look8_avx2(t, p);                                                              \
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

#endif

/* ---------------------------------------------------------------- path choice */

static int best_path(void) { /* the best path this CPU runs */
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

static volatile int path_limit = -1; /* tp_limit_path: the highest path tp_path returns; < 0: none */

int tp_path(void) { /* the path of calls that name none: the best, at most the limit */
  const int p = best_path(), lim = path_limit;
  return lim >= 0 && p > lim ? lim : p;
}

/* Caps the path of every later call that names none (benchmarks: a lower path's speed on this CPU, e.g. an
   AVX2-only machine's code on an AVX-512 one); limit < 0 removes the cap. Returns the path such calls take now. */
int tp_limit_path(int limit) {
  path_limit = limit;
  return tp_path();
}

static void run_rows1(const job_t *j, long n0, long n1) {
  if (j->bits == TP_BITS_GGML) { /* GGUF blocks (ggml_host.c): x as given (xp, row stride Kp), type in G */
    tp_ggml_rows(j->xp, j->Kp, j->M, j->K, j->codes, j->ldc, (int)j->G, j->path, j->y, j->ldy, n0, n1);
    return;
  }
  if (j->qt) { tp_rows_q8(j, n0, n1); return; }  /* the int8 numerics (codebook_host_q8.c) */
#if TP_X86
  if (j->path == PATH_FP16) { tp_rows_spr(j, n0, n1); return; }
  if (j->path == PATH_VBMI) { tp_rows_vbmi(j, n0, n1); return; }
  if (j->path == PATH_AVX512) { tp_rows_512(j, n0, n1); return; }
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
   segs: nseg x (codes pointer, ldc, table pointer, N, row-scale pointer or 0, G, int8 table pointer or 0, int8
   row-scale pointer or 0) as longs (the two storages of tp_codebook_gemv, per segment; an int8 table: the int8
   numerics of codebook_host_q8.c, every segment or none, its fp16 table pointer not read; 8-bit: the codes and
   the int8 table pointer both the dense form's int8 weights, ldc >= K rounded up to 128; bits TP_BITS_GGML: GGUF
   block rows, each segment (blocks, row bytes, 0, N, 0, its type, 0, 0), types may differ, ggml_host.c's kernel);
   every segment has `bits`, K columns.
   Epilogue, in this order, per element: + bias[n] (bias NULL: none); then
     act 0: y = res[m, n] + y (res NULL: none)
     act 1 (SiLU) / 2 (GELU tanh): nseg 2, N_0 == N_1 = F: y [M, F] (stride ldy) = act(g) * u, the gate / up
     outputs (bias included) computed into a scratch first.
   Each output element is its row's one fixed sequence (batch-invariant, any thread count). */
#define SEG 8 /* longs per segment */
int tp_gemv_multi(const float *x, long ldx, long M, long K, int nseg, const long *segs, int bits, float *y,
                  long ldy, const float *bias, const float *res, long ldr, int act, int threads, int path) {
  const int gg = bits == TP_BITS_GGML;
  if ((bits != 4 && bits != 8 && !gg) || M < 0 || K < 1 || nseg < 1 || nseg > MAX_SEGS || ldx < K) return -1;
  if (gg && K % 32) return -1;
  if (act < 0 || act > 2 || (act && (nseg != 2 || segs[3] != segs[SEG + 3]))) return -1;
  multi_t mj;
  long N = 0;
  const int q8 = !gg && segs[6] != 0;
  for (int s = 0; s < nseg; s++) {
    const long *g = segs + SEG * s;
    if (gg) { /* (blocks, row bytes, 0, N, 0, type, 0, 0) */
      const int bb = tp_ggml_block_bytes((int)g[5]), be = tp_ggml_block_elems((int)g[5]);
      if (!g[0] || !bb || K % be || g[1] < K / be * bb || g[3] < 0 || g[6] || g[7]) return -1;
      mj.off[s] = N; N += g[3];
      continue;
    }
    if (g[1] < (bits == 4 ? (K + 1) / 2 : K) || g[3] < 0 || (g[4] && g[5] < 1)) return -1;
    if ((g[6] != 0) != q8 || (q8 && !g[7]) || (q8 && bits == 8 && g[1] < (K + 127) / 128 * 128)) return -1;
    mj.off[s] = N; N += g[3];
  }
  mj.off[nseg] = N; mj.nseg = nseg; mj.N = N;
  if (act ? ldy < N / 2 : ldy < N) return -1;
  if (M == 0 || N == 0) return 0;
  if (path < 0) path = tp_path();
  long Kp = 0, Kq = (K + 127) / 128 * 128;
  float *xp = NULL, *dg = NULL;
  int8_t *xq = NULL;
  int32_t *xc = NULL;
  if (gg) { /* the blocks' kernel reads x where it lies */
    Kp = ldx;
  } else if (q8) { /* x quantized once, for every row and thread */
    xq = (int8_t *)malloc((size_t)(M * Kq));
    dg = (float *)malloc((size_t)(M * Kq / 8) * sizeof(float));
    xc = (int32_t *)malloc((size_t)(M * Kq / 8) * sizeof(int32_t));
    if (!xq || !dg || !xc) { free(xq); free(dg); free(xc); return -2; }
    if (bits == 8) tp_q8_prepare_span(x, ldx, M, K, 128, xq, dg, xc); /* the dense form's q8 order */
    else tp_q8_prepare(x, ldx, M, K, path, xq, dg, xc);
  } else {
    xp = prepare_x(x, ldx, M, K, bits, path, &Kp);
    if (!xp) return -2;
  }
  float *out = y;
  long ldo = ldy;
  if (act) {
    out = (float *)malloc((size_t)(M * N) * sizeof(float));
    if (!out) { free(xp); free(xq); free(dg); free(xc); return -2; }
    ldo = N;
  }
  for (int s = 0; s < nseg; s++) {
    const long *g = segs + SEG * s;
    mj.seg[s] = (job_t){gg ? x : xp, M, K, Kp, (const uint8_t *)g[0], g[1], (const uint16_t *)g[2], g[3],
                        out + mj.off[s], ldo, bits, path, (const uint16_t *)g[4], g[5], (const int8_t *)g[6],
                        (const float *)g[7], xq, dg, xc, Kq};
  }
  run_all(&mj, threads);
  free(xp); free(xq); free(dg); free(xc);
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

/* n tp_gemv_multi calls one after another, each one's arguments as tp_gemv_multi's (every int as a long here):
   bench_cpu's step GEMV pass, the GEMVs as the CPU step calls them from C, with no Python between them. Stops at
   the first call that fails and returns its code. */
typedef struct {
  const float *x; long ldx, M, K, nseg; const long *segs; long bits; float *y; long ldy;
  const float *bias, *res; long ldr, act, threads, path;
} tp_multi_call_t;

int tp_gemv_multi_list(const tp_multi_call_t *c, long n) {
  for (long i = 0; i < n; i++, c++) {
    int rc = tp_gemv_multi(c->x, c->ldx, c->M, c->K, (int)c->nseg, c->segs, (int)c->bits, c->y, c->ldy, c->bias,
                           c->res, c->ldr, (int)c->act, (int)c->threads, (int)c->path);
    if (rc) return rc;
  }
  return 0;
}
