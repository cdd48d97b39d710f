"""Multi-head latent attention block (DeepSeek-V2/V3):

    h = input_norm(x)
    q = Wq h                          or, with q_lora_rank, Wq_b q_a_norm(Wq_a h)          [H, qk_nope + qk_rope]
    c, k_rot = split(Wkv_a h)         the latent [kv_lora_rank] and one shared rotary key [qk_rope]
    c = kv_a_norm(c)
    a = latent_attend(q, c, k_rot)    per head h: k_h = [k_nope_h, RoPE(k_rot)], v_h from Wkv_b c (kv_b_proj);
                                      q_h = [q_nope_h, RoPE(q_rot_h)]; causal softmax(q k^T * scale) v   [H * v_head_dim]
    x = x + Wo a

The latent norms use eps 1e-6 (config.LATENT_NORM_EPS: DeepSeek builds them with the default, not rms_norm_eps).
What an executor caches is its choice: the reference caches the latent [c, RoPE(k_rot)] (kv_lora_rank + qk_rope per
token, one "head") and expands it through kv_b every pass, as transformers does; the engine today expands the new
rows once and caches per-head keys and values (runtime/engine_ops.py; the absorbed form over the latent cache is a
GPU kernel still to come, NOTES-engine.md).

Parameters ``p`` (by role): input_norm, q (or None), q_a, q_a_norm, q_b (or None), kv_a, kv_a_norm, kv_b, o,
layer (the cache layer).
"""
from __future__ import annotations

from ..config import LATENT_NORM_EPS


def forward(x, batch, ops, p):
    cfg = ops.cfg
    h = ops.norm(x, p.input_norm)
    if p.q is not None:
        q = ops.project(p.q, h)
    else:
        q = ops.project(p.q_b, ops.norm(ops.project(p.q_a, h), p.q_a_norm, LATENT_NORM_EPS))
    c, k_rot = ops.split(ops.project(p.kv_a, h), (cfg.kv_lora_rank, cfg.qk_rope_head_dim))
    c = ops.norm(c, p.kv_a_norm, LATENT_NORM_EPS)
    a = ops.latent_attend(q, c, k_rot, batch, p)
    return ops.project(p.o, a, residual=x)
