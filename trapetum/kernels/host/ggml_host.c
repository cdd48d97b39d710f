/* Host (CPU) GEMV of GGUF block-quantized weights (legacy blocks of 32 and the K-quants Q4_K / Q6_K, superblocks
   of 256), read where they lie (kernels/ggml_host.py).

   y[m, n] = sum_k x[m, k] * w[n, k]     x fp32 [M, K] (row stride ldx), y fp32 [M, N] (row stride ldy)
   blocks: uint8 [N, ldb >= K / E * bytes], row n = its K / E blocks of E weights (E = 32, or 256 for the K-quants),
   as a GGUF file stores them (d, m, dmin: little-endian fp16; legacy: element j < 16 in the low nibble of qs[j],
   element j + 16 in its high nibble):
     type 0 Q4_0  18 bytes: d, qs[16]            w = d * (q - 8)
     type 1 Q4_1  20 bytes: d, m, qs[16]         w = d * q + m       (d * q is exact: one rounding, fmaf(d, q, m))
     type 2 Q5_0  22 bytes: d, qh (uint32 LE: bit j = bit 4 of element j), qs[16]; q = nibble | bit << 4,
                                                 w = d * (q - 16)
     type 3 Q8_0  34 bytes: d, q[32] int8        w = d * q
     type 4 Q4_K 144 bytes (256 weights, 8 sub-blocks j of 32): d, dmin, scales[12], qs[128]. scales: 6-bit sc_j
                  and m_j (llama.cpp's get_scale_min_k4: j < 4: sc_j = s[j] & 63, m_j = s[j + 4] & 63; j >= 4:
                  sc_j = s[j + 4] & 15 | (s[j - 4] >> 6) << 4, m_j = s[j + 4] >> 4 | (s[j] >> 6) << 4); element
                  32 j + l (l < 32): q = nibble of qs[32 (j / 2) + l], low for even j, high for odd;
                  w = (d sc_j) q - dmin m_j  (d sc_j, (d sc_j) q and dmin m_j exact: one rounding,
                  fmaf(d sc_j, q, -(dmin m_j)))
     type 5 Q6_K 210 bytes (256 weights): ql[128], qh[64], scales[16] int8, d. Element 128 h + 32 s + l (h < 2,
                  s < 4, l < 32): q = (ql[64 h + 32 (s & 1) + l] >> 4 (s / 2)) & 15 | ((qh[32 h + l] >> 2 s) & 3) << 4;
                  w = (d scales[k / 16]) (q - 32)  (exact)
   Every w is an fp32 value fixed by the bytes, bitwise gguf.quants.dequantize's (the products of an fp16 d with
   these q are exact in fp32; Q4_1's and Q4_K's sums their one rounding); tp_ggml_dequant writes them.

   Numerics, one fixed definition on every path and type: 16 fp32 lane accumulators acc[l] = +0; for each weight k
   of the row in order: acc[k % 16] = fmaf(w_k, x_k, acc[k % 16]) (lane l: k = l, l + 16, l + 32, ..); then
   h[l] = acc[l] + acc[l + 8] (l < 8) and y = ((h0 + h4) + (h2 + h6)) + ((h1 + h5) + (h3 + h7)).
   Contracts (tests/test_ggml_host.py):
   - every code path gives these bits: portable C (path 0, libm fmaf), AVX2 + FMA (1: 32 weights as four ymm of 8,
     two accumulators of lanes 0..7 / 8..15), AVX-512 F/BW/VL (2 and higher: two zmm of 16, one accumulator; the
     4-bit types' 16 (Q5_0: 32) values d (i - c) or d i + m formed once a block (Q4_K: a sub-block), looked up by
     the nibbles with vpermps / vpermt2ps), chosen at run time; path < 0: tp_path(); a path is capped at what the
     CPU runs. The K-quants: a superblock's 16 fp32 scales (Q4_K: d sc_j, -dmin m_j; Q6_K: d scales[i]) and Q6_K's
     256 q - 32 as int8 decoded once per row into stack buffers, then 8 runs of 32 weights as the legacy blocks
     (AVX2: Q4_K's w = fmaf(d sc_j, q, -dmin m_j) from the nibbles; Q6_K's (d sc) (q - 32); AVX-512: Q4_K a pair
     of sub-blocks from one load of their 32 bytes, each with its table of 16; Q6_K as AVX2);
   - batch invariance: row m of y is bitwise a call with x[m] alone, for every M: rows of x in register groups of
     up to 4 sharing a decoded block, up to 8 weight rows a step (independent FMA chains), each output its own
     one-row sequence;
   - threads: output rows are split over the pool (host/host_pool.c), each element computed by one thread in
     its fixed order: identical for every thread count, schedule and run to run.
   Software prefetch two steps ahead (2 NR rows down), the line of every block's last byte (a superblock: its bytes
   0, 64, 128 (, 192), at most 64 apart along the row, so every line; spread over the superblock's runs, not
   issued together at its start: Q4_K at 640 x 2048 and 16384 x 4096 14.5-20.7 GB/s against 17.1-21.6, noisy):
   codebook PF's 4096 bytes ahead ran a 38 MB Q4_0 matrix at 7.7 GB/s against 22 here, once per 64 bytes the
   30 MB Q8_0 head at 27 against 37 (Zen 5, one thread; without any, a 38 MB Q4_K ran at 15 GB/s against 19, a
   55 MB Q6_K at 11 against 19). Nothing is allocated; returns 0 or -1 (bad arguments).
   Build: codebook_host.c's flags (-ffp-contract=off: every FMA is an explicit fmaf or intrinsic). */
