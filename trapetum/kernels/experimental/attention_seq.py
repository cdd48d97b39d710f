"""The sequential decode-attention kernel: one program per kv head walks every CHUNK-position chunk of the cache
with an online softmax (no workspace, no merge). The split-KV kernel (kernels/attention.py) replaced it; it stays
as the sweep's reference row (scripts/attn_sweep.py) and is checked against the float64 reference by the tests.
Same layouts and semantics as attention.decode_attention.
"""
from __future__ import annotations

import torch

from .. import attention as at
from ..attn_configs import block_d, block_g
from ..triton_util import HAVE_TRITON, triton_ok

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from ..attention import _NEG, _chunks, _load_len, _load_q, _online, _tile

CHUNK = 64  # positions per step (fixed)
SEQ_STAGES = 3  # its num_stages (Triton's default, what it always ran with)

if HAVE_TRITON:

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
            mx, ls, acc = _online(mx, ls, acc, m, l, o)
        out = acc / ls[:, None]
        tl.store(out_ptr + hq[:, None] * stride_oh + rd[None, :], out.to(tl.float16),
                 mask=gmask[:, None] & (rd[None, :] < D))


def decode_attention_seq(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length, *, scale: float,
                         window: int | None = None, softcap: float | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention by the sequential kernel (one launch, grid Hkv). Returns fp16 [Hq, D]."""
    if not triton_ok(q.device):
        return at.decode_attention(q, k_cache, v_cache, length, scale=scale, window=window, softcap=softcap, out=out)
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype != torch.float16 or q.stride(1) != 1:
        raise ValueError("q: expected float16 [Hq, D] with a contiguous last dim")
    at._check_heads(q.shape[0], q.shape[1], q.device, k_cache, v_cache, scale, window, softcap)
    out = at._check_out(out, q.shape, q.device)
    is_t = isinstance(length, torch.Tensor)
    if not is_t and not 1 <= int(length) <= k_cache.shape[1]:
        raise ValueError(f"length: {length} outside 1..{k_cache.shape[1]}")
    g = q.shape[0] // k_cache.shape[0]
    _attn_seq_kernel[(k_cache.shape[0],)](q, k_cache, v_cache, length if is_t else out, 0 if is_t else int(length),
                                          out, g, q.shape[1], q.stride(0), k_cache.stride(0), k_cache.stride(1),
                                          v_cache.stride(0), v_cache.stride(1), out.stride(0), float(scale),
                                          float(softcap) if softcap is not None else 1.0,
                                          int(window) if window is not None else 0, LEN_PTR=is_t,
                                          HAS_WIN=window is not None, HAS_CAP=softcap is not None,
                                          BLOCK_G=block_g(g), BLOCK_D=block_d(q.shape[1]), CH=CHUNK, num_warps=4,
                                          num_stages=SEQ_STAGES)
    return out
