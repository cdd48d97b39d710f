/* The int8 numerics of the host GEMV (Options.host_numerics "int8"; kernels/host_gemv.py Int8Tables for 4-bit
   codes, Int8Weights for 8-bit ones): an opt-in mode with numbers of its own, not a code path (the default fp32
   mode of codebook_host.c is untouched).

   Quantities (every one an exact integer or a value fixed before the row loop):
   - per weight row n (made once when the weight is loaded, host_gemv.Int8Tables): the int8 table
     q[n, e] = round(c[n, e] / s[n]), s[n] = max_e |c[n, e]| / 127 (fp32), |q| <= 127;
   - per row m of x and block b of 32 consecutive columns (made once per call, in the calling thread, by one
     portable function for every path, so every path reads the same bytes): d[b] = max_{k in b} |x[k]| / 127.0f
     (fp32), xq[k] = rint(x[k] / d[b]) (fp32 division, round to nearest even; 0 where d[b] is 0), |xq| <= 127;
     the row is zero-padded to Kq = K rounded up to 128 columns;
   - per octet g (columns 8g .. 8g + 7; g < G = ceil(K / 64) * 8): P[g] = sum_k q[n, idx(n, k)] * xq[k], exact in
     int32 (|P| <= 8 * 127 * 127), so exactly representable in fp32.
   The float part, the same on every path, thread count and M (batch-invariant as the fp32 mode):
     acc[i] (32 fp32 lanes, +0 at the start) = fma(d[g / 4], (float)P[g], acc[i]) over g = i, i + 32, i + 64, .. < G;
     h[l] = (acc[l] + acc[16 + l]) + (acc[8 + l] + acc[24 + l])  (l = 0..7);
     y[m, n] = s[n] * (((h0 + h4) + (h2 + h6)) + ((h1 + h5) + (h3 + h7))).
   So the paths differ only in how they form the integers P[g]:
   - portable C: a loop over the octet's 8 columns;
   - AVX2 (no VNNI: an AVX2-only machine's code): 64 columns = 32 code bytes a step, the low / high nibbles as 32
     indices each into the row's int8 table (one vpshufb each), vpmaddubsw(|w|, sign(xq, w)) + vpmaddwd(., 1) give
     8 int32 of 4 columns each (the low nibbles the even columns, the high the odd ones: x is prepared per 64
     columns as [the 32 even columns | the 32 odd]), their sum the 8 octets' P; one cvt, one FMA with the octets'
     d (fanned out to one float per octet at prepare time); chunk c into accumulator c % 4;
   - AVX-512 (BW): 128 columns = 64 code bytes a step (x per 128 columns as [64 even | 64 odd]); with AVX512-VNNI
     two vpdpbusd on the table's unsigned form q + 128 (one xor) starting from -128 * sum(xq of the octet)
     (prepared per call), without VNNI vpmaddubsw / vpmaddwd on |w| and xq negated where w < 0; chunk c into
     accumulator c % 2 (16 lanes each = the 32 lanes above); a last 64-column chunk as a masked half.
   8-bit codes (the LM head), the dense form: a 256-entry table has no one-instruction lookup on AVX2 (the fp32
   mode's scalar loads ran 4.4 GB/s a core), so the int8 table q (rounded as above) is looked up once when the
   weight is loaded, into int8 weights w[n, k] = q[n, idx(n, k)] [N, Kq] (the same bytes as the codes, which are
   then not read), stored in the q8 order: per 128 columns the 64 even columns, then the 64 odd ones (x prepared
   in the same order on every path, tp_q8_prepare_span). P[g] as above over every octet g < Kq / 8 (the octets
   past K are zeros in w and x: they add +0 and change no bit); AVX2: 64 columns a step (32 even + 32 odd bytes
   of one 128-column group), AVX-512: a whole group (with VNNI on w + 128 from the xc offset, as above).
   Bits: vpmaddubsw cannot saturate (|w| * |xq| * 2 <= 32258). Build: codebook_host.c's flags. */
#include "codebook_host.h"

#define Q8_LANES 32

/* the fixed tail of the float part: 32 lanes -> one fp32 (the file comment's h and its tree) */
static inline float q8_tree(const float *a) {
  float h[8];
  for (int l = 0; l < 8; l++) h[l] = (a[l] + a[16 + l]) + (a[8 + l] + a[24 + l]);
  return ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]));
}