#include "codebook_host.h"

enum { GQ4_0 = 0, GQ4_1 = 1, GQ5_0 = 2, GQ8_0 = 3, GQ4_K = 4, GQ6_K = 5, GTYPES = 6 };
static const int gg_bytes[GTYPES] = {18, 20, 22, 34, 144, 210};
static const int gg_elems[GTYPES] = {32, 32, 32, 32, 256, 256}; /* weights a block */
#define GG_KQ(t) ((t) == GQ4_K || (t) == GQ6_K)

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

/* Q4_K's 8 six-bit scales sc_j, then its 8 mins m_j, as bytes u[0..15] from scales[12] s (llama.cpp's
   get_scale_min_k4, four at a time) */
static inline void k4_scale_bytes(const uint8_t *s, uint8_t *u) {
  uint32_t a[3], r[4];
  memcpy(a, s, 12);
  r[0] = a[0] & 0x3f3f3f3fu;                                               /* sc_0..3 = s[j] & 63 */
  r[1] = (a[2] & 0x0f0f0f0fu) | ((a[0] >> 6) & 0x03030303u) << 4;          /* sc_4..7 */
  r[2] = a[1] & 0x3f3f3f3fu;                                               /* m_0..3 = s[j + 4] & 63 */
  r[3] = ((a[2] >> 4) & 0x0f0f0f0fu) | ((a[1] >> 6) & 0x03030303u) << 4;   /* m_4..7 */
  memcpy(u, r, 16);
}

