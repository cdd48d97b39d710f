"""Decode attention (one query token) over a KV cache: split-KV Triton kernel + float64 reference.

Layouts:
  q        fp16 [Hq, D]            (one token; Hq = G * Hkv, q head h reads kv head h // G as HF repeat_kv)
  k_cache  fp16 [Hkv, T_max, D]    (any strides with the last dim contiguous)
  v_cache  fp16 [Hkv, T_max, D]
  length   int or an integer CUDA tensor with one element: number of valid cache positions (the
           current token already appended). A tensor length keeps the launch graph-capturable: the
           grid depends only on T_max and programs past `length` exit at once.
Semantics: s = scale * q.k; with softcap c: s = c * tanh(s / c); with window w only positions
p >= length - w are visible (HF sliding window); softmax over visible positions; out = p @ v.

Split-KV: the cache is cut into chunks of `chunk` positions; one program per (kv head, chunk)
handles the G query heads of that kv head (K and V read once), walking its chunk `block_n`
positions at a time with an online softmax, and writes (max, sum, unnormalized out) to a
workspace; a second kernel merges the chunks of each head in a fixed order, `merge_chunks` chunks
per step loaded together (the first version's one dependent load per chunk made the merge, not the
KV reads, the larger part of the time at 4k positions), one program per (query head, slice of
`merge_d` columns) so that a few dozen heads still fill the GPU.
Adaptive chunks (AttnConfig.splits = P > 0, flash-decoding's "num_splits"): the grid is (Hkv, P) whatever
the length (P capped at ceil(T_max / chunk)), and each program's chunk follows the run-time length L: the
visible span, from the window start rounded down to a block_n boundary to L, is cut into chunks of
max(chunk, ceil(span / P) rounded up to block_n) positions, walked block_n at a time in a loop of run-time
trip count (pipelined over `stages`). Programs past the last chunk exit; the merge recomputes the chunk
count from the length. So one captured launch runs P long pipelined chunks per kv head at 4k and, at short
lengths, `chunk`-position chunks as the fixed split does (up to P of them).
The knobs live in an AttnConfig; `choose_config(D, G, T_max, Hkv)` picks one (`decode_attention(...,
config=...)` forces one: scripts/attn_sweep.py times the CANDIDATE_CONFIGS that way), and
`config_fits` is the static rule that keeps a config inside shared memory / registers for a head dim.
TRAPETUM_ATTN=seq selects the sequential kernel (one program per kv head walking every chunk), kept as
the reference path.

The decode step's path, `decode_attention_fused`, does one token's RoPE, KV append and attention in the
same split kernel (two constexpr switches), then the merge kernel; with inline_merge=True in one launch:
  ROPE    each program rotates the G query heads itself (un-roped q straight from the qkv GEMV); the
          program whose chunk holds the new position rotates k, writes k and v into the caches
          (fused.rope_append_kv: the bits rope_kv_append writes) and only then, after a CTA barrier,
          reads its chunk. Programs of other chunks cover older positions only, so no program reads
          that slot before it is written.
  MERGE   (inline merge) each program with visible positions (the others exit without counting) stores
          its partials, then adds 1 to its kv head's counter in the workspace (atomic, acq_rel, gpu
          scope, after a CTA barrier: the release covers every thread's stores); the program that
          arrives last (the count reaches the number of chunks with visible positions) merges the
          chunks of the G heads with the merge kernel's code (same chunk steps, same fixed order: the
          same bits whichever program arrives last), writes the output and sets the counter back to 0
          for the next call / replay.
Without MERGE (the default) the partials go to the merge kernel as before: on the H200 the inline merge
lost to it for GQA and at 4k positions (its last program merges G heads x 64 chunks one step after another;
NOTES-engine.md, session 5), so it is opt-in. Results are bitwise reproducible for a given config either way.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

from . import pdl  # programmatic dependent launch of the split and merge kernels
from .fused import check_rope_kv, rope_kv_append


CHUNK = 64  # positions per step of the sequential kernel (fixed: not an AttnConfig knob)
SEQ_STAGES = 3  # its num_stages (Triton's default, what it always ran with)
# finite "minus infinity": keeps exp(m_old - m_new) free of NaN (a constexpr: Triton kernels may
# only read globals that are constexpr)
_NEG = tl.constexpr(-1.0e30) if tl is not None else -1.0e30


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    """Launch configuration of the split-KV kernels.

    chunk         positions per split program = the workspace's chunk (one (max, sum, out) per chunk)
    block_n       positions loaded per step inside a split program (chunk is a multiple of it;
                  chunk > block_n makes an inner loop, software-pipelined over `stages`)
    warps         num_warps of the split kernel
    stages        num_stages of the split kernel (matters only with the inner loop)
    merge_chunks  largest number of chunks the merge folds in per step (capped at the chunk count)
    merge_warps   num_warps of the merge kernel
    merge_d       head-dim columns per merge program (0: the whole head, one program per head)
    splits        0: fixed chunks of `chunk` positions (grid Hkv x ceil(T_max / chunk)). P > 0: P programs
                  per kv head whose chunks adapt to the run-time length: ceil(span / P) positions rounded
                  up to block_n, at least `chunk` (an inner loop of a run-time trip count; module docstring)
    """
    chunk: int = 64
    block_n: int = 64
    warps: int = 4
    stages: int = 1
    merge_chunks: int = 16
    merge_warps: int = 4
    merge_d: int = 0
    splits: int = 0

    @property
    def name(self) -> str:
        s = (f"p{self.splits}" if self.splits else "") + f"c{self.chunk}"
        s += f"b{self.block_n}s{self.stages}" if _loops(self) else ""
        return s + f"-w{self.warps}-m{self.merge_chunks}w{self.merge_warps}d{self.merge_d or 'all'}"


LEGACY_CONFIG = AttnConfig()  # the kernel before configs: 64-position chunks, 4 warps, merge 16 per step
# 8 length-adaptive splits per kv head: 512-position chunks at 4k, the default's 64 at <= 512 positions
SPLIT8_CONFIG = AttnConfig(splits=8, chunk=64, block_n=64, stages=3, merge_chunks=64, merge_d=32)

# Explicit candidates timed by scripts/attn_sweep.py (and checked against float64 by the tests);
# the ones that break the rule for a head dim are skipped there.
CANDIDATE_CONFIGS = (
    LEGACY_CONFIG,
    AttnConfig(chunk=64, block_n=64, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=128, block_n=128, merge_chunks=16),
    AttnConfig(chunk=128, block_n=128, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=128, block_n=128, merge_chunks=64, merge_d=16),
    AttnConfig(chunk=128, block_n=128, warps=8, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=128, block_n=128, merge_chunks=64, merge_warps=8, merge_d=64),
    AttnConfig(chunk=256, block_n=64, stages=2, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=256, block_n=64, stages=3, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=512, block_n=64, stages=3, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=512, block_n=64, warps=8, stages=3, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=256, block_n=32, stages=3, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=256, block_n=128, warps=8, stages=2, merge_chunks=64, merge_d=32),
    # adaptive chunks (splits): one captured launch whose chunk length follows the run-time length
    AttnConfig(splits=4, chunk=64, block_n=64, stages=3, merge_chunks=64, merge_d=32),
    SPLIT8_CONFIG,
    AttnConfig(splits=16, chunk=64, block_n=64, stages=3, merge_chunks=64, merge_d=32),
    AttnConfig(splits=8, chunk=128, block_n=128, warps=8, stages=2, merge_chunks=64, merge_d=32),
)

# Static resource rule, a model of what Triton 3.6 allocates for sm_90 (calibrated by compiling the
# kernels ahead of time with the launch specialization: 16-aligned pointers and strides):
#  - a single tile stages K (block_n x BLOCK_D fp16) through shared memory for tl.dot: ~1.25x K
#    (64x128: 20 KiB, 128x128: 36 KiB, 128x256: 72 KiB), plus q and p once BLOCK_G grows past 16
#    (G = 64: 128x128 80 KiB, 64x256 96 KiB);
#  - a pipelined loop (stages >= 2) adds stages - 1 buffers of K and V (64x128, 2 / 3 stages: 38 /
#    70 KiB; 64x256: 74 / 138 KiB);
#  - more than 128 tile elements of K per thread (128x256 with 4 warps) made ptxas spill.
# The limit is 227 KiB per block; the rule keeps the estimate under SMEM_BUDGET. (The earlier report
# that 128-position chunks exceed shared memory at D = 256 came from the sequential kernel sharing
# CHUNK: a 3-stage loop over 128x256 tiles needs 268 KiB; the split kernel's 128x256 tile needs 72.)
SMEM_BUDGET = 192 * 1024
TILE_PER_THREAD = 128


def _block_d(d: int) -> int:
    return max(16, 1 << max(0, (int(d) - 1).bit_length()))


def _block_g(g: int) -> int:
    return max(16, 1 << max(0, (int(g) - 1).bit_length()))


def smem_estimate(block_n: int, d: int, stages: int = 1, loop: bool = False, g: int = 1) -> int:
    """The rule's model of the shared memory (bytes) of a kernel walking block_n x D tiles of K and V
    for g query heads (padded to BLOCK_G rows: q and p are staged for tl.dot too)."""
    bd, bg = _block_d(d), _block_g(g)
    k_tile = block_n * bd * 2
    est = k_tile * 5 // 4 + 2 * bg * bd * 2 + bg * block_n * 2 + 1024
    if loop and stages >= 2:
        est += (stages - 1) * 2 * k_tile
    return est


def config_fits(cfg: AttnConfig, d: int, g: int = 1) -> bool:
    """The static rule: cfg is well formed and stays inside shared memory / registers for head dim d."""
    def p2(x):
        return isinstance(x, int) and x >= 1 and x & (x - 1) == 0

    if not (p2(cfg.block_n) and 16 <= cfg.block_n <= 256 and p2(cfg.chunk) and cfg.chunk >= cfg.block_n):
        return False
    if not (cfg.warps in (2, 4, 8, 16) and cfg.merge_warps in (1, 2, 4, 8, 16) and 1 <= cfg.stages <= 4):
        return False
    if not (p2(cfg.merge_chunks) and cfg.merge_chunks <= 256 and (cfg.merge_d == 0 or p2(cfg.merge_d) and cfg.merge_d >= 16)):
        return False
    if not (cfg.splits == 0 or p2(cfg.splits) and cfg.splits <= 64):
        return False
    if smem_estimate(cfg.block_n, d, cfg.stages, _loops(cfg), g) > SMEM_BUDGET:
        return False
    return cfg.block_n * _block_d(d) <= TILE_PER_THREAD * 32 * cfg.warps


def choose_config(d: int, g: int, t_max: int, hkv: int | None = None, strict: bool = True) -> AttnConfig:
    """The config of a launch without one: the candidate named by TRAPETUM_ATTN_CONFIG (read at each call, so
    at graph capture; for benchmarks and experiments, e.g. `bench_e2e --attn-configs`), else _default_config.
    A named config that breaks the static rule for (d, g) is an error, or with strict=False (workspace
    sizing over group sizes no launch may use) the default."""
    name = os.environ.get("TRAPETUM_ATTN_CONFIG", "")
    if name:
        cfg = named_config(name)
        if config_fits(cfg, d, g):
            return cfg
        if strict:
            raise ValueError(f"TRAPETUM_ATTN_CONFIG: {name} does not fit head dim {d}, group size {g} (config_fits)")
    return _default_config(d, g, t_max, hkv)


def named_config(name: str) -> AttnConfig:
    """The candidate config called `name` (AttnConfig.name)."""
    by_name = {c.name: c for c in CANDIDATE_CONFIGS}
    if name not in by_name:
        raise ValueError(f"TRAPETUM_ATTN_CONFIG: unknown config {name!r}; candidates: {', '.join(by_name)}")
    return by_name[name]


@functools.lru_cache(maxsize=256)
def _default_config(d: int, g: int, t_max: int, hkv: int | None = None) -> AttnConfig:
    """The production config for head dim d, group size g, cache of t_max positions, hkv kv heads (None:
    unknown).

    At least 32 kv heads (MHA 32x128, e.g. Llama-2-7B): SPLIT8_CONFIG, 8 programs per kv head whose chunk
    follows the length. H200 (scripts/attn_sweep.py, session 6; the fused RoPE path the engine runs):
    4k positions 23.3 us against 25.2 for fixed 64-position chunks, 128 positions 7.4 against 7.5, but 1k
    11.6 against 10.8. Llama-2-7B 4-bit decode at 3968-4096 positions 392.6 -> 400.6 tok/s (bench_e2e
    --attn-configs, same run; BENCHMARKS.md). With 8 kv heads (GQA 32/8) 8 splits are 64 programs: 14.9 us at
    4k against 10.9, so fewer kv heads keep fixed_chunk_config.
    """
    if hkv is not None and hkv >= 32 and config_fits(SPLIT8_CONFIG, d, g):
        return SPLIT8_CONFIG
    return fixed_chunk_config(d, g)


@functools.lru_cache(maxsize=256)
def fixed_chunk_config(d: int, g: int) -> AttnConfig:
    """Fixed 64-position chunks, 4 warps, and a merge of up to 64 chunks per step with 32 columns per program
    (Hq * D / 32 programs instead of Hq): the fastest or within 6% of the fastest of the 13 candidates at every
    shape of the H200 sweep (2026-11-30 08:06 UTC), e.g. 4k-position GQA 32/8x128 14.1 -> 10.2 us, 8/4x256
    13.7 -> 10.1 us. Falls back to LEGACY_CONFIG if it would break the static rule for (d, g)."""
    cfg = AttnConfig(chunk=64, block_n=64, merge_chunks=64, merge_d=32)
    return cfg if config_fits(cfg, d, g) else LEGACY_CONFIG


def _divisors(n: int):
    return [k for k in range(1, n + 1) if n % k == 0]


def decode_attention_reference(q, k_cache, v_cache, length, *, scale, window=None, softcap=None):
    """float64 reference. Returns float64 [Hq, D]."""
    return decode_attention_torch(q, k_cache, v_cache, length, scale=scale, window=window, softcap=softcap,
                                  dtype=torch.float64)


def decode_attention_torch(q, k_cache, v_cache, length, *, scale, window=None, softcap=None, dtype=torch.float16):
    """The same computation in plain torch at `dtype` (the "same-dtype torch computation")."""
    L = int(length)
    g = q.shape[0] // k_cache.shape[0]
    k = k_cache[:, :L].to(dtype).repeat_interleave(g, 0)
    v = v_cache[:, :L].to(dtype).repeat_interleave(g, 0)
    s = torch.einsum("hd,hld->hl", q.to(dtype), k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if window is not None:
        pos = torch.arange(L, device=s.device)
        s = s.masked_fill(pos[None, :] < L - window, float("-inf"))
    p = torch.softmax(s, -1)
    return torch.einsum("hl,hld->hd", p, v)


if triton is not None:
    from .fused import rope_append_kv

    @triton.jit
    def _tanh(x):
        x = tl.minimum(tl.maximum(x, -15.0), 15.0)
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _load_len(len_ptr, len_val, LEN_PTR: tl.constexpr):
        if LEN_PTR:
            return tl.load(len_ptr).to(tl.int32)
        else:
            return len_val

    @triton.jit
    def _chunks(L, window, HAS_WIN: tl.constexpr, CH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr):
        # The first visible position lo, and the chunks c0 .. c1-1 that hold visible positions, chunk c
        # being [base + c * clen, base + (c + 1) * clen). SPLITS = 0: fixed chunks (base 0, clen = CH).
        # SPLITS = P: the span from base (lo rounded down to a BN boundary) to L cut into at most P chunks
        # of clen = max(CH, ceil(span / P) rounded up to BN) positions (c0 = 0).
        lo = 0
        if HAS_WIN:
            lo = tl.maximum(L - window, 0)
        if SPLITS > 0:
            base = lo // BN * BN
            clen = tl.maximum(tl.cdiv(tl.cdiv(L - base, SPLITS), BN) * BN, CH)
            return lo, base, clen, 0, tl.cdiv(L - base, clen)
        else:
            return lo, 0, CH, lo // CH, (L + CH - 1) // CH

    @triton.jit
    def _load_q(q_ptr, hk, G, D, stride_qh, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        # the G query heads of kv head hk: q [BG, BD] fp16, their indices and mask
        rg = tl.arange(0, BLOCK_G)
        rd = tl.arange(0, BLOCK_D)
        hq = hk * G + rg
        gmask = rg < G
        q = tl.load(q_ptr + hq[:, None] * stride_qh + rd[None, :], mask=gmask[:, None] & (rd[None, :] < D), other=0.0)
        return q, hq, gmask

    @triton.jit
    def _load_q_roped(q_ptr, hk, G, D, HALF, stride_qh, cos_row, sin_row,
                      BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        # _load_q of un-roped q, rotated (HF rotate-half) with the cos/sin rows of the new position and
        # rounded to fp16 as rope_kv_append rounds it: x1 c - x2 s = x1 c + (-x2) s exactly (first half),
        # x2 c + x1 s (second half); columns past the rotary part pass through.
        rg = tl.arange(0, BLOCK_G)
        rd = tl.arange(0, BLOCK_D)
        hq = hk * G + rg
        gmask = rg < G
        rows = q_ptr + hq[:, None] * stride_qh
        first = rd < HALF
        rot = rd < 2 * HALF
        x = tl.load(rows + rd[None, :], mask=gmask[:, None] & (rd[None, :] < D), other=0.0).to(tl.float32)
        xp = tl.load(rows + tl.where(first, rd + HALF, rd - HALF)[None, :], mask=gmask[:, None] & rot[None, :],
                     other=0.0).to(tl.float32)  # the rotation partner of each column
        ri = tl.where(first, rd, rd - HALF)
        c = tl.load(cos_row + ri, mask=rot, other=1.0)
        s = tl.load(sin_row + ri, mask=rot, other=0.0)
        y = x * c[None, :] + tl.where(first[None, :], -xp, xp) * s[None, :]
        return tl.where(rot[None, :], y, x).to(tl.float16), hq, gmask

    @triton.jit
    def _tile(q, k_base, v_base, p0, L, lo, stride_kt, stride_vt, scale, softcap, D,
              HAS_CAP: tl.constexpr, BLOCK_D: tl.constexpr, BN: tl.constexpr):
        # q: [BG, BD] fp16. Returns (m [BG], l [BG], o [BG, BD] unnormalized) of positions p0 .. p0+BN-1.
        pos = p0 + tl.arange(0, BN)
        rd = tl.arange(0, BLOCK_D)
        valid = (pos < L) & (pos >= lo)
        kv_mask = valid[:, None] & (rd[None, :] < D)
        k = tl.load(k_base + pos[:, None] * stride_kt + rd[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + pos[:, None] * stride_vt + rd[None, :], mask=kv_mask, other=0.0)  # both in flight
        s = tl.dot(q, tl.trans(k)) * scale  # [BG, BN] fp32
        if HAS_CAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(valid[None, :], s, _NEG)
        m = tl.max(s, 1)
        p = tl.exp(s - m[:, None])
        p = tl.where(valid[None, :], p, 0.0)
        l = tl.sum(p, 1)
        o = tl.dot(p.to(tl.float16), v)  # [BG, BD] fp32
        return m, l, o

    @triton.jit
    def _chunk(q, k_base, v_base, p0, size, L, lo, stride_kt, stride_vt, scale, softcap, D,
               HAS_CAP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BN: tl.constexpr,
               LOOP: tl.constexpr):
        # (m, l, o) of the visible positions of the chunk [p0, p0 + size), p0 a multiple of BN: one tile at p0
        # (not LOOP: the chunk is one BN-block), or a loop over its visible BN-blocks (every block holds a
        # visible position; a run-time trip count, software-pipelined over the kernel's num_stages)
        if not LOOP:
            m, l, o = _tile(q, k_base, v_base, p0, L, lo, stride_kt, stride_vt, scale, softcap, D,
                            HAS_CAP, BLOCK_D, BN)
        else:
            m = tl.full([BLOCK_G], _NEG, tl.float32)
            l = tl.zeros([BLOCK_G], tl.float32)
            o = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            p_lo = tl.maximum(p0, (lo // BN) * BN)
            p_hi = tl.minimum(p0 + size, L)
            for p in range(p_lo, p_hi, BN):
                mt, lt, ot = _tile(q, k_base, v_base, p, L, lo, stride_kt, stride_vt, scale, softcap, D,
                                   HAS_CAP, BLOCK_D, BN)
                mn = tl.maximum(m, mt)
                a = tl.exp(m - mn)
                b = tl.exp(mt - mn)
                o = o * a[:, None] + ot * b[:, None]
                l = l * a + lt * b
                m = mn
        return m, l, o

    @triton.jit
    def _merge_cols(m_ptr, l_ptr, o_ptr, hq, rd, c0, c1, NCH, BLOCK_D: tl.constexpr, BLOCK_DM: tl.constexpr,
                    BLOCK_C: tl.constexpr, CACHE: tl.constexpr):
        # Columns rd (BLOCK_DM of them) of query head hq merged over chunks c0 .. c1-1 in one pass, BLOCK_C
        # chunks per step (steps aligned to BLOCK_C): the chunks of a step are loaded together (not one
        # dependent load per chunk) and folded into the running (max, sum, out) by tl.max / tl.sum in a
        # fixed order: bitwise reproducible. Returns the normalized output, fp32 [BLOCK_DM].
        rc = tl.arange(0, BLOCK_C)
        mx = tl.max(tl.full([BLOCK_C], _NEG, tl.float32), 0)
        ls = tl.sum(tl.zeros([BLOCK_C], tl.float32), 0)
        acc = tl.zeros([BLOCK_DM], tl.float32)
        for cb in range((c0 // BLOCK_C) * BLOCK_C, c1, BLOCK_C):
            idx = cb + rc
            cm = (idx >= c0) & (idx < c1)
            mc = tl.load(m_ptr + hq * NCH + idx, mask=cm, other=_NEG, cache_modifier=CACHE)
            lc = tl.load(l_ptr + hq * NCH + idx, mask=cm, other=0.0, cache_modifier=CACHE)
            oc = tl.load(o_ptr + (hq * NCH + idx)[:, None] * BLOCK_D + rd[None, :], mask=cm[:, None], other=0.0,
                         cache_modifier=CACHE)
            mn = tl.maximum(mx, tl.max(mc, 0))
            a = tl.exp(mx - mn)
            w = tl.where(cm, tl.exp(mc - mn), 0.0)
            ls = ls * a + tl.sum(lc * w, 0)
            acc = acc * a + tl.sum(oc * w[:, None], 0)
            mx = mn
        return acc / ls

    @triton.jit
    def _merge_group(m_ptr, l_ptr, o_ptr, out_ptr, hk, G, D, c0, c1, NCH, stride_oh,
                     BLOCK_D: tl.constexpr, BLOCK_DM: tl.constexpr, BLOCK_C: tl.constexpr):
        # the inline merge: the G query heads of kv head hk, BLOCK_DM columns at a time. The partials were
        # written by other programs (SMs): read through L2 (.cg), after the acquire of the counter.
        for g in range(G):
            hq = hk * G + g
            for d0 in tl.static_range(0, BLOCK_D, BLOCK_DM):
                rd = d0 + tl.arange(0, BLOCK_DM)
                out = _merge_cols(m_ptr, l_ptr, o_ptr, hq, rd, c0, c1, NCH, BLOCK_D, BLOCK_DM, BLOCK_C, ".cg")
                tl.store(out_ptr + hq * stride_oh + rd, out.to(tl.float16), mask=rd < D)

    @triton.jit
    def _attn_split_kernel(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, t_ptr, t_val,
                           m_ptr, l_ptr, o_ptr, cnt_ptr, out_ptr,
                           G, D, HALF, NCH, stride_qh, stride_knh, stride_vnh,
                           stride_kh, stride_kt, stride_vh, stride_vt, stride_oh,
                           scale, softcap, window,
                           T_PTR: tl.constexpr, ROPE: tl.constexpr, MERGE: tl.constexpr,
                           HAS_WIN: tl.constexpr, HAS_CAP: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                           CH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, LOOP: tl.constexpr,
                           BLOCK_DM: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
        # One program per (kv head, chunk) (_chunks: fixed chunks, or SPLITS adaptive ones). t (t_ptr / t_val)
        # is the attention length, or with ROPE the new token's position (length t + 1). ROPE: q, kn, vn are
        # the new token's un-roped q, k and its v (kn, vn unused otherwise); MERGE: merge inline (cnt_ptr,
        # out_ptr unused otherwise); see the module docstring. NCH: chunk stride of the workspace (>= the
        # grid's chunk count).
        pdl.pdl_enter(PDL)  # before t, q and the new K/V: all written by the previous kernels
        hk = tl.program_id(0)
        c = tl.program_id(1)
        t = _load_len(t_ptr, t_val, T_PTR)
        L = t + 1 if ROPE else t
        lo, base, clen, c0, c1 = _chunks(L, window, HAS_WIN, CH, BN, SPLITS)
        if (c >= c0) & (c < c1):
            k_base = kc_ptr + hk * stride_kh
            v_base = vc_ptr + hk * stride_vh
            if ROPE:
                if c == (t - base) // clen:  # the chunk of the new position: append it before reading the chunk
                    ri = tl.arange(0, BLOCK_H)
                    cs = tl.load(cos_ptr + t * HALF + ri, mask=ri < HALF, other=1.0)
                    sn = tl.load(sin_ptr + t * HALF + ri, mask=ri < HALF, other=0.0)
                    rope_append_kv(kn_ptr + hk * stride_knh, vn_ptr + hk * stride_vnh, k_base + t * stride_kt,
                                   v_base + t * stride_vt, cs, sn, HALF, D, BLOCK_H, BLOCK_D)
                    tl.debug_barrier()  # the slot's stores before any thread of this program loads it
                q, hq, gmask = _load_q_roped(q_ptr, hk, G, D, HALF, stride_qh, cos_ptr + t * HALF,
                                             sin_ptr + t * HALF, BLOCK_G, BLOCK_D)
            else:
                q, hq, gmask = _load_q(q_ptr, hk, G, D, stride_qh, BLOCK_G, BLOCK_D)
            p0 = base + c * clen
            m, l, o = _chunk(q, k_base, v_base, p0, clen, L, lo, stride_kt, stride_vt, scale, softcap, D,
                             HAS_CAP, BLOCK_G, BLOCK_D, BN, LOOP)
            rd = tl.arange(0, BLOCK_D)
            tl.store(m_ptr + hq * NCH + c, m, mask=gmask)
            tl.store(l_ptr + hq * NCH + c, l, mask=gmask)
            tl.store(o_ptr + (hq[:, None] * NCH + c) * BLOCK_D + rd[None, :], o, mask=gmask[:, None])
            if MERGE:
                tl.debug_barrier()  # every thread's partials stored before the release below
                arrived = tl.atomic_add(cnt_ptr + hk, 1, sem="acq_rel", scope="gpu")
                if arrived == c1 - c0 - 1:  # the last of the head's chunks: all partials are visible
                    _merge_group(m_ptr, l_ptr, o_ptr, out_ptr, hk, G, D, c0, c1, NCH, stride_oh,
                                 BLOCK_D, BLOCK_DM, BLOCK_C)
                    tl.store(cnt_ptr + hk, 0)  # ready for the next call (graph replay)

    @triton.jit
    def _attn_merge_kernel(t_ptr, t_val, m_ptr, l_ptr, o_ptr, out_ptr, D, NCH, stride_oh, window,
                           T_PTR: tl.constexpr, T_IS_POS: tl.constexpr, HAS_WIN: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_DM: tl.constexpr, CH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr,
                           BLOCK_C: tl.constexpr, PDL: tl.constexpr):
        # One program per (query head, BLOCK_DM columns). t: the attention length, or (T_IS_POS: after a
        # split kernel with ROPE) the new token's position. Merges the chunks the split kernel wrote
        # (_chunks with the same L: the count of adaptive chunks is known only here, at run time).
        pdl.pdl_enter(PDL)
        hq = tl.program_id(0)
        ds = tl.program_id(1)
        t = _load_len(t_ptr, t_val, T_PTR)
        L = t + 1 if T_IS_POS else t
        _, _, _, c0, c1 = _chunks(L, window, HAS_WIN, CH, BN, SPLITS)
        rd = ds * BLOCK_DM + tl.arange(0, BLOCK_DM)
        out = _merge_cols(m_ptr, l_ptr, o_ptr, hq, rd, c0, c1, NCH, BLOCK_D, BLOCK_DM, BLOCK_C, "")
        tl.store(out_ptr + hq * stride_oh + rd, out.to(tl.float16), mask=rd < D)

    @triton.jit
    def _attn_seq_kernel(q_ptr, k_ptr, v_ptr, len_ptr, len_val, out_ptr,
                         G, D, stride_qh, stride_kh, stride_kt, stride_vh, stride_vt, stride_oh,
                         scale, softcap, window,
                         LEN_PTR: tl.constexpr, HAS_WIN: tl.constexpr, HAS_CAP: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr):
        hk = tl.program_id(0)
        L = _load_len(len_ptr, len_val, LEN_PTR)
        lo, _, _, c0, c1 = _chunks(L, window, HAS_WIN, CH, CH, 0)
        q, hq, gmask = _load_q(q_ptr, hk, G, D, stride_qh, BLOCK_G, BLOCK_D)
        rd = tl.arange(0, BLOCK_D)
        mx = tl.full([BLOCK_G], _NEG, tl.float32)
        ls = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for c in range(c0, c1):
            m, l, o = _tile(q, k_ptr + hk * stride_kh, v_ptr + hk * stride_vh, c * CH, L, lo,
                            stride_kt, stride_vt, scale, softcap, D, HAS_CAP, BLOCK_D, CH)
            mn = tl.maximum(mx, m)
            a = tl.exp(mx - mn)
            b = tl.exp(m - mn)
            acc = acc * a[:, None] + o * b[:, None]
            ls = ls * a + l * b
            mx = mn
        out = acc / ls[:, None]
        tl.store(out_ptr + hq[:, None] * stride_oh + rd[None, :], out.to(tl.float16),
                 mask=gmask[:, None] & (rd[None, :] < D))


def _use_triton(device) -> bool:
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1")


class AttnWorkspace(NamedTuple):
    """Scratch of the split-KV kernels (from ``attention_workspace``; allocate once, outside graph capture).

    m, l      fp32 [Hq, NCH]            per (query head, chunk) max and sum of the chunk's softmax
    o         fp32 [Hq, NCH, BLOCK_D]   its unnormalized output
    counters  int32 [Hq] (>= Hkv used)  the inline merge's arrivals per kv head: zero between calls
    """
    m: torch.Tensor
    l: torch.Tensor
    o: torch.Tensor
    counters: torch.Tensor


# The inline merge folds BLOCK_C chunks x BLOCK_DM columns per step, one L2 round trip each: the last
# program of a kv head runs G * BLOCK_D / BLOCK_DM steps one after the other. BLOCK_DM is chosen so that a
# step's partials take this many fp32 registers per thread. Compiled for sm_90 (Triton 3.9; 64x128 tiles,
# 4 warps, 64 chunks): the split kernel alone takes 80 registers (6 blocks per SM); with the inline merge at
# 64: 128 (4 blocks, 16 warps per SM: still several times the K/V bytes in flight an SM needs at full
# bandwidth; 1 step per 128-column head), at 32: 96 (5 blocks, 2 steps), at 16: 86 (4 steps).
# Not measured on the GPU: scripts/gpu_attn_fused.py times 16 / 32 / 64.
MERGE_REGS = 64


def _check(q, k_cache, v_cache, length, scale, window, softcap):
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype != torch.float16:
        raise ValueError(f"q: expected float16 [Hq, D], got {getattr(q, 'dtype', None)} {tuple(getattr(q, 'shape', ()))}")
    hq, d = q.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 3 or c.dtype != torch.float16:
            raise ValueError(f"{name}: expected float16 [Hkv, T_max, D]")
        if c.shape[2] != d or c.stride(2) != 1:
            raise ValueError(f"{name}: last dim must be D={d} and contiguous, got shape {tuple(c.shape)}")
        if c.device != q.device:
            raise ValueError(f"{name}: on {c.device}, q on {q.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    hkv = k_cache.shape[0]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"q: {hq} query heads is not a multiple of {hkv} kv heads")
    if d < 1 or d > 256:
        raise ValueError(f"q: head dim {d} outside 1..256")
    if hq // hkv > 64:
        raise ValueError(f"q: group size {hq // hkv} > 64")
    if isinstance(length, torch.Tensor):
        if length.numel() != 1 or length.dtype not in (torch.int32, torch.int64) or length.device != q.device:
            raise ValueError("length: expected an int or a one-element int32/int64 tensor on q's device")
    else:
        if not (1 <= int(length) <= k_cache.shape[1]):
            raise ValueError(f"length: {length} outside 1..{k_cache.shape[1]}")
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale: expected a positive float, got {scale!r}")
    if window is not None and int(window) < 1:
        raise ValueError(f"window: expected a positive int or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: expected a positive float or None, got {softcap!r}")


def _check_out_config(q, g, out, config):
    """The output buffer (allocated if None) after checking it and a forced config."""
    hq, d = q.shape
    if out is None:
        out = torch.empty(hq, d, dtype=torch.float16, device=q.device)
    elif out.shape != (hq, d) or out.dtype != torch.float16 or out.stride(1) != 1:
        raise ValueError(f"out: expected float16 [{hq}, {d}] with a contiguous last dim")
    if config is not None and not config_fits(config, d, g):
        raise ValueError(f"config: {config} breaks the resource rule for D={d}, G={g}")
    return out


def _check_workspace(ws, hq, hkv, nch, block_d, cfg, inline_merge):
    if not (isinstance(ws, tuple) and len(ws) == 4):
        raise ValueError("workspace: expected the AttnWorkspace of attention_workspace()")
    m, l, o, counters = ws
    if (m.shape[0] != hq or m.shape[1] < nch or l.shape != m.shape or o.shape != (*m.shape, block_d)
            or not (m.is_contiguous() and l.is_contiguous() and o.is_contiguous())):
        raise ValueError(f"workspace: shapes {tuple(m.shape)}, {tuple(l.shape)}, {tuple(o.shape)} too small "
                         f"for {cfg.name} ([{hq}, >={nch}], [{hq}, >={nch}, {block_d}] contiguous)")
    if inline_merge and (counters.dtype != torch.int32 or counters.numel() < hkv or not counters.is_contiguous()):
        raise ValueError(f"workspace: counters must be int32 [>={hkv}] contiguous (zeros)")


def _n_chunks(cfg: AttnConfig, t_max: int) -> int:
    """Split programs per kv head = workspace chunks per query head for a cache of t_max positions: one per
    chunk of the cache, or the config's splits (no more than chunks of `chunk` positions fit in t_max: the
    adaptive chunks are never shorter)."""
    n = -(-t_max // cfg.chunk)
    return min(cfg.splits, n) if cfg.splits else n


def _loops(cfg: AttnConfig) -> bool:
    """Whether a split program walks its chunk in a loop of block_n steps (else: one tile)."""
    return cfg.splits > 0 or cfg.chunk > cfg.block_n


def _merge_block_c(cfg: AttnConfig, nch: int) -> int:
    """Chunks per merge step: the config's merge_chunks, capped at the chunk count (at least 16)."""
    return min(cfg.merge_chunks, max(16, 1 << (nch - 1).bit_length()))