/* ---------------------------------------------------------------- x, once per call */
/* x fp32 [M, K] (row stride ldx) -> xq int8 [M, Kq] in the path's column order, dg fp32 [M, Kq / 8] (the octet's
   block scale d), xc int32 [M, Kq / 8] (-128 * the octet's sum of xq: the VNNI form's offset). Kq: K rounded up
   to 128. Portable, one thread: every path and thread count reads the same values. */
int tp_q8_prepare(const float *x, long ldx, long M, long K, int path, int8_t *xq, float *dg, int32_t *xc) {
  return tp_q8_prepare_span(x, ldx, M, K, path >= PATH_AVX512 ? 128 : path == PATH_AVX2 ? 64 : 1, xq, dg, xc);
}

/* the same in the column order of groups of `span` columns (1: natural; 64 or 128: [the even columns | the odd]):
   the 4-bit codes' order is the path's (tp_q8_prepare), the 8-bit dense weights' always 128 (q8 order) */
int tp_q8_prepare_span(const float *x, long ldx, long M, long K, long span, int8_t *xq, float *dg, int32_t *xc) {
  const long Kq = (K + 127) / 128 * 128, ng = Kq / 8;
  memset(xq, 0, (size_t)(M * Kq));
  for (long m = 0; m < M; m++) {
    const float *src = x + m * ldx;
    int8_t *dst = xq + m * Kq;
    float *dgm = dg + m * ng;
    int32_t *xcm = xc + m * ng;
    for (long g = 0; g < ng; g++) { dgm[g] = 0.0f; xcm[g] = 0; }
    for (long b0 = 0; b0 < K; b0 += 32) {
      const long b1 = b0 + 32 < K ? b0 + 32 : K;
      float amax = 0.0f;
      for (long k = b0; k < b1; k++) { float a = fabsf(src[k]); if (a > amax) amax = a; }
      const float d = amax / 127.0f;
      for (long g = b0 / 8; g < b0 / 8 + 4; g++) dgm[g] = d;
      for (long k = b0; k < b1; k++) {
        float r = d > 0.0f ? rintf(src[k] / d) : 0.0f;
        int v = r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r;
        long p = k;  /* its place: even columns of the group first, then the odd ones */
        if (span > 1) p = (k / span) * span + (k & 1) * (span / 2) + (k % span) / 2;
        dst[p] = (int8_t)v;
        xcm[k / 8] -= 128 * v;
      }
    }
  }
  return 0;
}

/* ---------------------------------------------------------------- portable path */
static void rows_q8_c(const job_t *j, long n0, long n1) {
  const long G = (j->K + 63) / 64 * 8, ng = j->Kq / 8;
  for (long n = n0; n < n1; n++) {
    const int8_t *t = j->qt + n * 16;
    const uint8_t *c = j->codes + n * j->ldc;
    for (long m = 0; m < j->M; m++) {
      const int8_t *xq = j->xq + m * j->Kq;
      const float *dg = j->dg + m * ng;
      float a[Q8_LANES];
      for (int i = 0; i < Q8_LANES; i++) a[i] = 0.0f;
      for (long g = 0; g < G; g++) {
        int32_t p = 0;
        for (long k = 8 * g; k < 8 * g + 8 && k < j->K; k++) p += (int32_t)t[(c[k >> 1] >> ((k & 1) * 4)) & 15] * xq[k];
        a[g % Q8_LANES] = fmaf(dg[g], (float)p, a[g % Q8_LANES]);
      }
      j->y[m * j->ldy + n] = j->qs[n] * q8_tree(a);
    }
  }
}

/* the 8-bit dense form: row n's int8 weights w[n, k] = q[n, idx(n, k)] at j->qt + n * j->ldc in the q8 order
   (per 128 columns [the 64 even | the 64 odd], zero to Kq); every Kq / 8 octets (the zero ones add +0) */
