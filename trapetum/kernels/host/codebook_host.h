/* Shared declarations of the host GEMV's sources (codebook_host.c: the portable and AVX2 paths, the path choice
   and the entry points; codebook_host_512.c: the AVX-512 paths). codebook_host.c's file comment has the design
   and the contracts. */
#pragma once
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
static inline float h2f(uint16_t h) {
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
static inline uint16_t f2h(float f) {
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
  /* the int8 numerics (codebook_host_q8.c; qt NULL: the fp32 mode above): the rows' int8 tables qt [N, 16] and
     scales qs [N] (8-bit: qt the dense int8 weights [N, ldc >= Kq] in the q8 order, codes unused); x quantized
     once per call: xq [M, Kq] in the path's order (8-bit: the q8 order), dg / xc [M, Kq / 8] per octet */
  const int8_t *qt; const float *qs;
  const int8_t *xq; const float *dg; const int32_t *xc; long Kq;
} job_t;

/* a call over several weights of one input (tp_gemv_multi): segment s holds global rows off[s] .. off[s+1]-1 */
#define MAX_SEGS 4
typedef struct {
  job_t seg[MAX_SEGS];  /* each segment's job: its codes, codebooks, N and y already offset to its columns */
  long off[MAX_SEGS + 1];
  int nseg;
  long N;               /* all rows */
} multi_t;

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

/* GGUF's legacy blocks (ggml_host.c) as segments of tp_gemv_multi: `bits` TP_BITS_GGML, a segment (blocks pointer,
   row bytes, 0, N, 0, type, 0, 0), its x the caller's fp32 rows as they are (no prepare) */
#define TP_BITS_GGML 32
void tp_ggml_rows(const float *x, long ldx, long M, long K, const uint8_t *blocks, long ldb, int type, int path,
                  float *y, long ldy, long n0, long n1);
int tp_ggml_block_bytes(int type);  /* bytes a block of the type, 0: not one ggml_host.c reads */
int tp_ggml_block_elems(int type);  /* weights a block: 32 (legacy types), 256 (Q4_K, Q6_K) */

/* the int8 numerics (codebook_host_q8.c): x quantized once per call, then the output rows n0 .. n1 - 1 */
int tp_q8_prepare(const float *x, long ldx, long M, long K, int path, int8_t *xq, float *dg, int32_t *xc);
int tp_q8_prepare_span(const float *x, long ldx, long M, long K, long span, int8_t *xq, float *dg, int32_t *xc);
void tp_rows_q8(const job_t *j, long n0, long n1);

#if TP_X86
/* the AVX-512 paths (codebook_host_512.c): output rows n0 .. n1 - 1 of job j */
void tp_rows_512(const job_t *j, long n0, long n1);   /* avx512 */
void tp_rows_vbmi(const job_t *j, long n0, long n1);  /* avx512vbmi */
void tp_rows_spr(const job_t *j, long n0, long n1);   /* avx512fp16 */
#endif