def _launch_split(q, rope, k_cache, v_cache, t, *, scale, window, softcap, out, workspace, config, inline_merge):
    """Launch the split kernel (and the merge kernel unless inline_merge). t: the attention length, or with
    rope = (k, v, cos, sin) of the new token the position it is appended at (length t + 1)."""
    hq, d = q.shape
    hkv, tmax, _ = k_cache.shape
    g = hq // hkv
    cfg = config if config is not None else choose_config(d, g, tmax, hkv)
    nch = _n_chunks(cfg, tmax)
    BLOCK_D = _block_d(d)
    ws = workspace if workspace is not None else attention_workspace(hq, d, tmax, q.device, config=cfg)
    _check_workspace(ws, hq, hkv, nch, BLOCK_D, cfg, inline_merge)
    bc = _merge_block_c(cfg, nch)
    k, v, cos, sin = rope if rope is not None else (q, q, ws.m, ws.m)  # unused pointers without rope
    half = cos.shape[1] if rope is not None else 1
    is_t = isinstance(t, torch.Tensor)
    t_ptr, t_val = (t, 0) if is_t else (out, int(t))  # dummy pointer when unused
    common = dict(HAS_WIN=window is not None, BLOCK_D=BLOCK_D, CH=cfg.chunk, BN=cfg.block_n, SPLITS=cfg.splits,
                  BLOCK_C=bc, **pdl.launch_kwargs(q.device))
    win = int(window) if window is not None else 0
    _attn_split_kernel[(hkv, nch)](q, k, v, k_cache, v_cache, cos, sin, t_ptr, t_val,
                                   ws.m, ws.l, ws.o, ws.counters, out, g, d, half, ws.m.shape[1],
                                   q.stride(0), k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1),
                                   v_cache.stride(0), v_cache.stride(1), out.stride(0),
                                   float(scale), float(softcap) if softcap is not None else 1.0, win,
                                   T_PTR=is_t, ROPE=rope is not None, MERGE=inline_merge,
                                   HAS_CAP=softcap is not None, BLOCK_G=_block_g(g),
                                   BLOCK_H=triton.next_power_of_2(half), LOOP=_loops(cfg),
                                   BLOCK_DM=min(BLOCK_D, MERGE_REGS * 32 * cfg.warps // bc),
                                   num_warps=cfg.warps, num_stages=cfg.stages, **common)
    if not inline_merge:
        bdm = min(cfg.merge_d, BLOCK_D) if cfg.merge_d else BLOCK_D
        _attn_merge_kernel[(hq, BLOCK_D // bdm)](t_ptr, t_val, ws.m, ws.l, ws.o, out, d, ws.m.shape[1],
                                                 out.stride(0), win, T_PTR=is_t, T_IS_POS=rope is not None,
                                                 BLOCK_DM=bdm, num_warps=cfg.merge_warps, **common)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length, *,
                     scale: float, window: int | None = None, softcap: float | None = None,
                     out: torch.Tensor | None = None, workspace: AttnWorkspace | None = None,
                     split: bool | None = None, config: AttnConfig | None = None,
                     inline_merge: bool = False) -> torch.Tensor:
    """Attention of one query token over the first `length` cache positions. Returns fp16 [Hq, D].

    split=None follows TRAPETUM_ATTN (``seq`` -> sequential kernel, else split-KV).
    workspace: an ``attention_workspace`` so that a captured decode step allocates nothing (sized for
    the config used: at least the config's chunk count).
    config: force a split-KV AttnConfig (benchmarks, tests); None -> choose_config(D, G, T_max, Hkv).
    A config that breaks the static rule (config_fits) raises ValueError.
    inline_merge: merge in the split kernel (the last program of each kv head; module docstring)
    instead of the merge kernel.
    """
    _check(q, k_cache, v_cache, length, scale, window, softcap)
    g = q.shape[0] // k_cache.shape[0]
    out = _check_out_config(q, g, out, config)
    if not _use_triton(q.device):
        r = decode_attention_torch(q, k_cache, v_cache, length, scale=scale, window=window,
                                   softcap=softcap, dtype=torch.float32)
        return out.copy_(r)
    if split is None:
        split = os.environ.get("TRAPETUM_ATTN", "split") != "seq"
    if split:
        _launch_split(q, None, k_cache, v_cache, length, scale=scale, window=window, softcap=softcap, out=out,
                      workspace=workspace, config=config, inline_merge=inline_merge)
        return out
    len_ptr = length if isinstance(length, torch.Tensor) else out  # dummy pointer when unused
    len_val = 0 if isinstance(length, torch.Tensor) else int(length)
    _attn_seq_kernel[(k_cache.shape[0],)](q, k_cache, v_cache, len_ptr, len_val, out, g, q.shape[1],
                                          q.stride(0), k_cache.stride(0), k_cache.stride(1),
                                          v_cache.stride(0), v_cache.stride(1), out.stride(0),
                                          float(scale), float(softcap) if softcap is not None else 1.0,
                                          int(window) if window is not None else 0,
                                          LEN_PTR=isinstance(length, torch.Tensor), HAS_WIN=window is not None,
                                          HAS_CAP=softcap is not None, BLOCK_G=_block_g(g),
                                          BLOCK_D=_block_d(q.shape[1]), CH=CHUNK, num_warps=4, num_stages=SEQ_STAGES)
    return out