static void rows_q8w_c(const job_t *j, long n0, long n1) {
  const long ng = j->Kq / 8;
  for (long n = n0; n < n1; n++) {
    const int8_t *w = j->qt + n * j->ldc;
    for (long m = 0; m < j->M; m++) {
      const int8_t *xq = j->xq + m * j->Kq;
      const float *dg = j->dg + m * ng;
      float a[Q8_LANES];
      for (int i = 0; i < Q8_LANES; i++) a[i] = 0.0f;
      for (long g = 0; g < ng; g++) {
        int32_t p = 0;
        for (long k = 8 * g; k < 8 * g + 8; k++) {
          const long at = (k / 128) * 128 + (k & 1) * 64 + (k % 128) / 2;
          p += (int32_t)w[at] * xq[at];
        }
        a[g % Q8_LANES] = fmaf(dg[g], (float)p, a[g % Q8_LANES]);
      }
      j->y[m * j->ldy + n] = j->qs[n] * q8_tree(a);
    }
  }
}

#if TP_X86
/* ---------------------------------------------------------------- AVX2 path */
#define TQ2 "avx2,fma"

/* q8_tree's last step on h[0..7] in a register: ((h0 + h4) + (h2 + h6)) + ((h1 + h5) + (h3 + h7)) */
__attribute__((target(TQ2))) static inline float q8_hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

/* the code bytes of chunk (base p, nbytes wanted) where they lie, or copied into the zeroed tail buffer */
static inline const uint8_t *q8_bytes(const uint8_t *p, long want, long have, uint8_t *tail) {
  if (have >= want) return p;
  memset(tail, 0, (size_t)want);
  if (have > 0) memcpy(tail, p, (size_t)have);
  return tail;
}

__attribute__((target(TQ2))) static void rows_q8_avx2(const job_t *j, long n0, long n1) {
  const long nc = (j->K + 63) / 64, ng = j->Kq / 8, nbytes = (j->K + 1) / 2;
  const __m256i m4 = _mm256_set1_epi8(15), one16 = _mm256_set1_epi16(1);
  uint8_t tail[32];
  for (long n = n0; n < n1; n++) {
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(j->qt + n * 16)));
    const uint8_t *c = j->codes + n * j->ldc;
    for (long m = 0; m < j->M; m++) {
      const int8_t *xq = j->xq + m * j->Kq;
      const float *dg = j->dg + m * ng;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;  /* chunk c into a(c % 4) */
#define CHUNK_AVX2(C, A)                                                                                     \
  do {                                                                                                       \
    const uint8_t *p = q8_bytes(c + (C) * 32, 32, nbytes - (C) * 32, tail);                                  \
    if (!((C) & 1)) _mm_prefetch((const char *)(c + (C) * 32) + PF, _MM_HINT_T0);                            \
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);                                                \
    const __m256i wl = _mm256_shuffle_epi8(tab, _mm256_and_si256(v, m4));                                    \
    const __m256i wh = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));              \
    const __m256i xe = _mm256_loadu_si256((const __m256i *)(xq + (C) * 64));                                 \
    const __m256i xo = _mm256_loadu_si256((const __m256i *)(xq + (C) * 64 + 32));                            \
    const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wl), _mm256_sign_epi8(xe, wl)), one16); \
    const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wh), _mm256_sign_epi8(xo, wh)), one16); \
    A = _mm256_fmadd_ps(_mm256_loadu_ps(dg + (C) * 8), _mm256_cvtepi32_ps(_mm256_add_epi32(pl, ph)), A);     \
  } while (0)
      long ch = 0;
      for (; ch + 4 <= nc; ch += 4) { CHUNK_AVX2(ch, a0); CHUNK_AVX2(ch + 1, a1); CHUNK_AVX2(ch + 2, a2); CHUNK_AVX2(ch + 3, a3); }
      if (ch < nc) CHUNK_AVX2(ch, a0);
      if (ch + 1 < nc) CHUNK_AVX2(ch + 1, a1);
      if (ch + 2 < nc) CHUNK_AVX2(ch + 2, a2);
#undef CHUNK_AVX2
      j->y[m * j->ldy + n] = j->qs[n] * q8_hsum8(_mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3)));
    }
  }
}

/* the 8-bit dense form: 64 columns a step (chunk C: half C % 2 of 128-column group C / 2, its 32 even and 32 odd
   columns), the octets' P as the 4-bit chunk forms them, the same float part */
