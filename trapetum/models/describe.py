"""``describe(ckpt)``: what ``trapetum info`` and ``Model.info()`` show about a checkpoint (architecture,
parameter count, tensor formats, memory). Light on purpose: it needs the checkpoint's description only, not the
decoder or the kernels, so that ``trapetum info`` starts fast (issue 22)."""
from __future__ import annotations

import math
from collections import Counter
from typing import Any

from .checkpoint import Checkpoint
from .schema import expected_shapes


def describe(ckpt: Checkpoint, decoder: Any = None) -> dict[str, Any]:
    """A JSON-able summary of ``ckpt``; with ``decoder`` (a loaded torch module) also the bytes its weights take."""
    cfg = ckpt.config
    n_params = sum(math.prod(shp) for shp in expected_shapes(cfg).values())
    formats = Counter(ckpt.tensor_formats().values())
    weight_bytes = None
    if decoder is not None:
        seen = set()
        weight_bytes = 0
        for t in list(decoder.parameters()) + list(decoder.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                weight_bytes += t.numel() * t.element_size()
    # the engine's cache: per-head keys and values (latent attention's padded to one size, runtime/engine_ops.py)
    hd = max(cfg.head_dim, cfg.v_head_dim) if cfg.mla else cfg.head_dim
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * hd
    info = {
        "source": ckpt.source, "format": ckpt.source_format, "family": cfg.family,
        "parameters": n_params, "layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "heads": f"{cfg.num_heads} q / {cfg.num_kv_heads} kv x {cfg.head_dim}",
        "vocab_size": cfg.vocab_size, "context": cfg.max_position_embeddings,
        "tensor_formats": dict(formats),
        "memory_fp16_weights_bytes": 2 * n_params,
        "kv_cache_fp16_bytes_per_token": 2 * kv_per_token,
    }
    info.update(moe_mla_structure(cfg, n_params))
    if weight_bytes is not None:
        info["memory_loaded_weights_bytes"] = weight_bytes
    if ckpt.meta:
        info["meta"] = {k: v for k, v in ckpt.meta.items() if k in ("recipe", "provenance", "sizes")}
    return info


def moe_mla_structure(cfg, n_params: int) -> dict[str, Any]:
    """``moe``: experts, top-k, routing, MoE / dense layers and the active parameters per token (every parameter
    but the experts a token's router does not choose: (E - k) x 3 x hidden x expert ffn per MoE layer); ``mla``:
    the latent attention's ranks and the latent cache a token would need (kv_lora_rank + qk_rope per layer)."""
    out: dict[str, Any] = {}
    if cfg.moe:
        n_moe = cfg.mlp_types.count("moe")
        idle = n_moe * (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        out["moe"] = {"experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
                      "expert_intermediate_size": cfg.moe_intermediate_size,
                      "shared_intermediate_size": cfg.shared_expert_intermediate_size,
                      "shared_expert_gate": cfg.shared_expert_gate, "scoring": cfg.router_scoring,
                      "choice": cfg.router_topk, "groups": [cfg.n_group, cfg.topk_group],
                      "norm_topk_prob": cfg.norm_topk_prob, "routed_scaling_factor": cfg.routed_scaling_factor,
                      "moe_layers": n_moe, "dense_layers": cfg.num_layers - n_moe,
                      "active_parameters_per_token": n_params - idle}
    if cfg.mla:
        out["mla"] = {"q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
                      "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
                      "v_head_dim": cfg.v_head_dim,
                      "latent_cache_fp16_bytes_per_token": 2 * cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)}
    return out
