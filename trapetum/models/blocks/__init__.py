"""The model, written once: block kinds as functions ``forward(x, batch, ops, p)`` over primitive ops.

Each block kind is one module here: ``attention`` or ``mla`` (latent attention), then ``mlp`` or ``moe``
(mixture of experts); ``ModelConfig.block_kinds(i)`` says which a layer has. A block reads its weights from ``p`` (the block's
parameters, by role: ``p.qkv``, ``p.o``, ``p.input_norm``, ...) and computes only through ``ops``, so the same
code runs on every executor:

    models/torch_ops.py    TorchOps: the torch reference (CPU tests, float32 / float64), HF semantics
    runtime/engine_ops.py  EngineOps: the GPU engine (fused kernels, static graphs, DECODE / VERIFY rows)
    runtime/precise.py     PreciseOps: the engine's prefill at fp32-reference accuracy

The ops an executor provides (x is the residual stream, [..., D]; a backend keeps it in its own dtype):

    norm(x, w, eps=None, feeds=None)   RMSNorm over the last dim with the config's eps (or ``eps``) and offset
    project(w, x, residual=None)       x @ W^T (+ bias) (+ residual): a projection of the backend's form
    heads(qkv)                         (q [..., Hq, hd], k [..., Hkv, hd], v [..., Hkv, hd]) views of a fused output
    attend(q, k, v, batch, p, feeds=None)  RoPE, KV-cache append and causal attention of the rows -> [..., Hq * hd]
    gate_up(w, x, feeds=None)          act(gate(x)) * up(x)

``feeds``: the one projection that reads the op's result and nothing else does (the block passes it only then).
An executor may hand over the result in that projection's own input layout (the engine's fragment order,
runtime/engine_ops.py), which only ``project`` / ``gate_up`` / ``logits`` with that projection accept; the
others ignore it.
    add(x, y)                          x + y in the residual stream's dtype
    embed(table, batch)                token rows (times the config's embedding scale)
    logits(head, h)                    fp32 logits of the rows that need them (final softcap applied)
    split(x, sizes)                    views of x along its last dim
    latent_attend(q, c, k_rot, batch, p)   MLA: RoPE, cache append and causal attention over the latent
                                       (mla.py) -> [..., Hq * v_head_dim]
    route(router, h)                   (weights fp32 [..., k], experts int64 [..., k]) of each row (moe.select_experts)
    experts(experts, h, weights, idx)  sum_j weights_j * expert_{idx_j}(h), in the residual stream's dtype
    sigmoid_gate(w, h, y)              sigmoid(w . h) * y (Qwen2-MoE's shared-expert gate)
    sparsify(x, t, batch)              x * (|x| > t), rows at positions < DENSE_POSITIONS unchanged (activation
                                       sparsity, models/sparsity.py; called only when a layer has thresholds)
"""
from __future__ import annotations

from . import attention, mla, mlp, moe

# block kind -> forward function; a layer runs its kinds in order (ModelConfig.block_kinds)
FORWARD = {"attention": attention.forward, "mla": mla.forward, "mlp": mlp.forward, "moe": moe.forward}


def layer_forward(x, batch, ops, layer):
    """One decoder layer: its blocks in order. ``layer.blocks`` is a list of (kind, params)."""
    for kind, p in layer.blocks:
        x = FORWARD[kind](x, batch, ops, p)
    return x


def decoder_forward(batch, ops, model, on_layer=None, run_layer=None):
    """Logits fp32 of the rows ``batch.logits`` selects: embedding, the layers, final norm, LM head.
    ``model`` gives ``embed``, ``layers``, ``final_norm``, ``head`` in the backend's form. ``on_layer(i)``
    (profiling, None otherwise): called with -1 after the embedding and with i after layer i (eval/bench_offload.py
    syncs and reads the clock there; it must not run inside a CUDA graph capture). ``run_layer(x, batch, ops,
    layer)`` (default ``layer_forward``): a backend that runs some layers whole in one call of its own (the CPU
    executor's dense layers, models/cpu_ops.py) gives it here, the same ops in the same order."""
    run = layer_forward if run_layer is None else run_layer
    x = ops.embed(model.embed, batch)
    if on_layer is not None:
        on_layer(-1)
    for i, layer in enumerate(model.layers):
        x = run(x, batch, ops, layer)
        if on_layer is not None:
            on_layer(i)
    if batch.logits == "last":
        x = x[..., -1:, :] if batch.last_row is None else x.index_select(-2, batch.last_row)
    return ops.logits(model.head, ops.norm(x, model.final_norm, feeds=model.head))
