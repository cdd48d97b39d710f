"""GGUF mixture-of-experts and latent-attention models (llama.cpp's conventions), for formats/gguf.py.

Architectures: ``qwen2moe``, ``qwen3moe``, ``deepseek2`` (DeepSeek-V2 / V3: latent attention) and ``llama`` with
``llama.expert_count`` (Mixtral). Metadata, ``{arch}.`` prefixed:

    expert_count, expert_used_count             E, top-k
    expert_feed_forward_length                  each routed expert's intermediate size (Mixtral: feed_forward_length)
    expert_shared_feed_forward_length           Qwen2-MoE's shared expert; DeepSeek: expert_shared_count x the above
    leading_dense_block_count                   DeepSeek's first_k_dense_replace (any layer without ffn_gate_inp is
                                                dense: Qwen's mlp_only_layers too)
    expert_weights_norm, expert_weights_scale   norm_topk_prob, routed_scaling_factor
    expert_gating_func                          1 softmax, 2 sigmoid (DeepSeek-V3)
    expert_group_count, expert_group_used_count n_group, topk_group
    attention.q_lora_rank, attention.kv_lora_rank, attention.key_length(_mla), attention.value_length(_mla),
    rope.dimension_count (qk_rope_head_dim), rope.scaling.yarn_log_multiplier (0.1 x mscale_all_dim)

Tensors, per layer ``blk.N.``: ``ffn_gate_inp`` (router [E, D]), ``exp_probs_b.bias`` (the correction bias),
``ffn_{gate,up,down}_exps`` (every expert stacked: [E, Im, D], [E, D, Im]; split per expert here),
``ffn_{gate,up,down}_shexp`` and ``ffn_gate_inp_shexp`` (the shared expert and its gate); latent attention:
``attn_q`` or ``attn_q_a`` / ``attn_q_a_norm`` / ``attn_q_b``, ``attn_kv_a_mqa``, ``attn_kv_a_norm``, and
``attn_kv_b`` [H (nope + v), r] or, from newer converters, its two halves ``attn_k_b`` [H, r, nope] (transposed)
and ``attn_v_b`` [H, v, r], joined back here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

MOE_ARCHS: dict[str, dict[str, Any]] = {
    "qwen2moe": {"family": "qwen2_moe", "qkv_bias": True, "norm_topk": False},
    "qwen3moe": {"family": "qwen3_moe", "qk_norm": True, "norm_topk": True},
    "deepseek2": {"family": "deepseek_v2", "norm_topk": False},
}

LAYER_TENSORS: dict[str, str] = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
STACKED = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
SPLIT_KV_B = ("attn_k_b", "attn_v_b")


def is_moe(arch: str, meta: dict[str, Any]) -> bool:
    return arch in MOE_ARCHS or f"{arch}.expert_count" in meta


def config_fields(arch: str, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], g: Callable,
                  L: int, H: int, I: int, where: str) -> dict[str, Any]:
    """ModelConfig keyword arguments of the experts and (deepseek2) latent attention; ``g(key, kind, default)``
    reads ``{arch}.key``."""
    q = MOE_ARCHS.get(arch, {"family": "mixtral", "norm_topk": True})
    out: dict[str, Any] = {"family": q["family"]}
    E = g("expert_count", int, 0)
    if E:
        k = g("expert_used_count", int, None)
        if k is None:
            raise ConfigError(f"{where}: GGUF metadata has no '{arch}.expert_used_count'")
        types = ["moe" if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes else "dense" for i in range(L)]
        Im = g("expert_feed_forward_length", int, I if arch == "llama" else None)
        if Im is None:
            raise ConfigError(f"{where}: GGUF metadata has no '{arch}.expert_feed_forward_length'")
        gating = g("expert_gating_func", int, 1)
        if gating not in (1, 2):
            raise ConfigError(f"{where}: GGUF metadata {arch}.expert_gating_func = {gating} (1 softmax, 2 sigmoid)")
        bias = any(n.endswith(".exp_probs_b.bias") for n in tensor_shapes)
        n_group, topk_group = g("expert_group_count", int, 1) or 1, g("expert_group_used_count", int, 1) or 1
        topk = "noaux_tc" if gating == 2 and bias else ("group_limited_greedy" if n_group > 1 else "greedy")
        shared = g("expert_shared_feed_forward_length", int, 0)
        if arch == "deepseek2":
            shared = g("expert_shared_count", int, 0) * Im
        norm = g("expert_weights_norm", bool, q["norm_topk"])
        out.update(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=Im, mlp_types=types,
                   router_scoring="sigmoid" if gating == 2 else "softmax", router_topk=topk, n_group=n_group,
                   topk_group=topk_group if topk != "greedy" else 1, router_bias=bias, norm_topk_prob=bool(norm),
                   routed_scaling_factor=g("expert_weights_scale", float, 1.0),
                   shared_expert_intermediate_size=shared,
                   shared_expert_gate=any(n.endswith(".ffn_gate_inp_shexp.weight") for n in tensor_shapes))
    if arch == "deepseek2":
        kv = g("attention.kv_lora_rank", int, None)
        if kv is None:
            raise ConfigError(f"{where}: GGUF metadata has no '{arch}.attention.kv_lora_rank'")
        hd = g("attention.key_length_mla", int, None) or g("attention.key_length", int, None)
        vd = g("attention.value_length_mla", int, None) or g("attention.value_length", int, None)
        rope = g("rope.dimension_count", int, None)
        if hd is None or vd is None or rope is None:
            raise ConfigError(f"{where}: GGUF metadata needs {arch}.attention.key_length, value_length and "
                              "rope.dimension_count (latent attention)")
        out.update(q_lora_rank=g("attention.q_lora_rank", int, 0), kv_lora_rank=kv, qk_rope_head_dim=rope,
                   v_head_dim=vd, rope_interleave=True, head_dim=hd, num_kv_heads=H, partial_rotary_factor=1.0)
    return out


def yarn_scaling(g: Callable, arch: str) -> dict[str, Any]:
    """HF rope_scaling of a GGUF YaRN config: DeepSeek's yarn_log_multiplier is 0.1 x mscale_all_dim (llama.cpp
    takes mscale equal to it)."""
    s: dict[str, Any] = {"rope_type": "yarn", "factor": g("rope.scaling.factor", float, None)}
    orig = g("rope.scaling.original_context_length", int, None)
    if orig is not None:
        s["original_max_position_embeddings"] = orig
    mul = g("rope.scaling.yarn_log_multiplier", float, None)
    if mul:
        s["mscale"] = s["mscale_all_dim"] = mul / 0.1
    return s


def expand(name: str, shape: tuple[int, ...], load: Callable[[], torch.Tensor], cfg, pending: dict, where: str
           ) -> dict[str, tuple[Callable[[], torch.Tensor], tuple[int, ...]]] | None:
    """Canonical (getter, shape) pairs of one GGUF tensor of an MoE / MLA layer, or None when it is not one.
    ``attn_k_b`` / ``attn_v_b`` are held in ``pending`` until both halves are there (``join_kv_b``)."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    i, base, suffix = parts[1], parts[2], parts[3]
    p = f"model.layers.{i}."
    if base == "exp_probs_b" and suffix == "bias":
        return {p + "mlp.gate.e_score_correction_bias": (load, shape)}
    if base in LAYER_TENSORS:
        return {f"{p}{LAYER_TENSORS[base]}.{suffix}": (load, shape)}
    if base in STACKED and suffix == "weight":
        if len(shape) != 3 or shape[0] != cfg.num_experts:
            raise ConfigError(f"{where}: tensor {name} has shape {list(shape)}, expected [{cfg.num_experts}, ...] "
                              "(one slice per expert)")
        return {f"{p}mlp.experts.{e}.{STACKED[base]}.weight": ((lambda e: lambda: load()[e].clone())(e), shape[1:])
                for e in range(shape[0])}
    if base in SPLIT_KV_B and suffix == "weight":
        pending.setdefault(int(i), {})[base] = (load, shape, name)
        return {}
    return None


