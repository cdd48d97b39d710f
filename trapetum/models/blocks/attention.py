"""Attention block (Llama / Mistral / Qwen2 / Gemma / Phi-3 semantics):

    h = input_norm(x); q, k, v = heads(Wqkv h (+ b)); [q, k = q_norm(q), k_norm(k)]
    a = attention(RoPE(q), RoPE(k), v) over the cache and the new rows (causal; sliding window on sliding layers;
        softcap where the config has one)
    x = x + Wo a                      or, with sandwich norms (Gemma-2/3), x + post_norm(Wo a)

Parameters ``p`` (by role): input_norm, qkv (q, k and v stacked along the output rows), o, q_norm, k_norm,
post_norm (None where the family has none), layer (its index: the KV cache's layer), sliding (bool), sparsity
(the layer's ``SiteThresholds``, models/sparsity.py, or None: dense): h and a thresholded (``ops.sparsify``)
before the projections that read them.
"""
from __future__ import annotations


def forward(x, batch, ops, p):
    sp = p.sparsity
    h = ops.norm(x, p.input_norm, feeds=p.qkv if sp is None else None)
    if sp is not None:
        h = ops.sparsify(h, sp.qkv, batch)
    q, k, v = ops.heads(ops.project(p.qkv, h))
    if p.q_norm is not None:
        q, k = ops.norm(q, p.q_norm), ops.norm(k, p.k_norm)
    a = ops.attend(q, k, v, batch, p, feeds=p.o if sp is None else None)
    if sp is not None:
        a = ops.sparsify(a, sp.o, batch)
    if p.post_norm is not None:
        return ops.add(x, ops.norm(ops.project(p.o, a), p.post_norm))
    return ops.project(p.o, a, residual=x)


def row_heads(cfg, qkv):
    """Views (q [M, Hq, hd], k [M, Hkv, hd], v [M, Hkv, hd]) of a fused q/k/v output [M, (Hq + 2 Hkv) hd]: the
    ``heads`` op of the executors whose rows are 2-D (the engine's, the CPU step's)."""
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    n = qkv.shape[0]
    return (qkv[:, :qd].view(n, cfg.num_heads, cfg.head_dim),
            qkv[:, qd:qd + kd].view(n, cfg.num_kv_heads, cfg.head_dim),
            qkv[:, qd + kd:].view(n, cfg.num_kv_heads, cfg.head_dim))