__attribute__((target(TQ2))) static void rows_q8w_avx2(const job_t *j, long n0, long n1) {
  const long nc = j->Kq / 64, ng = j->Kq / 8;
  const __m256i one16 = _mm256_set1_epi16(1);
  for (long n = n0; n < n1; n++) {
    const int8_t *w = j->qt + n * j->ldc;
    for (long m = 0; m < j->M; m++) {
      const int8_t *xq = j->xq + m * j->Kq;
      const float *dg = j->dg + m * ng;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;  /* chunk c into a(c % 4) */
#define CHUNKW_AVX2(C, A)                                                                                    \
  do {                                                                                                       \
    const long at = ((C) >> 1) * 128 + ((C) & 1) * 32;                                                       \
    if (!((C) & 1)) _mm_prefetch((const char *)(w + at) + PF, _MM_HINT_T0);                                  \
    if (!((C) & 1)) _mm_prefetch((const char *)(w + at) + PF + 64, _MM_HINT_T0);                             \
    const __m256i we = _mm256_loadu_si256((const __m256i *)(w + at));                                        \
    const __m256i wo = _mm256_loadu_si256((const __m256i *)(w + at + 64));                                   \
    const __m256i xe = _mm256_loadu_si256((const __m256i *)(xq + at));                                       \
    const __m256i xo = _mm256_loadu_si256((const __m256i *)(xq + at + 64));                                  \
    const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(we), _mm256_sign_epi8(xe, we)), one16); \
    const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wo), _mm256_sign_epi8(xo, wo)), one16); \
    A = _mm256_fmadd_ps(_mm256_loadu_ps(dg + (C) * 8), _mm256_cvtepi32_ps(_mm256_add_epi32(pl, ph)), A);     \
  } while (0)
      long ch = 0;
      for (; ch + 4 <= nc; ch += 4) { CHUNKW_AVX2(ch, a0); CHUNKW_AVX2(ch + 1, a1); CHUNKW_AVX2(ch + 2, a2); CHUNKW_AVX2(ch + 3, a3); }
      if (ch < nc) CHUNKW_AVX2(ch, a0); /* nc is even: 0 or 2 chunks are left */
      if (ch + 1 < nc) CHUNKW_AVX2(ch + 1, a1);
#undef CHUNKW_AVX2
      j->y[m * j->ldy + n] = j->qs[n] * q8_hsum8(_mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3)));
    }
  }
}

/* ---------------------------------------------------------------- AVX-512 path (with or without VNNI) */
#define TQ5 "avx512f,avx512bw,avx512vl,avx2,fma"
#define TQ5V TQ5 ",avx512vnni"

/* P of the 16 octets of 128 columns (int32 [16]) from their 64 code bytes v: VNNI form (tab: q + 128, unsigned;
   xc: -128 * the octets' sums of xq) */
__attribute__((target(TQ5V), always_inline)) static inline __m512i p16_vnni(__m512i tab, __m512i v, const int8_t *x,
                                                                           const int32_t *xc) {
  const __m512i m4 = _mm512_set1_epi8(15);
  const __m512i ul = _mm512_shuffle_epi8(tab, _mm512_and_si512(v, m4));
  const __m512i uh = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)xc), ul,
                                                 _mm512_loadu_si512((const void *)x)),
                             uh, _mm512_loadu_si512((const void *)(x + 64)));
}

/* the same integers without VNNI (tab: q, signed): vpmaddubsw(|w|, xq negated where w < 0) + vpmaddwd */
__attribute__((target(TQ5), always_inline)) static inline __m512i p16_bw(__m512i tab, __m512i v, const int8_t *x,
                                                                        const int32_t *xc) {
  (void)xc;
  const __m512i m4 = _mm512_set1_epi8(15), one16 = _mm512_set1_epi16(1), z = _mm512_setzero_si512();
  const __m512i wl = _mm512_shuffle_epi8(tab, _mm512_and_si512(v, m4));
  const __m512i wh = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
  const __m512i xe = _mm512_loadu_si512((const void *)x), xo = _mm512_loadu_si512((const void *)(x + 64));
  const __m512i se = _mm512_mask_sub_epi8(xe, _mm512_movepi8_mask(wl), z, xe);
  const __m512i so = _mm512_mask_sub_epi8(xo, _mm512_movepi8_mask(wh), z, xo);
  return _mm512_add_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(wl), se), one16),
                          _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(wh), so), one16));
}

