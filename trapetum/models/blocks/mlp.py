"""Dense gated MLP block (SwiGLU / GeGLU):

    h = norm(x); g = act(Wgate h) * (Wup h)
    x = x + Wdown g                   or, with sandwich norms (Gemma-2/3), x + post_norm(Wdown g)

Parameters ``p`` (by role): norm (post_attention_layernorm, or pre_feedforward_layernorm with sandwich norms),
gate_up (the gate and up projections with the config's activation), down, post_norm (None where absent), sparsity
(the layer's ``SiteThresholds`` or None: dense): h and g thresholded (``ops.sparsify``) before gate/up and down.
"""
from __future__ import annotations


def forward(x, batch, ops, p):
    sp = p.sparsity
    h = ops.norm(x, p.norm, feeds=p.gate_up if sp is None else None)
    if sp is not None:
        h = ops.sparsify(h, sp.gate_up, batch)
    g = ops.gate_up(p.gate_up, h, feeds=p.down if sp is None else None)
    if sp is not None:
        g = ops.sparsify(g, sp.down, batch)
    if p.post_norm is not None:
        return ops.add(x, ops.norm(ops.project(p.down, g), p.post_norm))
    return ops.project(p.down, g, residual=x)
