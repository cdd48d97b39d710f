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
The knobs live in an AttnConfig; `choose_config(D, G, T_max)` picks one (`decode_attention(...,
config=...)` forces one: scripts/attn_sweep.py times the CANDIDATE_CONFIGS that way), and
`config_fits` is the static rule that keeps a config inside shared memory / registers for a head dim.
No atomics: results are bitwise reproducible for a given config. TRAPETUM_ATTN=seq selects the
sequential kernel (one program per kv head walking every chunk), kept as the reference path.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

from . import pdl  # programmatic dependent launch of the split and merge kernels


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
    """
    chunk: int = 64
    block_n: int = 64
    warps: int = 4
    stages: int = 1
    merge_chunks: int = 16
    merge_warps: int = 4
    merge_d: int = 0

    @property
    def name(self) -> str:
        s = f"c{self.chunk}" + (f"b{self.block_n}s{self.stages}" if self.chunk != self.block_n else "")
        return s + f"-w{self.warps}-m{self.merge_chunks}w{self.merge_warps}d{self.merge_d or 'all'}"


LEGACY_CONFIG = AttnConfig()  # the kernel before configs: 64-position chunks, 4 warps, merge 16 per step

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
    if smem_estimate(cfg.block_n, d, cfg.stages, cfg.chunk > cfg.block_n, g) > SMEM_BUDGET:
        return False
    return cfg.block_n * _block_d(d) <= TILE_PER_THREAD * 32 * cfg.warps


@functools.lru_cache(maxsize=256)
def choose_config(d: int, g: int, t_max: int) -> AttnConfig:
    """The production config for head dim d, group size g, cache of t_max positions.

    64-position chunks, 4 warps, and a merge of up to 64 chunks per step with 32 columns per program
    (Hq * D / 32 programs instead of Hq): the fastest or within 6% of the fastest of the 13 candidates
    at every shape of the H200 sweep (scripts/attn_sweep.py, 2026-11-30 08:06 UTC; BENCHMARKS.md), e.g.
    4k-position MHA 32x128 27.5 -> 23.5 us, GQA 32/8x128 14.1 -> 10.2 us, 8/4x256 13.7 -> 10.1 us. Longer
    pipelined chunks (512 positions, 3 stages) were 6% faster at 4k MHA but 37% slower at 1k, and the
    length changes within one captured decode graph. g and t_max are in the signature for rules that
    depend on them. Falls back to LEGACY_CONFIG if a choice would break the static rule.
    """
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
    def _load_q(q_ptr, hk, G, D, stride_qh, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        # the G query heads of kv head hk: q [BG, BD] fp16, their indices and mask
        rg = tl.arange(0, BLOCK_G)
        rd = tl.arange(0, BLOCK_D)
        hq = hk * G + rg
        gmask = rg < G
        q = tl.load(q_ptr + hq[:, None] * stride_qh + rd[None, :], mask=gmask[:, None] & (rd[None, :] < D), other=0.0)
        return q, hq, gmask

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
    def _attn_split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, len_val, m_ptr, l_ptr, o_ptr,
                           G, D, NCH, stride_qh, stride_kh, stride_kt, stride_vh, stride_vt,
                           scale, softcap, window,
                           LEN_PTR: tl.constexpr, HAS_WIN: tl.constexpr, HAS_CAP: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr, BN: tl.constexpr,
                           PDL: tl.constexpr):
        # NCH: chunk stride of the workspace (>= the number of chunks of the cache)
        pdl.pdl_enter(PDL)  # before the length, q and the new K/V: all written by the previous kernels
        hk = tl.program_id(0)
        c = tl.program_id(1)
        L = _load_len(len_ptr, len_val, LEN_PTR)
        lo = 0
        if HAS_WIN:
            lo = tl.maximum(L - window, 0)
        if (c * CH < L) & (c * CH + CH > lo):
            q, hq, gmask = _load_q(q_ptr, hk, G, D, stride_qh, BLOCK_G, BLOCK_D)
            rd = tl.arange(0, BLOCK_D)
            k_base = k_ptr + hk * stride_kh
            v_base = v_ptr + hk * stride_vh
            if CH == BN:
                m, l, o = _tile(q, k_base, v_base, c * CH, L, lo, stride_kt, stride_vt, scale, softcap, D,
                                HAS_CAP, BLOCK_D, BN)
            else:
                # inner loop over the chunk's visible BN-blocks (every block holds a visible position)
                m = tl.full([BLOCK_G], _NEG, tl.float32)
                l = tl.zeros([BLOCK_G], tl.float32)
                o = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
                p_lo = tl.maximum(c * CH, (lo // BN) * BN)
                p_hi = tl.minimum(c * CH + CH, L)
                for p0 in range(p_lo, p_hi, BN):
                    mt, lt, ot = _tile(q, k_base, v_base, p0, L, lo, stride_kt, stride_vt, scale, softcap, D,
                                       HAS_CAP, BLOCK_D, BN)
                    mn = tl.maximum(m, mt)
                    a = tl.exp(m - mn)
                    b = tl.exp(mt - mn)
                    o = o * a[:, None] + ot * b[:, None]
                    l = l * a + lt * b
                    m = mn
            tl.store(m_ptr + hq * NCH + c, m, mask=gmask)
            tl.store(l_ptr + hq * NCH + c, l, mask=gmask)
            tl.store(o_ptr + (hq[:, None] * NCH + c) * BLOCK_D + rd[None, :], o, mask=gmask[:, None])

    @triton.jit
    def _attn_merge_kernel(len_ptr, len_val, m_ptr, l_ptr, o_ptr, out_ptr, D, NCH, stride_oh, window,
                           LEN_PTR: tl.constexpr, HAS_WIN: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_DM: tl.constexpr, CH: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
        # One program per (query head, BLOCK_DM columns), one pass over the head's chunks, BLOCK_C
        # chunks per step (steps aligned to BLOCK_C): the chunks of a step are loaded together (not
        # one dependent load per chunk) and folded into the running (max, sum, out) by tl.max /
        # tl.sum in a fixed order: bitwise reproducible.
        pdl.pdl_enter(PDL)
        hq = tl.program_id(0)
        ds = tl.program_id(1)
        L = _load_len(len_ptr, len_val, LEN_PTR)
        c0 = 0
        if HAS_WIN:
            c0 = tl.maximum(L - window, 0) // CH
        c1 = (L + CH - 1) // CH
        rd = ds * BLOCK_DM + tl.arange(0, BLOCK_DM)
        rc = tl.arange(0, BLOCK_C)
        mx = tl.max(tl.full([BLOCK_C], _NEG, tl.float32), 0)
        ls = tl.sum(tl.zeros([BLOCK_C], tl.float32), 0)
        acc = tl.zeros([BLOCK_DM], tl.float32)
        for cb in range((c0 // BLOCK_C) * BLOCK_C, c1, BLOCK_C):
            idx = cb + rc
            cm = (idx >= c0) & (idx < c1)
            mc = tl.load(m_ptr + hq * NCH + idx, mask=cm, other=_NEG)
            lc = tl.load(l_ptr + hq * NCH + idx, mask=cm, other=0.0)
            oc = tl.load(o_ptr + (hq * NCH + idx)[:, None] * BLOCK_D + rd[None, :], mask=cm[:, None], other=0.0)
            mn = tl.maximum(mx, tl.max(mc, 0))
            a = tl.exp(mx - mn)
            w = tl.where(cm, tl.exp(mc - mn), 0.0)
            ls = ls * a + tl.sum(lc * w, 0)
            acc = acc * a + tl.sum(oc * w[:, None], 0)
            mx = mn
        out = acc / ls
        tl.store(out_ptr + hq * stride_oh + rd, out.to(tl.float16), mask=rd < D)

    @triton.jit
    def _attn_seq_kernel(q_ptr, k_ptr, v_ptr, len_ptr, len_val, out_ptr,
                         G, D, stride_qh, stride_kh, stride_kt, stride_vh, stride_vt, stride_oh,
                         scale, softcap, window,
                         LEN_PTR: tl.constexpr, HAS_WIN: tl.constexpr, HAS_CAP: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr):
        hk = tl.program_id(0)
        L = _load_len(len_ptr, len_val, LEN_PTR)
        lo = 0
        if HAS_WIN:
            lo = tl.maximum(L - window, 0)
        q, hq, gmask = _load_q(q_ptr, hk, G, D, stride_qh, BLOCK_G, BLOCK_D)
        rd = tl.arange(0, BLOCK_D)
        mx = tl.full([BLOCK_G], _NEG, tl.float32)
        ls = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for c in range(lo // CH, (L + CH - 1) // CH):
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


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length, *,
                     scale: float, window: int | None = None, softcap: float | None = None,
                     out: torch.Tensor | None = None, workspace: tuple | None = None,
                     split: bool | None = None, config: AttnConfig | None = None) -> torch.Tensor:
    """Attention of one query token over the first `length` cache positions. Returns fp16 [Hq, D].

    split=None follows TRAPETUM_ATTN (``seq`` -> sequential kernel, else split-KV).
    workspace: optional (m, l, o) fp32 buffers from ``attention_workspace`` so that a captured
    decode step allocates nothing (sized for the config used: at least the config's chunk count).
    config: force a split-KV AttnConfig (benchmarks, tests); None -> choose_config(D, G, T_max).
    A config that breaks the static rule (config_fits) raises ValueError.
    """
    _check(q, k_cache, v_cache, length, scale, window, softcap)
    hq, d = q.shape
    hkv, tmax, _ = k_cache.shape
    g = hq // hkv
    if out is None:
        out = torch.empty(hq, d, dtype=torch.float16, device=q.device)
    elif out.shape != (hq, d) or out.dtype != torch.float16 or out.stride(1) != 1:
        raise ValueError(f"out: expected float16 [{hq}, {d}] with a contiguous last dim")
    if config is not None and not config_fits(config, d, g):
        raise ValueError(f"config: {config} breaks the resource rule for D={d}, G={g}")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1" or triton is None:
        r = decode_attention_torch(q, k_cache, v_cache, length, scale=scale, window=window,
                                   softcap=softcap, dtype=torch.float32)
        return out.copy_(r)
    len_ptr = length if isinstance(length, torch.Tensor) else out  # dummy pointer when unused
    len_val = 0 if isinstance(length, torch.Tensor) else int(length)
    BLOCK_D = _block_d(d)
    common = dict(LEN_PTR=isinstance(length, torch.Tensor), HAS_WIN=window is not None)
    if split is None:
        split = os.environ.get("TRAPETUM_ATTN", "split") != "seq"
    win = int(window) if window is not None else 0
    cap = float(softcap) if softcap is not None else 1.0
    if not split:
        _attn_seq_kernel[(hkv,)](q, k_cache, v_cache, len_ptr, len_val, out, g, d,
                                 q.stride(0), k_cache.stride(0), k_cache.stride(1),
                                 v_cache.stride(0), v_cache.stride(1), out.stride(0),
                                 float(scale), cap, win, HAS_CAP=softcap is not None,
                                 BLOCK_G=_block_g(g), BLOCK_D=BLOCK_D, CH=CHUNK, num_warps=4, num_stages=SEQ_STAGES,
                                 **common)
        return out
    cfg = config if config is not None else choose_config(d, g, tmax)
    nch = -(-tmax // cfg.chunk)
    if workspace is None:
        workspace = attention_workspace(hq, d, tmax, q.device, config=cfg)
    m, l, o = workspace
    if (m.shape[0] != hq or m.shape[1] < nch or l.shape != m.shape or o.shape != (*m.shape, BLOCK_D)
            or not (m.is_contiguous() and l.is_contiguous() and o.is_contiguous())):
        raise ValueError(f"workspace: shapes {tuple(m.shape)}, {tuple(l.shape)}, {tuple(o.shape)} too small "
                         f"for {cfg.name} ([{hq}, >={nch}], [{hq}, >={nch}, {BLOCK_D}] contiguous)")
    ws_nch = m.shape[1]
    _attn_split_kernel[(hkv, nch)](q, k_cache, v_cache, len_ptr, len_val, m, l, o, g, d, ws_nch,
                                   q.stride(0), k_cache.stride(0), k_cache.stride(1),
                                   v_cache.stride(0), v_cache.stride(1), float(scale), cap, win,
                                   HAS_CAP=softcap is not None, BLOCK_G=_block_g(g),
                                   BLOCK_D=BLOCK_D, CH=cfg.chunk, BN=cfg.block_n,
                                   num_warps=cfg.warps, num_stages=cfg.stages, **common, **pdl.launch_kwargs(q.device))
    bdm = min(cfg.merge_d, BLOCK_D) if cfg.merge_d else BLOCK_D
    bc = min(cfg.merge_chunks, max(16, 1 << (nch - 1).bit_length()))
    _attn_merge_kernel[(hq, BLOCK_D // bdm)](len_ptr, len_val, m, l, o, out, d, ws_nch, out.stride(0), win,
                                             BLOCK_D=BLOCK_D, BLOCK_DM=bdm, CH=cfg.chunk, BLOCK_C=bc,
                                             num_warps=cfg.merge_warps, **common, **pdl.launch_kwargs(q.device))
    return out


def attention_workspace(hq: int, d: int, t_max: int, device, *, hkv: int | None = None,
                        config: AttnConfig | None = None) -> tuple:
    """Scratch buffers (m, l, o) for split-KV decode attention (allocate once, outside graph capture).

    Sized for `config`, else for choose_config(d, hq // hkv, t_max); without hkv, for the largest
    chunk count the chooser picks for any group size of hq heads (so that the engine's call,
    which passes no group size, fits whatever decode_attention chooses).
    Shapes: m, l fp32 [hq, nch]; o fp32 [hq, nch, BLOCK_D].
    """
    if config is not None:
        chunk = config.chunk
    elif hkv is not None:
        chunk = choose_config(d, hq // hkv, t_max).chunk
    else:
        chunk = min(choose_config(d, g, t_max).chunk for g in _divisors(hq))
    nch = -(-t_max // chunk)
    bd = _block_d(d)
    return (torch.empty(hq, nch, dtype=torch.float32, device=device),
            torch.empty(hq, nch, dtype=torch.float32, device=device),
            torch.empty(hq, nch, bd, dtype=torch.float32, device=device))