/* rows n0 .. n1 - 1: full 128-column chunks c into accumulator c % 2, then a last 64 columns as a masked half */
#define ROWS_Q8_512(NAME, TARGET, PFN, FLIP)                                                                   \
  __attribute__((target(TARGET))) static void NAME(const job_t *j, long n0, long n1) {                        \
    const long n64 = (j->K + 63) / 64, full = n64 / 2, ng = j->Kq / 8, nbytes = (j->K + 1) / 2;               \
    const long inrow = nbytes / 64 < full ? nbytes / 64 : full; /* full chunks whose 64 bytes lie in the row */ \
    const int half = (int)(n64 & 1);                                                                           \
    uint8_t tail[64];                                                                                          \
    for (long n = n0; n < n1; n++) {                                                                           \
      __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(j->qt + n * 16)));               \
      if (FLIP) tab = _mm512_xor_si512(tab, _mm512_set1_epi8((char)0x80));                                     \
      const uint8_t *c = j->codes + n * j->ldc;                                                                \
      for (long m = 0; m < j->M; m++) {                                                                        \
        const int8_t *xq = j->xq + m * j->Kq;                                                                  \
        const float *dg = j->dg + m * ng;                                                                      \
        const int32_t *xc = j->xc + m * ng;                                                                    \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0; /* chunk c into a(c % 2) */                                  \
        long ch = 0;                                                                                           \
        for (; ch < full; ch++) {                                                                              \
          _mm_prefetch((const char *)(c + ch * 64) + PF, _MM_HINT_T1);                                         \
          const uint8_t *p8 = ch < inrow ? c + ch * 64 : q8_bytes(c + ch * 64, 64, nbytes - ch * 64, tail);   \
          const __m512i p = PFN(tab, _mm512_loadu_si512((const void *)p8), xq + ch * 128, xc + ch * 16);      \
          const __m512 f = _mm512_cvtepi32_ps(p), d = _mm512_loadu_ps(dg + ch * 16);                           \
          if (ch & 1) a1 = _mm512_fmadd_ps(d, f, a1); else a0 = _mm512_fmadd_ps(d, f, a0);                     \
        }                                                                                                      \
        if (half) { /* octets 16 ch .. 16 ch + 7; the upper 8 lanes of the accumulator left as they are */     \
          const uint8_t *p8 = q8_bytes(c + ch * 64, 32, nbytes - ch * 64, tail);                              \
          const __m512i v = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)p8));                  \
          const __m512i p = PFN(tab, v, xq + ch * 128, xc + ch * 16);                                          \
          const __m512 f = _mm512_cvtepi32_ps(p), d = _mm512_loadu_ps(dg + ch * 16);                           \
          if (ch & 1) a1 = _mm512_mask3_fmadd_ps(d, f, a1, (__mmask16)0x00ff);                                 \
          else a0 = _mm512_mask3_fmadd_ps(d, f, a0, (__mmask16)0x00ff);                                        \
        }                                                                                                      \
        const __m512 h = _mm512_add_ps(a0, a1); /* lanes l, 8 + l: acc[l] + acc[16 + l], acc[8 + l] + acc[24 + l] */ \
        j->y[m * j->ldy + n] = j->qs[n] * q8_hsum8(_mm256_add_ps(_mm512_castps512_ps256(h),                   \
                                                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(h), 1)))); \
      }                                                                                                        \
    }                                                                                                          \
  }
ROWS_Q8_512(rows_q8_512v, TQ5V, p16_vnni, 1)
ROWS_Q8_512(rows_q8_512, TQ5, p16_bw, 0)
#undef ROWS_Q8_512

/* P of the 16 octets of one 128-column group of the 8-bit dense form (w: its 64 even | 64 odd int8 weights) */
__attribute__((target(TQ5V), always_inline)) static inline __m512i pw16_vnni(const int8_t *w, const int8_t *x,
                                                                            const int32_t *xc) {
  const __m512i flip = _mm512_set1_epi8((char)0x80); /* w + 128, unsigned */
  const __m512i ue = _mm512_xor_si512(_mm512_loadu_si512((const void *)w), flip);
  const __m512i uo = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + 64)), flip);
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)xc), ue,
                                                 _mm512_loadu_si512((const void *)x)),
                             uo, _mm512_loadu_si512((const void *)(x + 64)));
}

