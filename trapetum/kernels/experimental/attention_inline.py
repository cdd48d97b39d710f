"""Decode attention of one token in one launch: the split kernel merges inline (no merge kernel).

Each split program with visible positions runs the production decode program (attention._split_one: RoPE + KV
append when fused, the chunk's partials stored to the workspace), then adds 1 to its kv head's counter (atomic,
acq_rel, gpu scope, after a CTA barrier: the release covers every thread's stores); the program that arrives last
(the count reaches the number of chunks with visible positions) merges the chunks of the G heads with the merge
kernel's code (same chunk steps, same fixed order: the same bits whichever program arrives last), writes the output
and sets the counter back to 0 for the next call / replay. On the H200 it lost to the merge kernel for GQA and at 4k
positions (its last program merges G heads x 64 chunks one step after another; NOTES-engine.md, session 5).

The last program folds BLOCK_C chunks x BLOCK_DM columns per step, one L2 round trip each: G * BLOCK_D / BLOCK_DM
steps one after the other. BLOCK_DM is chosen so that a step's partials take MERGE_REGS fp32 registers per thread
(scripts/gpu_attn_fused.py --inline times it).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import attention as at
from .. import pdl
from ..attn_configs import block_d, block_g, loops, n_chunks, resolve_config
from ..fused import check_rope_kv
from ...settings import DEFAULT_KERNELS, KernelOptions
from ..triton_util import HAVE_TRITON, triton_ok

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from ..attention import _chunks, _load_len, _merge_cols, _split_one

MERGE_REGS = 64


class InlineWorkspace(NamedTuple):
    """attention.AttnWorkspace's m, l, o (one row) and counters int32 [Hq] (>= Hkv used): zero between calls."""
    m: torch.Tensor
    l: torch.Tensor
    o: torch.Tensor
    counters: torch.Tensor


def inline_workspace(hq: int, d: int, t_max: int, device, *, hkv: int | None = None, config=None) -> InlineWorkspace:
    m, l, o = at.attention_workspace(hq, d, t_max, device, hkv=hkv, config=config)
    return InlineWorkspace(m, l, o, torch.zeros(hq, dtype=torch.int32, device=device))


