"""The GPU engine's absorbed latent attention (``Options.mla == "latent"``; models/blocks/mla.py, kernels/
latent_attention.py): the cache holds per position the latent [c, RoPE(k_rot)] (kv_lora_rank + qk_rope_head_dim
fp16 values: ``eng.kv.k`` [L, 1, T_max, R + P], ``eng.kv.v`` empty) instead of per-head keys and values.

    setup(eng)         at load: per MLA layer, kv_b's per-head key and value blocks in fp16 (``w_uk_t`` [H, R, nope]
                       = W_uk^T, ``w_uv`` [H, vd, R]: kv_b dequantized once, a copy of kv_b's size), and the split
                       workspace of the attention kernel
    attend(ops, ...)   DECODE / VERIFY rows: RoPE of q_rot and k_rot and the new rows' latents written to the cache
                       in one launch (kernels/latent_attention.rope_latent_append; the table rows read at the device
                       position: capturable), q_lat = W_uk^T q_nope, attention over the latent cache, a = W_uv o
                       (four launches in all); every op row by row, so a VERIFY row is bitwise the decode step at
                       its position.
                       PREFILL: the same RoPE and cache rows; attention expanded from the latent cache through kv_b
                       (as the reference), fp32 softmax.
"""
from __future__ import annotations

import torch

from ..kernels import latent_attention as la
from ..models.batch import MAX_VERIFY_ROWS, ForwardBatch


def setup(eng) -> None:
    cfg = eng.cfg
    H, nope, vd, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    for L in eng.model.layers:
        w = L.blocks[0][1]
        if L.blocks[0][0] != "mla":
            continue
        kvb = w.kv_b.weight16().view(H, nope + vd, R)
        w.w_uk_t = kvb[:, :nope].transpose(1, 2).contiguous()  # [H, R, nope]
        w.w_uv = kvb[:, nope:].contiguous()  # [H, vd, R]
    eng.latent_ws = la.workspace(MAX_VERIFY_ROWS, H, R, eng.max_len, eng.device) if la.available(eng.device) \
        else None


def attend(ops, q, c, k_rot, batch: ForwardBatch, p):
    eng, cfg = ops.eng, ops.cfg
    n, H = q.shape[0], cfg.num_heads
    nope, P, R, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    cache = eng.kv.k[p.layer, 0]  # [T_max, R + P]
    q = q.view(n, H, nope + P)
    if ops.rows:
        cos, sin = eng.rope
        start = batch.start  # the graph's position tensor
    else:
        start = int(batch.start)
        cos, sin = eng.pass_rope(False, start, n)
    q_rot = la.rope_latent_append(q, c, k_rot, cos, sin, start, cache, nope, eng.rope_perm is not None)
    if ops.rows:
        q_lat = la.head_gemv(q[..., :nope], p.w_uk_t)  # [n, H, R], q's nope features read in place
        o = la.latent_attention(q_lat, q_rot, cache, batch.start, cfg.scale, ws=eng.latent_ws)
        return la.head_gemv(o, p.w_uv).view(n, H * vd)
    S = start + n
    kv = ops.project(p.kv_b, cache[:S, :R].contiguous()).view(S, H, nope + vd)
    s = torch.einsum("thd,shd->hts", q[..., :nope].float(), kv[..., :nope].float())
    s = (s + torch.einsum("thd,sd->hts", q_rot.float(), cache[:S, R:].float())) * cfg.scale
    allowed = torch.arange(S, device=q.device)[None, :] <= torch.arange(start, S, device=q.device)[:, None]
    a = torch.einsum("hts,shd->thd", s.masked_fill(~allowed, float("-inf")).softmax(-1), kv[..., nope:].float())
    return a.to(torch.float16).reshape(n, H * vd)