/* superblock p's 256 weights (Q4_K, Q6_K: the fp32 values of the file comment) into w */
static void sblock_c(const uint8_t *p, int type, float *w) {
  if (type == GQ4_K) { /* (d sc) q exact: the add is the one rounding of fmaf(d sc, q, -(dmin m)) */
    const float d = gg_h(p), dmin = gg_h(p + 2);
    uint8_t u[16];
    k4_scale_bytes(p + 4, u);
    for (int j = 0; j < 8; j++) {
      const float ds = d * (float)u[j], mn = -(dmin * (float)u[8 + j]);
      const uint8_t *qs = p + 16 + 32 * (j >> 1);
      const int sh = 4 * (j & 1);
      for (int l = 0; l < 32; l++) w[32 * j + l] = ds * (float)((qs[l] >> sh) & 15) + mn;
    }
    return;
  }
  const uint8_t *ql = p, *qh = p + 128;
  const int8_t *sc = (const int8_t *)(p + 192);
  const float d = gg_h(p + 208);
  for (int k = 0; k < 256; k++) {
    const int h = k >> 7, s = (k >> 5) & 3, l = k & 31;
    const int q = ((ql[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 15) | ((qh[32 * h + l] >> (2 * s)) & 3) << 4;
    w[k] = (d * (float)sc[k >> 4]) * (float)(q - 32);
  }
}

static void rows_c(const gg_job_t *j, long n0, long n1) {
  const int bs = gg_bytes[j->type], E = gg_elems[j->type];
  const long nb = j->K / E;
  float w[256];
  for (long n = n0; n < n1; n++) {
    const uint8_t *row = j->b + n * j->ldb;
    for (long m0 = 0; m0 < j->M; m0 += 4) {
      const int R = j->M - m0 < 4 ? (int)(j->M - m0) : 4;
      float acc[4][16] = {{0}};
      for (long b = 0; b < nb; b++) {
        if (E == 256) sblock_c(row + b * bs, j->type, w);
        else block_c(row + b * bs, j->type, w);
        for (int r = 0; r < R; r++) {
          const float *x = j->x + (m0 + r) * j->ldx + b * E;
          for (int i = 0; i < E; i++) acc[r][i & 15] = fmaf(w[i], x[i], acc[r][i & 15]);
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

/* Q4_K superblock p's sc_0..7, m_0..7 as bytes (k4_scale_bytes, the four dwords at once; the 16-byte load reads
   4 bytes of qs, unused) */
T2 __m128i k4_scales(const uint8_t *p) {
  const __m128i a = _mm_loadu_si128((const __m128i *)(p + 4));          /* dwords a0, a1, a2 */
  const __m128i P = _mm_shuffle_epi32(a, _MM_SHUFFLE(2, 1, 2, 0));    /* a0, a2, a1, a2 */
  const __m128i Q = _mm_shuffle_epi32(a, _MM_SHUFFLE(1, 1, 0, 0));    /* a0, a0, a1, a1 */
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(P, _mm_setr_epi32(0, 0, 0, 4)),
                                   _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  return _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi32(Q, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
}

/* Q4_K superblock p's d and -dmin as fp32 lanes 0, 1 */
T2 __m128 k4_dm(const uint8_t *p) {
  int dd;
  memcpy(&dd, p, 4);
  return _mm_xor_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(dd)), _mm_setr_ps(0.0f, -0.0f, 0.0f, 0.0f));
}

/* Q6_K superblock p's 256 q - 32 as int8 into qb, element order (run 32 s of half h: ql's low / high nibbles by s,
   qh's bits 2 s, 2 s + 1 as bits 4, 5; the 16-bit shifts' stray bits masked off) */
T2 void q6_bytes(const uint8_t *p, int8_t *qb) {
  const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
  for (int h = 0; h < 2; h++) {
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
    const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
    __m256i *o = (__m256i *)(qb + 128 * h);
    _mm256_storeu_si256(o, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l0, m4),
                                                           _mm256_and_si256(_mm256_slli_epi16(q, 4), m30)), c32));
    _mm256_storeu_si256(o + 1, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l1, m4),
                                                               _mm256_and_si256(_mm256_slli_epi16(q, 2), m30)), c32));
    _mm256_storeu_si256(o + 2, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                                               _mm256_and_si256(q, m30)), c32));
    _mm256_storeu_si256(o + 3, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                                               _mm256_and_si256(_mm256_srli_epi16(q, 2), m30)), c32));
  }
}

/* a K-quant superblock p decoded once per row: sc[16] fp32 (Q4_K: d sc_j for j < 8, then -(dmin m_j); Q6_K:
   d scales[i]) and (Q6_K) qb, q6_bytes */
