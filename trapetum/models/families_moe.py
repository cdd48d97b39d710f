"""Hugging Face config.json -> the mixture-of-experts and latent-attention fields of ModelConfig.

How each family names its experts (FAMILY_QUIRKS "moe" in families.py):

    mixtral    num_local_experts, num_experts_per_tok; every layer a mixture of intermediate_size experts;
               softmax, top-k renormalized
    qwen       (Qwen2-MoE, Qwen3-MoE) num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
               shared_expert_intermediate_size (Qwen2-MoE, with its sigmoid gate); layer i is a mixture when it is
               not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0, else dense of intermediate_size
    deepseek   n_routed_experts, num_experts_per_tok, moe_intermediate_size, n_shared_experts (their intermediate
               size n_shared x moe_intermediate_size), routed_scaling_factor, n_group / topk_group, topk_method
               (V2: greedy or group_limited_greedy; V3: noaux_tc with e_score_correction_bias, sigmoid scores,
               norm_topk_prob); layer i is a mixture when i >= first_k_dense_replace and i % moe_layer_freq == 0.
               DeepSeek-V2's norm_topk_prob is ignored, as transformers ignores it (its router never renormalizes).

Latent attention (DeepSeek, "mla"): q_lora_rank (null: one q projection), kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim; head_dim becomes qk_nope + qk_rope and every head has its own keys (num_kv_heads =
num_heads); the softmax scale is head_dim^-0.5 times DeepSeek's YaRN factor mscale(factor, mscale_all_dim)^2.
"""
from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError
from .rope_scale import yarn_softmax_mscale


def _show(v: Any) -> str:
    return " ".join(repr(v).split())[:60]


def _int(cfg: dict, key: str, where: str, default: Any = None) -> Any:
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"{where}: {key} must be a non-negative integer, got {_show(v)}")
    return v


def _experts(cfg: dict, keys: tuple[str, ...], where: str) -> int:
    """The expert count under the first of ``keys`` present (transformers 5 saves some families' count under
    num_local_experts, the hub's configs under their own name)."""
    for key in keys:
        if cfg.get(key) is not None:
            return _int(cfg, key, where)
    return 0


def _bool(cfg: dict, key: str, where: str, default: bool) -> bool:
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: {key} must be true or false, got {_show(v)}")
    return v


def _real(cfg: dict, key: str, where: str, default: float) -> float:
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{where}: {key} must be a finite number, got {_show(v)}")
    return float(v)


def moe_fields(cfg: dict[str, Any], q: dict[str, Any], L: int, where: str) -> dict[str, Any]:
    """ModelConfig keyword arguments of the family's experts ({} for a dense family)."""
    style = q.get("moe")
    if style is None:
        return {}
    k = _int(cfg, "num_experts_per_tok", where, 0)
    if style == "mixtral":
        E = _experts(cfg, ("num_local_experts", "num_experts"), where)
        return dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=_int(cfg, "intermediate_size", where),
                    mlp_types=["moe"] * L, norm_topk_prob=True)
    if style == "qwen":
        E = _experts(cfg, ("num_experts", "num_local_experts"), where)
        step = _int(cfg, "decoder_sparse_step", where, 1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ConfigError(f"{where}: mlp_only_layers must be a list of layer indices, got {_show(only)}")
        if step < 1:
            raise ConfigError(f"{where}: decoder_sparse_step must be positive, got {step}")
        types = ["moe" if i not in only and E > 0 and (i + 1) % step == 0 else "dense" for i in range(L)]
        shared = _int(cfg, "shared_expert_intermediate_size", where, 0)
        return dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=_int(cfg, "moe_intermediate_size",
                    where, 0), mlp_types=types, norm_topk_prob=_bool(cfg, "norm_topk_prob", where, False),
                    shared_expert_intermediate_size=shared, shared_expert_gate=bool(q.get("shared_gate")) and shared > 0)
    # deepseek
    E = _experts(cfg, ("n_routed_experts", "num_local_experts"), where)
    first = _int(cfg, "first_k_dense_replace", where, 0)
    freq = _int(cfg, "moe_layer_freq", where, 1)
    if freq < 1:
        raise ConfigError(f"{where}: moe_layer_freq must be positive, got {freq}")
    types = ["moe" if E > 0 and i >= first and i % freq == 0 else "dense" for i in range(L)]
    Im = _int(cfg, "moe_intermediate_size", where, 0)
    scoring = cfg.get("scoring_func") or q.get("scoring", "softmax")
    topk = q.get("router_topk") or cfg.get("topk_method") or "greedy"
    n_group, topk_group = _int(cfg, "n_group", where, 1) or 1, _int(cfg, "topk_group", where, 1) or 1
    if topk == "noaux_tc" and n_group == 1:
        topk_group = 1
    return dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=Im, mlp_types=types,
                router_scoring=scoring, router_topk=topk, n_group=n_group, topk_group=topk_group,
                router_bias=bool(q.get("router_bias")),
                norm_topk_prob=False if q.get("ignore_norm_topk") else _bool(cfg, "norm_topk_prob", where, True),
                routed_scaling_factor=_real(cfg, "routed_scaling_factor", where, 1.0),
                shared_expert_intermediate_size=Im * _int(cfg, "n_shared_experts", where, 0))


def mla_fields(cfg: dict[str, Any], H: int, scaling: dict | None, where: str) -> dict[str, Any]:
    """ModelConfig keyword arguments of latent attention, and ``head_dim`` (qk_nope + qk_rope) for the caller."""
    need = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for key in need:
        if cfg.get(key) is None:
            raise ConfigError(f"{where}: missing field {key!r} (latent attention)")
    kv, nope, rope, vd = (_int(cfg, key, where) for key in need)
    hd = nope + rope
    if hd <= 0:
        raise ConfigError(f"{where}: qk_nope_head_dim + qk_rope_head_dim must be positive")
    return dict(q_lora_rank=_int(cfg, "q_lora_rank", where, 0), kv_lora_rank=kv, qk_rope_head_dim=rope,
                v_head_dim=vd, rope_interleave=_bool(cfg, "rope_interleave", where, True), head_dim=hd,
                attn_scale=hd ** -0.5 * yarn_softmax_mscale(scaling))