if HAVE_TRITON:

    @triton.jit
    def _merge_group(m_ptr, l_ptr, o_ptr, out_ptr, hk, G, D, c0, c1, NCH, stride_oh,
                     BLOCK_D: tl.constexpr, BLOCK_DM: tl.constexpr, BLOCK_C: tl.constexpr):
        # the G query heads of kv head hk, BLOCK_DM columns at a time. The partials were written by other
        # programs (SMs): read through L2 (.cg), after the acquire of the counter.
        for g in range(G):
            hq = hk * G + g
            for d0 in tl.static_range(0, BLOCK_D, BLOCK_DM):
                rd = d0 + tl.arange(0, BLOCK_DM)
                out = _merge_cols(m_ptr, l_ptr, o_ptr, hq, rd, c0, c1, NCH, BLOCK_D, BLOCK_DM, BLOCK_C, ".cg")
                tl.store(out_ptr + hq * stride_oh + rd, out.to(tl.float16), mask=rd < D)

    @triton.jit
    def _attn_inline_kernel(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, t_ptr, t_val,
                            m_ptr, l_ptr, o_ptr, cnt_ptr, out_ptr, G, D, HALF, NCH, stride_qh, stride_knh, stride_vnh,
                            stride_kh, stride_kt, stride_vh, stride_vt, stride_oh, scale, softcap, window,
                            T_PTR: tl.constexpr, ROPE: tl.constexpr, HAS_WIN: tl.constexpr, HAS_CAP: tl.constexpr,
                            BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                            CH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, LOOP: tl.constexpr,
                            BLOCK_DM: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
        pdl.pdl_enter(PDL)
        t = _load_len(t_ptr, t_val, T_PTR)
        _split_one(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, t, m_ptr, l_ptr, o_ptr,
                   G, D, HALF, NCH, stride_qh, stride_knh, stride_vnh, stride_kh, stride_kt, stride_vh, stride_vt,
                   scale, softcap, window, ROPE, ROPE, HAS_WIN, HAS_CAP, BLOCK_G, BLOCK_D, BLOCK_H,
                   CH, BN, SPLITS, LOOP)
        hk = tl.program_id(0)
        c = tl.program_id(1)
        L = t + 1 if ROPE else t
        _, _, _, c0, c1 = _chunks(L, window, HAS_WIN, CH, BN, SPLITS)
        if (c >= c0) & (c < c1):
            tl.debug_barrier()  # every thread's partials stored before the release below
            arrived = tl.atomic_add(cnt_ptr + hk, 1, sem="acq_rel", scope="gpu")
            if arrived == c1 - c0 - 1:  # the last of the head's chunks: all partials are visible
                _merge_group(m_ptr, l_ptr, o_ptr, out_ptr, hk, G, D, c0, c1, NCH, stride_oh,
                             BLOCK_D, BLOCK_DM, BLOCK_C)
                tl.store(cnt_ptr + hk, 0)  # ready for the next call (graph replay)


def _launch(q, rope, k_cache, v_cache, t, *, scale, window, softcap, out, workspace, config, kopts):
    hq, d = q.shape
    hkv, tmax, _ = k_cache.shape
    g = hq // hkv
    cfg = resolve_config(config, d, g, tmax, hkv)
    nch = n_chunks(cfg, tmax)
    bd = block_d(d)
    ws = workspace if workspace is not None else inline_workspace(hq, d, tmax, q.device, config=cfg)
    if not (isinstance(ws, tuple) and len(ws) == 4):
        raise ValueError("workspace: expected the InlineWorkspace of inline_workspace()")
    at._check_workspace(ws[:3], hq, nch, bd, cfg, hq)
    if ws.counters.dtype != torch.int32 or ws.counters.numel() < hkv or not ws.counters.is_contiguous():
        raise ValueError(f"workspace: counters must be int32 [>={hkv}] contiguous (zeros)")
    k, v, cos, sin = rope if rope is not None else (q, q, ws.m, ws.m)
    half = cos.shape[1] if rope is not None else 1
    is_t = isinstance(t, torch.Tensor)
    bc = at._merge_block_c(cfg, nch)
    _attn_inline_kernel[(hkv, nch)](q, k, v, k_cache, v_cache, cos, sin, t if is_t else out, 0 if is_t else int(t),
                                    ws.m, ws.l, ws.o, ws.counters, out, g, d, half, ws.m.shape[1], q.stride(0),
                                    k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
                                    v_cache.stride(1), out.stride(0), float(scale),
                                    float(softcap) if softcap is not None else 1.0,
                                    int(window) if window is not None else 0, T_PTR=is_t, ROPE=rope is not None,
                                    HAS_WIN=window is not None, HAS_CAP=softcap is not None, BLOCK_G=block_g(g),
                                    BLOCK_D=bd, BLOCK_H=triton.next_power_of_2(half), CH=cfg.chunk, BN=cfg.block_n,
                                    SPLITS=cfg.splits, LOOP=loops(cfg),
                                    BLOCK_DM=min(bd, MERGE_REGS * 32 * cfg.warps // bc), BLOCK_C=bc, num_warps=cfg.warps, num_stages=cfg.stages,
                                    **pdl.launch_kwargs(q.device, kopts))
    return out


def decode_attention_inline(q, k_cache, v_cache, length, *, scale, window=None, softcap=None, out=None,
                            workspace: InlineWorkspace | None = None, config=None,
                            kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """attention.decode_attention in one launch (the inline merge). The workspace's counters must be zero
    (inline_workspace makes them so, and every call leaves them so)."""
    if not triton_ok(q.device):
        return at.decode_attention(q, k_cache, v_cache, length, scale=scale, window=window, softcap=softcap, out=out,
                                   config=config)
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype != torch.float16 or q.stride(1) != 1:
        raise ValueError("q: expected float16 [Hq, D] with a contiguous last dim")
    at._check_heads(q.shape[0], q.shape[1], q.device, k_cache, v_cache, scale, window, softcap)
    if not isinstance(length, torch.Tensor) and not 1 <= int(length) <= k_cache.shape[1]:
        raise ValueError(f"length: {length} outside 1..{k_cache.shape[1]}")
    out = at._check_out(out, q.shape, q.device)
    return _launch(q, None, k_cache, v_cache, length, scale=scale, window=window, softcap=softcap, out=out,
                   workspace=workspace, config=config, kopts=kopts)


def decode_attention_fused_inline(q, k, v, k_cache, v_cache, pos, cos, sin, *, scale, window=None, softcap=None,
                                  out=None, workspace: InlineWorkspace | None = None, config=None,
                                  kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """attention.decode_attention_fused in one launch (RoPE + KV append + split-KV + inline merge)."""
    if not triton_ok(q.device):
        return at.decode_attention_fused(q, k, v, k_cache, v_cache, pos, cos, sin, scale=scale, window=window,
                                         softcap=softcap, out=out, config=config)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"{name}: expected one token [H, D], got {tuple(getattr(x, 'shape', ()))}")
    check_rope_kv(q, k, v, k_cache, v_cache, pos, cos, sin)
    at._check_heads(q.shape[0], q.shape[1], q.device, k_cache, v_cache, scale, window, softcap)
    out = at._check_out(out, q.shape, q.device)
    return _launch(q, (k, v, cos.contiguous(), sin.contiguous()), k_cache, v_cache, pos, scale=scale, window=window,
                   softcap=softcap, out=out, workspace=workspace, config=config, kopts=kopts)