T2 void sprep_avx2(const uint8_t *p, int type, float *sc, int8_t *qb) {
  if (type == GQ4_K) { /* d sc_j, then (-dmin) m_j: -(dmin m_j) exactly */
    const __m256 h = _mm256_castps128_ps256(k4_dm(p));
    const __m128i v = k4_scales(p);
    _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_permutevar8x32_ps(h, _mm256_setzero_si256()),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))));
    _mm256_storeu_ps(sc + 8, _mm256_mul_ps(_mm256_permutevar8x32_ps(h, _mm256_set1_epi32(1)),
                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))));
    return;
  }
  const __m256 d = d256(p + 208);
  const __m128i v = _mm_loadu_si128((const __m128i *)(p + 192));
  _mm256_storeu_ps(sc, _mm256_mul_ps(d, i8f(v)));
  _mm256_storeu_ps(sc + 8, _mm256_mul_ps(d, i8f(_mm_srli_si128(v, 8))));
  q6_bytes(p, qb);
}

/* run c (elements 32 c .. 32 c + 31) of a K-quant superblock p, its sprep state sc / qb: w[0..3] as block_avx2's */
T2 void schunk_avx2(const uint8_t *p, int type, const float *sc, const int8_t *qb, const int c, __m256 *w) {
  if (type == GQ4_K) { /* fmaf(d sc, q, -(dmin m)) */
    const __m256 ds = _mm256_broadcast_ss(sc + c), mn = _mm256_broadcast_ss(sc + 8 + c);
    const uint8_t *qs = p + 16 + 32 * (c >> 1);
    for (int v = 0; v < 4; v++) {
      __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * v)));
      q = c & 1 ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(15));
      w[v] = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(q), mn);
    }
    return;
  }
  for (int v = 0; v < 4; v++)
    w[v] = _mm256_mul_ps(_mm256_broadcast_ss(sc + 2 * c + (v >> 1)),
                         i8f(_mm_loadl_epi64((const __m128i *)(qb + 32 * c + 8 * v))));
}

T2 float tree256(__m256 lo, __m256 hi) { /* lanes 0..7 in lo, 8..15 in hi: the file comment's tree */
  const __m256 h = _mm256_add_ps(lo, hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)); /* h0 + h4, h1 + h5, .. */
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                        /* (h0 + h4) + (h2 + h6), .. */
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* kern_avx2 of the K-quants: per superblock each row's sprep, then its 8 runs of 32 as kern_avx2's blocks; the
   superblock 2 NR rows down prefetched every 64 bytes, one line a row with each even run (the next superblock's
   first within 64 bytes of the last: every line; the line of bs - 1 as well cost 2-4 % in cache, nothing out of
   it) */
T2 void kernk_avx2(const gg_job_t *j, long n, long m0, const int R, const int NR, const int type) {
  const int bs = gg_bytes[type];
  const long end = j->K / 256 * bs, ldb = j->ldb, pfd = 2 * NR * ldb;
  __m256 a0[8][4], a1[8][4];
  float sc[8][16];
  int8_t qb[8][256];
  for (int q = 0; q < NR; q++)
    for (int r = 0; r < R; r++) { a0[q][r] = _mm256_setzero_ps(); a1[q][r] = _mm256_setzero_ps(); }
  const uint8_t *rp[8];
  for (int q = 0; q < NR; q++) rp[q] = j->b + (n + q) * ldb;
  const float *xr[4];
  for (int r = 0; r < R; r++) xr[r] = j->x + (m0 + r) * j->ldx;
  for (long o = 0; o < end; o += bs) {
    for (int q = 0; q < NR; q++) sprep_avx2(rp[q] + o, type, sc[q], qb[q]);
    __asm__ volatile("" ::: "memory"); /* sc read back as broadcasts from memory */
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++)
      for (int q = 0; q < NR; q++) {
        if (!(c & 1) && 32 * c < bs) _mm_prefetch((const char *)rp[q] + o + pfd + 32 * c, _MM_HINT_T0);
        __m256 w[4];
        schunk_avx2(rp[q] + o, type, sc[q], qb[q], c, w);
        for (int r = 0; r < R; r++) {
          const float *x = xr[r] + 32 * c;
          a0[q][r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), a0[q][r]);
          a1[q][r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), a1[q][r]);
          a0[q][r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), a0[q][r]);
          a1[q][r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), a1[q][r]);
        }
      }
    for (int r = 0; r < R; r++) xr[r] += 256;
  }
  for (int q = 0; q < NR; q++)
    for (int r = 0; r < R; r++) j->y[(m0 + r) * j->ldy + n + q] = tree256(a0[q][r], a1[q][r]);
}

