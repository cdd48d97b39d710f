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

Split-KV: the cache is cut into 64-position chunks; one program per (kv head, chunk) handles the
G query heads of that kv head (K and V read once) with an online softmax and writes (max, sum,
unnormalized out) to a workspace; a second kernel merges the chunks of each head in a fixed order
(MERGE_CHUNKS chunks per step, loaded together: the first version's one dependent load per chunk
made the merge, not the KV reads, the larger part of the time at 4k positions).
No atomics: results are bitwise reproducible. TRAPETUM_ATTN=seq selects the sequential kernel (one
program per kv head walking every chunk), kept as the reference path.
"""
from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

CHUNK = 64
MERGE_CHUNKS = 16  # chunks the merge kernel folds in per step (1,024 positions)
# finite "minus infinity": keeps exp(m_old - m_new) free of NaN (a constexpr: Triton kernels may
# only read globals that are constexpr)
_NEG = tl.constexpr(-1.0e30) if tl is not None else -1.0e30


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
    def _chunk(q, k_base, v_base, c, L, lo, stride_kt, stride_vt, scale, softcap, D,
               HAS_CAP: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr):
        # q: [BG, BD] fp16. Returns (m [BG], l [BG], o [BG, BD] unnormalized) of chunk c.
        pos = c * CH + tl.arange(0, CH)
        rd = tl.arange(0, BLOCK_D)
        valid = (pos < L) & (pos >= lo)
        kv_mask = valid[:, None] & (rd[None, :] < D)
        k = tl.load(k_base + pos[:, None] * stride_kt + rd[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + pos[:, None] * stride_vt + rd[None, :], mask=kv_mask, other=0.0)  # both in flight
        s = tl.dot(q, tl.trans(k)) * scale  # [BG, CH] fp32
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
                           BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr):
        hk = tl.program_id(0)
        c = tl.program_id(1)
        L = _load_len(len_ptr, len_val, LEN_PTR)
        lo = 0
        if HAS_WIN:
            lo = tl.maximum(L - window, 0)
        if (c * CH < L) & (c * CH + CH > lo):
            q, hq, gmask = _load_q(q_ptr, hk, G, D, stride_qh, BLOCK_G, BLOCK_D)
            rd = tl.arange(0, BLOCK_D)
            m, l, o = _chunk(q, k_ptr + hk * stride_kh, v_ptr + hk * stride_vh, c, L, lo,
                             stride_kt, stride_vt, scale, softcap, D, HAS_CAP, BLOCK_D, CH)
            tl.store(m_ptr + hq * NCH + c, m, mask=gmask)
            tl.store(l_ptr + hq * NCH + c, l, mask=gmask)
            tl.store(o_ptr + (hq[:, None] * NCH + c) * BLOCK_D + rd[None, :], o, mask=gmask[:, None])

    @triton.jit
    def _attn_merge_kernel(len_ptr, len_val, m_ptr, l_ptr, o_ptr, out_ptr, D, NCH, stride_oh, window,
                           LEN_PTR: tl.constexpr, HAS_WIN: tl.constexpr, BLOCK_D: tl.constexpr,
                           CH: tl.constexpr, BLOCK_C: tl.constexpr):
        # One program per query head, one pass over the head's chunks, BLOCK_C chunks per step:
        # the chunks of a step are loaded together (not one dependent load per chunk) and folded
        # into the running (max, sum, out) by tl.max / tl.sum in a fixed order: bitwise reproducible.
        hq = tl.program_id(0)
        L = _load_len(len_ptr, len_val, LEN_PTR)
        c0 = 0
        if HAS_WIN:
            c0 = tl.maximum(L - window, 0) // CH
        c1 = (L + CH - 1) // CH
        rd = tl.arange(0, BLOCK_D)
        rc = tl.arange(0, BLOCK_C)
        mx = tl.max(tl.full([BLOCK_C], _NEG, tl.float32), 0)
        ls = tl.sum(tl.zeros([BLOCK_C], tl.float32), 0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for cb in range(c0, c1, BLOCK_C):
            cm = (cb + rc) < c1
            mc = tl.load(m_ptr + hq * NCH + cb + rc, mask=cm, other=_NEG)
            lc = tl.load(l_ptr + hq * NCH + cb + rc, mask=cm, other=0.0)
            oc = tl.load(o_ptr + (hq * NCH + cb + rc)[:, None] * BLOCK_D + rd[None, :], mask=cm[:, None], other=0.0)
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
            m, l, o = _chunk(q, k_ptr + hk * stride_kh, v_ptr + hk * stride_vh, c, L, lo,
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
                     split: bool | None = None) -> torch.Tensor:
    """Attention of one query token over the first `length` cache positions. Returns fp16 [Hq, D].

    split=None follows TRAPETUM_ATTN (``seq`` -> sequential kernel, else split-KV).
    workspace: optional (m, l, o) fp32 buffers [Hq, NCH], [Hq, NCH], [Hq, NCH, BLOCK_D] from
    ``attention_workspace`` so that a captured decode step allocates nothing.
    """
    _check(q, k_cache, v_cache, length, scale, window, softcap)
    hq, d = q.shape
    hkv, tmax, _ = k_cache.shape
    g = hq // hkv
    if out is None:
        out = torch.empty(hq, d, dtype=torch.float16, device=q.device)
    elif out.shape != (hq, d) or out.dtype != torch.float16 or out.stride(1) != 1:
        raise ValueError(f"out: expected float16 [{hq}, {d}] with a contiguous last dim")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1" or triton is None:
        r = decode_attention_torch(q, k_cache, v_cache, length, scale=scale, window=window,
                                   softcap=softcap, dtype=torch.float32)
        return out.copy_(r)
    len_ptr = length if isinstance(length, torch.Tensor) else out  # dummy pointer when unused
    len_val = 0 if isinstance(length, torch.Tensor) else int(length)
    BLOCK_G = max(16, triton.next_power_of_2(g))
    BLOCK_D = max(16, triton.next_power_of_2(d))
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
                                 BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, CH=CHUNK, num_warps=4, **common)
        return out
    nch = triton.cdiv(tmax, CHUNK)
    m, l, o = workspace if workspace is not None else attention_workspace(hq, d, tmax, q.device)
    _attn_split_kernel[(hkv, nch)](q, k_cache, v_cache, len_ptr, len_val, m, l, o, g, d, nch,
                                   q.stride(0), k_cache.stride(0), k_cache.stride(1),
                                   v_cache.stride(0), v_cache.stride(1), float(scale), cap, win,
                                   HAS_CAP=softcap is not None, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D,
                                   CH=CHUNK, num_warps=4, **common)
    _attn_merge_kernel[(hq,)](len_ptr, len_val, m, l, o, out, d, nch, out.stride(0), win,
                              BLOCK_D=BLOCK_D, CH=CHUNK, BLOCK_C=MERGE_CHUNKS, num_warps=4, **common)
    return out


def attention_workspace(hq: int, d: int, t_max: int, device) -> tuple:
    """Scratch buffers for split-KV decode attention (allocate once, outside graph capture)."""
    nch = -(-t_max // CHUNK)
    bd = max(16, 1 << max(0, math.ceil(math.log2(d))))
    return (torch.empty(hq, nch, dtype=torch.float32, device=device),
            torch.empty(hq, nch, dtype=torch.float32, device=device),
            torch.empty(hq, nch, bd, dtype=torch.float32, device=device))