__attribute__((target(TQ5), always_inline)) static inline __m512i pw16_bw(const int8_t *w, const int8_t *x,
                                                                         const int32_t *xc) {
  (void)xc;
  const __m512i one16 = _mm512_set1_epi16(1), z = _mm512_setzero_si512();
  const __m512i we = _mm512_loadu_si512((const void *)w), wo = _mm512_loadu_si512((const void *)(w + 64));
  const __m512i xe = _mm512_loadu_si512((const void *)x), xo = _mm512_loadu_si512((const void *)(x + 64));
  const __m512i se = _mm512_mask_sub_epi8(xe, _mm512_movepi8_mask(we), z, xe);
  const __m512i so = _mm512_mask_sub_epi8(xo, _mm512_movepi8_mask(wo), z, xo);
  return _mm512_add_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(we), se), one16),
                          _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(wo), so), one16));
}

/* the 8-bit dense form, rows n0 .. n1 - 1: group c (128 columns) into accumulator c % 2 */
#define ROWS_Q8W_512(NAME, TARGET, PFN)                                                                        \
  __attribute__((target(TARGET))) static void NAME(const job_t *j, long n0, long n1) {                        \
    const long nch = j->Kq / 128, ng = j->Kq / 8;                                                              \
    for (long n = n0; n < n1; n++) {                                                                           \
      const int8_t *w = j->qt + n * j->ldc;                                                                    \
      for (long m = 0; m < j->M; m++) {                                                                        \
        const int8_t *xq = j->xq + m * j->Kq;                                                                  \
        const float *dg = j->dg + m * ng;                                                                      \
        const int32_t *xc = j->xc + m * ng;                                                                    \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;                                                              \
        for (long ch = 0; ch < nch; ch++) {                                                                    \
          _mm_prefetch((const char *)(w + ch * 128) + PF, _MM_HINT_T1);                                        \
          _mm_prefetch((const char *)(w + ch * 128) + PF + 64, _MM_HINT_T1);                                   \
          const __m512i p = PFN(w + ch * 128, xq + ch * 128, xc + ch * 16);                                    \
          const __m512 f = _mm512_cvtepi32_ps(p), d = _mm512_loadu_ps(dg + ch * 16);                           \
          if (ch & 1) a1 = _mm512_fmadd_ps(d, f, a1); else a0 = _mm512_fmadd_ps(d, f, a0);                     \
        }                                                                                                      \
        const __m512 h = _mm512_add_ps(a0, a1);                                                                \
        j->y[m * j->ldy + n] = j->qs[n] * q8_hsum8(_mm256_add_ps(_mm512_castps512_ps256(h),                   \
                                                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(h), 1)))); \
      }                                                                                                        \
    }                                                                                                          \
  }
ROWS_Q8W_512(rows_q8w_512v, TQ5V, pw16_vnni)
ROWS_Q8W_512(rows_q8w_512, TQ5, pw16_bw)
#undef ROWS_Q8W_512
#endif

static volatile int q8_no_vnni; /* tp_q8_no_vnni: the AVX-512 form without VNNI where VNNI is present (tests) */

/* Turns the AVX-512 VNNI form off (on != 0) or back on; returns whether calls use it now. The same integers,
   so the same bits either way: the tests check it on machines that have VNNI. */
int tp_q8_no_vnni(int on) {
  q8_no_vnni = on != 0;
#if TP_X86
  __builtin_cpu_init();
  return !q8_no_vnni && __builtin_cpu_supports("avx512vnni");
#else
  return 0;
#endif
}

/* output rows n0 .. n1 - 1 of an int8 job (j->qt set): the path's form of the integers P */
void tp_rows_q8(const job_t *j, long n0, long n1) {
  if (j->bits == 8) { /* the dense form */
#if TP_X86
    if (j->path >= PATH_AVX512) {
      if (!q8_no_vnni && __builtin_cpu_supports("avx512vnni")) rows_q8w_512v(j, n0, n1); else rows_q8w_512(j, n0, n1);
      return;
    }
    if (j->path == PATH_AVX2) { rows_q8w_avx2(j, n0, n1); return; }
#endif
    rows_q8w_c(j, n0, n1);
    return;
  }
#if TP_X86
  if (j->path >= PATH_AVX512) {
    if (!q8_no_vnni && __builtin_cpu_supports("avx512vnni")) rows_q8_512v(j, n0, n1); else rows_q8_512(j, n0, n1);
    return;
  }
  if (j->path == PATH_AVX2) { rows_q8_avx2(j, n0, n1); return; }
#endif
  rows_q8_c(j, n0, n1);
}