/* weight rows n .. n + NR - 1 against x rows m0 .. m0 + R - 1; each block prefetches the line of its last byte in
   the row 2 NR rows down (two steps ahead; every line of a row holds some block's last byte) */
T2 void kern_avx2(const gg_job_t *j, long n, long m0, const int R, const int NR, const int type) {
  if (GG_KQ(type)) { kernk_avx2(j, n, m0, R, NR, type); return; }
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

/* the K-quants: sprep_avx2's state (sc, qb) */
T5 void sprep_512(const uint8_t *p, int type, float *sc, int8_t *qb) {
  if (type == GQ4_K) {
    const __m512 dm = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                            _mm512_castps128_ps512(k4_dm(p))); /* d x 8, -dmin x 8 */
    _mm512_storeu_ps(sc, _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k4_scales(p)))));
    return;
  }
  uint16_t hd;
  memcpy(&hd, p + 208, 2);
  const __m512i s8 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 192)));
  _mm512_storeu_ps(sc, _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(hd)), _mm512_cvtepi32_ps(s8)));
  /* q6_bytes on 64 bytes at once: runs 0, 1 (ql's low nibbles; qh, qh >> 2 bits 0, 1), then runs 2, 3 (high
     nibbles; bits 4, 5 of qh, qh >> 2) */
  const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30), c32 = _mm512_set1_epi8(32);
  for (int h = 0; h < 2; h++) {
    const __m512i l = _mm512_loadu_si512((const void *)(p + 64 * h));
    const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
    const __m512i qq = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 2), 1);
    const __m512i b01 = _mm512_and_si512(_mm512_slli_epi16(qq, 4), m30), b23 = _mm512_and_si512(qq, m30);
    /* 0xea: (a & b) | c */
    _mm512_storeu_si512((void *)(qb + 128 * h), _mm512_sub_epi8(_mm512_ternarylogic_epi32(l, m4, b01, 0xea), c32));
    _mm512_storeu_si512((void *)(qb + 128 * h + 64),
                        _mm512_sub_epi8(_mm512_ternarylogic_epi32(_mm512_srli_epi16(l, 4), m4, b23, 0xea), c32));
  }
}

/* run c of a K-quant superblock p: w0 = elements 32 c .. 32 c + 15, w1 = the next 16 (Q4_K: the 16 values
   fmaf(d sc, i, -(dmin m)) formed once, looked up by the nibbles) */
T5 void schunk_512(const uint8_t *p, int type, const float *sc, const int8_t *qb, const int c, __m512 *w0,
                   __m512 *w1) {
  if (type == GQ4_K) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(sc[c]), iota, _mm512_set1_ps(sc[8 + c]));
    const uint8_t *qs = p + 16 + 32 * (c >> 1);
    __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    __m512i i1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
    if (c & 1) { i0 = _mm512_srli_epi32(i0, 4); i1 = _mm512_srli_epi32(i1, 4); } /* else the low 4 bits index */
    *w0 = _mm512_permutexvar_ps(i0, t);
    *w1 = _mm512_permutexvar_ps(i1, t);
    return;
  }
  *w0 = _mm512_mul_ps(_mm512_set1_ps(sc[2 * c]),
                      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + 32 * c)))));
  *w1 = _mm512_mul_ps(_mm512_set1_ps(sc[2 * c + 1]),
                      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + 32 * c + 16)))));
}