def join_kv_b(pending: dict, cfg, where: str) -> dict[str, tuple[Callable[[], torch.Tensor], tuple[int, ...]]]:
    """kv_b_proj [H (nope + v), r] of each layer from its k_b [H, r, nope] and v_b [H, v, r]."""
    out = {}
    H, nope, vd, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    for i, halves in sorted(pending.items()):
        if set(halves) != set(SPLIT_KV_B):
            missing = next(b for b in SPLIT_KV_B if b not in halves)
            raise ConfigError(f"{where}: tensor blk.{i}.{missing}.weight is missing (the other half of kv_b is there)")
        (kl, ks, kn), (vl, vs, vn) = halves["attn_k_b"], halves["attn_v_b"]
        if tuple(ks) != (H, r, nope):
            raise ConfigError(f"{where}: tensor {kn} has shape {list(ks)}, expected [heads, kv_lora_rank, "
                              f"qk_nope_head_dim] = {[H, r, nope]}")
        if tuple(vs) != (H, vd, r):
            raise ConfigError(f"{where}: tensor {vn} has shape {list(vs)}, expected [heads, v_head_dim, "
                              f"kv_lora_rank] = {[H, vd, r]}")

        def kv_b(kl=kl, vl=vl):
            import torch  # on access only: reading the header needs no torch

            return torch.cat([kl().transpose(1, 2), vl()], dim=1).reshape(H * (nope + vd), r).contiguous()
        out[f"model.layers.{i}.self_attn.kv_b_proj.weight"] = (kv_b, (H * (nope + vd), r))
    return out