def decode_attention_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, pos, cos: torch.Tensor, sin: torch.Tensor, *, scale: float,
                           window: int | None = None, softcap: float | None = None,
                           out: torch.Tensor | None = None, workspace: AttnWorkspace | None = None,
                           config: AttnConfig | None = None, inline_merge: bool = False) -> torch.Tensor:
    """One new token's RoPE, KV-cache append and attention: the split kernel, then the merge kernel (one
    launch with inline_merge=True). Returns fp16 [Hq, D].

    The same as ``rope_kv_append(q, k, v, k_cache, v_cache, pos, cos, sin)`` followed by
    ``decode_attention(q, k_cache, v_cache, pos + 1, ...)`` (the same bits in the caches; q itself is
    not modified: each program rotates it in registers). q [Hq, D], k, v [Hkv, D] un-roped, views with
    a contiguous last dim (slices of the qkv GEMV output); caches [Hkv, T_max, D]; cos/sin fp32
    [max_pos, rot/2]; pos an int or a one-element int tensor (graph-capturable); the rest as
    decode_attention. With inline_merge the workspace's counters must be zero (attention_workspace makes them
    so, and every call leaves them so).
    """
    q3, k3, v3 = check_rope_kv(q, k, v, k_cache, v_cache, pos, cos, sin)
    if q3.shape[0] != 1:
        raise ValueError(f"q: expected one token [Hq, D], got {tuple(q.shape)}")
    q, k, v = q3[0], k3[0], v3[0]
    _check(q, k_cache, v_cache, pos if isinstance(pos, torch.Tensor) else int(pos) + 1, scale, window, softcap)
    out = _check_out_config(q, q.shape[0] // k.shape[0], out, config)
    if not _use_triton(q.device):
        qr = q.clone()
        rope_kv_append(qr, k, v, k_cache, v_cache, pos, cos, sin)
        r = decode_attention_torch(qr, k_cache, v_cache, int(pos) + 1, scale=scale, window=window,
                                   softcap=softcap, dtype=torch.float32)
        return out.copy_(r)
    _launch_split(q, (k, v, cos.contiguous(), sin.contiguous()), k_cache, v_cache, pos, scale=scale,
                  window=window, softcap=softcap, out=out, workspace=workspace, config=config,
                  inline_merge=inline_merge)
    return out


def attention_workspace(hq: int, d: int, t_max: int, device, *, hkv: int | None = None,
                        config: AttnConfig | None = None) -> AttnWorkspace:
    """Scratch buffers for split-KV decode attention (allocate once, outside graph capture).

    Sized for `config`, else for choose_config(d, hq // hkv, t_max, hkv); without hkv, for the largest
    chunk count the chooser picks for any group size of hq heads (so that the engine's call,
    which passes no group size, fits whatever decode_attention chooses).
    Shapes: m, l fp32 [hq, nch]; o fp32 [hq, nch, BLOCK_D]; counters int32 [hq], zeros; nch = the
    config's split programs per kv head (ceil(t_max / chunk), or with splits P at most P).
    """
    if config is not None:
        nch = _n_chunks(config, t_max)
    elif hkv is not None:
        nch = _n_chunks(choose_config(d, hq // hkv, t_max, hkv), t_max)
    else:
        nch = max(_n_chunks(choose_config(d, g, t_max, hq // g, strict=False), t_max) for g in _divisors(hq))
    bd = _block_d(d)
    return AttnWorkspace(torch.empty(hq, nch, dtype=torch.float32, device=device),
                         torch.empty(hq, nch, dtype=torch.float32, device=device),
                         torch.empty(hq, nch, bd, dtype=torch.float32, device=device),
                         torch.zeros(hq, dtype=torch.int32, device=device))