/* kern_512 of the K-quants (kernk_avx2's order and prefetches; Q4_K by pairs of runs, a line with each pair) */
T5 void kernk_512(const gg_job_t *j, long n, long m0, const int R, const int NR, const int type) {
  const int bs = gg_bytes[type];
  const long end = j->K / 256 * bs, ldb = j->ldb, pfd = 2 * NR * ldb;
  __m512 acc[8][4];
  float sc[8][16];
  int8_t qb[8][256];
  for (int q = 0; q < NR; q++)
    for (int r = 0; r < R; r++) acc[q][r] = _mm512_setzero_ps();
  const uint8_t *rp[8];
  for (int q = 0; q < NR; q++) rp[q] = j->b + (n + q) * ldb;
  const float *xr[4];
  for (int r = 0; r < R; r++) xr[r] = j->x + (m0 + r) * j->ldx;
  for (long o = 0; o < end; o += bs) {
    for (int q = 0; q < NR; q++) sprep_512(rp[q] + o, type, sc[q], qb[q]);
    __asm__ volatile("" ::: "memory"); /* sc read back as embedded broadcasts, not kept as 128 broadcast zmm */
    if (type == GQ4_K) { /* sub-blocks 2 i, 2 i + 1 together: one load of their nibbles */
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma GCC unroll 4
      for (int i = 0; i < 4; i++) {
        __m512 x[4][4];
        for (int r = 0; r < R; r++)
          for (int v = 0; v < 4; v++) x[r][v] = _mm512_loadu_ps(xr[r] + 64 * i + 16 * v);
        for (int q = 0; q < NR; q++) {
          if (64 * i < bs) _mm_prefetch((const char *)rp[q] + o + pfd + 64 * i, _MM_HINT_T0);
          const __m512 t0 = _mm512_fmadd_ps(_mm512_set1_ps(sc[q][2 * i]), iota, _mm512_set1_ps(sc[q][8 + 2 * i]));
          const __m512 t1 = _mm512_fmadd_ps(_mm512_set1_ps(sc[q][2 * i + 1]), iota, _mm512_set1_ps(sc[q][9 + 2 * i]));
          const uint8_t *qs = rp[q] + o + 16 + 32 * i;
          const __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
          const __m512i i1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
          const __m512 w0 = _mm512_permutexvar_ps(i0, t0), w1 = _mm512_permutexvar_ps(i1, t0);
          const __m512 w2 = _mm512_permutexvar_ps(_mm512_srli_epi32(i0, 4), t1);
          const __m512 w3 = _mm512_permutexvar_ps(_mm512_srli_epi32(i1, 4), t1);
          for (int r = 0; r < R; r++) {
            acc[q][r] = _mm512_fmadd_ps(w0, x[r][0], acc[q][r]);
            acc[q][r] = _mm512_fmadd_ps(w1, x[r][1], acc[q][r]);
            acc[q][r] = _mm512_fmadd_ps(w2, x[r][2], acc[q][r]);
            acc[q][r] = _mm512_fmadd_ps(w3, x[r][3], acc[q][r]);
          }
        }
      }
      for (int r = 0; r < R; r++) xr[r] += 256;
      continue;
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
      __m512 x0[4], x1[4];
      for (int r = 0; r < R; r++) {
        x0[r] = _mm512_loadu_ps(xr[r] + 32 * c);
        x1[r] = _mm512_loadu_ps(xr[r] + 32 * c + 16);
      }
      for (int q = 0; q < NR; q++) {
        if (!(c & 1) && 32 * c < bs) _mm_prefetch((const char *)rp[q] + o + pfd + 32 * c, _MM_HINT_T0);
        __m512 w0, w1;
        schunk_512(rp[q] + o, type, sc[q], qb[q], c, &w0, &w1);
        for (int r = 0; r < R; r++) {
          acc[q][r] = _mm512_fmadd_ps(w0, x0[r], acc[q][r]);
          acc[q][r] = _mm512_fmadd_ps(w1, x1[r], acc[q][r]);
        }
      }
    }
    for (int r = 0; r < R; r++) xr[r] += 256;
  }
  for (int q = 0; q < NR; q++)
    for (int r = 0; r < R; r++) j->y[(m0 + r) * j->ldy + n + q] = tree512(acc[q][r]);
}

T5 void kern_512(const gg_job_t *j, long n, long m0, const int R, const int NR, const int type) {
  if (GG_KQ(type)) { kernk_512(j, n, m0, R, NR, type); return; }
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
      case GQ4_K: NAME##_t(j, n0, n1, GQ4_K); break;                                                       \
      case GQ6_K: NAME##_t(j, n0, n1, GQ6_K); break;                                                       \
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
  if (GG_KQ(type)) {
    float sc[16];
    int8_t qb[256];
    for (long n = n0; n < n1; n++)
      for (long k = 0; k < K; k += 256) {
        const uint8_t *p = b + n * ldb + k / 256 * bs;
        float *o = out + (n - n0) * ldo + k;
        if (type == GQ4_K) sprep_avx2(p, GQ4_K, sc, qb); else sprep_avx2(p, GQ6_K, sc, qb);
        for (int c = 0; c < 8; c++) {
          __m256 w[4];
          if (type == GQ4_K) schunk_avx2(p, GQ4_K, sc, qb, c, w); else schunk_avx2(p, GQ6_K, sc, qb, c, w);
          for (int q = 0; q < 4; q++) _mm256_storeu_ps(o + 32 * c + 8 * q, w[q]);
        }
      }
    return;
  }
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
  if (GG_KQ(type)) {
    float sc[16];
    int8_t qb[256];
    for (long n = n0; n < n1; n++)
      for (long k = 0; k < K; k += 256) {
        const uint8_t *p = b + n * ldb + k / 256 * bs;
        float *o = out + (n - n0) * ldo + k;
        if (type == GQ4_K) sprep_512(p, GQ4_K, sc, qb); else sprep_512(p, GQ6_K, sc, qb);
        for (int c = 0; c < 8; c++) {
          __m512 w0, w1;
          if (type == GQ4_K) schunk_512(p, GQ4_K, sc, qb, c, &w0, &w1); else schunk_512(p, GQ6_K, sc, qb, c, &w0, &w1);
          _mm512_storeu_ps(o + 32 * c, w0); _mm512_storeu_ps(o + 32 * c + 16, w1);
        }
      }
    return;
  }
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

/* bytes a block of `type` (tp_ggml_block_elems weights), or 0 for a type this file does not read */
int tp_ggml_block_bytes(int type) { return type >= 0 && type < GTYPES ? gg_bytes[type] : 0; }

/* weights a block of `type`: 32 (legacy), 256 (K-quants), or 0 for a type this file does not read */
int tp_ggml_block_elems(int type) { return type >= 0 && type < GTYPES ? gg_elems[type] : 0; }

/* y [M, N] = x [M, K] times the block rows' weights transposed; path < 0: tp_path() */
int tp_ggml_gemv(const float *x, long ldx, long M, long K, const uint8_t *blocks, long ldb, int type, long N,
                 float *y, long ldy, int threads, int path) {
  if (type < 0 || type >= GTYPES || K < gg_elems[type] || K % gg_elems[type] || M < 0 || N < 0 || ldx < K
      || ldy < N) return -1;
  if (ldb < K / gg_elems[type] * gg_bytes[type]) return -1;
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
  if (type < 0 || type >= GTYPES || K < gg_elems[type] || K % gg_elems[type] || n0 < 0 || n1 < n0 || ldo < K)
    return -1;
  if (ldb < K / gg_elems[type] * gg_bytes[type]) return -1;
  if (n1 == n0) return 0;
  if (!blocks || !out) return -1;
#if TP_X86
  const int path = gg_path(-1);
  if (path == PATH_AVX512) { deq_512(blocks, ldb, type, n0, n1, K, out, ldo); return 0; }
  if (path == PATH_AVX2) { deq_avx2(blocks, ldb, type, n0, n1, K, out, ldo); return 0; }
#endif
  const int bs = gg_bytes[type], E = gg_elems[type];
  for (long n = n0; n < n1; n++)
    for (long k = 0; k < K; k += E) {
      if (E == 256) sblock_c(blocks + n * ldb + k / E * bs, type, out + (n - n0) * ldo + k);
      else block_c(blocks + n * ldb + k / E * bs, type, out + (n - n0) * ldo + k);
    }
  return 0;
}
