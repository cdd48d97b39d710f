"""Hugging Face model families -> ModelConfig (shape + quirk flags), and checkpoint key maps.

A family is data, not code: each entry says which quirks apply. GGUF architectures are
mapped in ``trapetum/formats/gguf.py`` onto the same flags.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from ..errors import ConfigError, UnsupportedError
from .config import ModelConfig

# HF model_type -> quirk flags that are fixed for the family (the rest is read from config.json).
FAMILY_QUIRKS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"all_sliding": True},
    "qwen2": {"qkv_bias": True},
    "gemma2": {"hidden_act": "gelu_tanh", "norm_offset": 1.0, "scale_embed": True, "sandwich_norms": True,
               "tie_default": True, "sliding_pattern": "alternate"},
    "gemma3_text": {"hidden_act": "gelu_tanh", "norm_offset": 1.0, "scale_embed": True, "sandwich_norms": True,
                    "qk_norm": True, "tie_default": True, "sliding_pattern": "every_n"},
    "phi3": {"fused": True},
}
ALIASES = {"gemma3": "gemma3_text"}

# Phi-3 style fused projections, split at load time into the canonical names.
FUSED_QKV = "self_attn.qkv_proj.weight"
FUSED_GATE_UP = "mlp.gate_up_proj.weight"


def _layer_type(t: str) -> str:
    return {"sliding_attention": "sliding", "full_attention": "full", "sliding": "sliding", "full": "full",
            "chunked_attention": "full"}.get(t, t)


def _rope(cfg: dict[str, Any], where: str) -> tuple[float, dict | None, float | None, float]:
    """(theta, scaling dict or None, local theta or None, partial rotary factor) from either
    the classic keys (rope_theta, rope_scaling) or transformers 5's ``rope_parameters``."""
    partial = float(cfg.get("partial_rotary_factor") or 1.0)
    params = cfg.get("rope_parameters")
    local = cfg.get("rope_local_base_freq")
    if isinstance(params, dict) and params:
        if "full_attention" in params or "sliding_attention" in params:
            full = params.get("full_attention") or {}
            slide = params.get("sliding_attention") or {}
            if slide:
                local = slide.get("rope_theta", local)
            params = full
        theta = float(params.get("rope_theta", cfg.get("rope_theta") or 10000.0))
        partial = float(params.get("partial_rotary_factor") or partial)
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    else:
        theta = float(cfg.get("rope_theta") or 10000.0)
        scaling = dict(cfg.get("rope_scaling") or {})
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = kind
        scaling.pop("type", None)
        if kind == "default":
            scaling = {}
        elif kind not in ("linear", "llama3"):
            raise UnsupportedError(f"{where}: RoPE scaling type {kind!r} is not supported (linear, llama3)")
    return theta, (scaling or None), (float(local) if local else None), partial


def config_from_hf(cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dictionary."""
    mt = cfg.get("model_type")
    if mt == "gemma3" and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        mt = "gemma3_text"
    mt = ALIASES.get(mt, mt)
    if mt not in FAMILY_QUIRKS:
        archs = cfg.get("architectures")
        raise UnsupportedError(f"{where}: unknown architecture model_type={cfg.get('model_type')!r} "
                               f"architectures={archs!r} (supported: {', '.join(sorted(FAMILY_QUIRKS))})")
    q = FAMILY_QUIRKS[mt]
    try:
        D = int(cfg["hidden_size"])
        H = int(cfg["num_attention_heads"])
        L = int(cfg["num_hidden_layers"])
        I = int(cfg["intermediate_size"])
        V = int(cfg["vocab_size"])
    except KeyError as e:
        raise ConfigError(f"{where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: bad value: {e}") from None
    Hkv = int(cfg.get("num_key_value_heads") or H)
    hd = int(cfg.get("head_dim") or (D // H if H else 0))
    theta, scaling, local_theta, partial = _rope(cfg, where)

    window = cfg.get("sliding_window")
    layer_types = [_layer_type(t) for t in (cfg.get("layer_types") or [])]
    if not layer_types:
        if q.get("all_sliding") and window:
            layer_types = ["sliding"] * L
        elif q.get("sliding_pattern") == "alternate":
            layer_types = ["sliding" if i % 2 == 0 else "full" for i in range(L)]
        elif q.get("sliding_pattern") == "every_n":
            n = int(cfg.get("sliding_window_pattern") or 6)
            layer_types = ["sliding" if (i + 1) % n else "full" for i in range(L)]
        elif mt == "qwen2" and cfg.get("use_sliding_window") and window:
            mwl = int(cfg.get("max_window_layers") or L)
            layer_types = ["sliding" if i >= mwl else "full" for i in range(L)]
        elif mt == "phi3" and window:
            layer_types = ["sliding"] * L
        else:
            layer_types = ["full"] * L
    if "sliding" not in layer_types:
        window = None

    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    act = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}.get(act, act)
    if q.get("hidden_act"):
        act = {"gelu_pytorch_tanh": "gelu_tanh"}.get(act, act)
    attn_bias = bool(cfg.get("attention_bias") or False)
    qkv_bias = bool(q.get("qkv_bias") or attn_bias)
    qpas = cfg.get("query_pre_attn_scalar")
    mc = ModelConfig(
        family=mt.replace("_text", ""),
        vocab_size=V, hidden_size=D, intermediate_size=I, num_layers=L, num_heads=H, num_kv_heads=Hkv,
        head_dim=hd,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        hidden_act=act,
        norm_offset=float(q.get("norm_offset", 0.0)),
        embed_scale=math.sqrt(D) if q.get("scale_embed") else None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", q.get("tie_default", False))),
        qkv_bias=qkv_bias,
        o_bias=attn_bias,
        mlp_bias=bool(cfg.get("mlp_bias") or False),
        qk_norm=bool(q.get("qk_norm", False)),
        sandwich_norms=bool(q.get("sandwich_norms", False)),
        attn_softcap=cfg.get("attn_logit_softcapping") if mt == "gemma2" else None,
        final_softcap=cfg.get("final_logit_softcapping") if mt in ("gemma2", "gemma3_text") else None,
        attn_scale=float(qpas) ** -0.5 if qpas else None,
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
        rope_theta=theta,
        rope_local_theta=local_theta if mt == "gemma3_text" else None,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
    )
    return mc.validate(where)


def split_fused(name: str, tensor_getter: Callable[[], Any], cfg: ModelConfig) -> dict[str, Callable[[], Any]]:
    """Map one source tensor to canonical getters, splitting Phi-3's fused projections."""
    if name.endswith(FUSED_QKV):
        p = name[: -len(FUSED_QKV)]
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return {p + "self_attn.q_proj.weight": lambda: tensor_getter()[:q],
                p + "self_attn.k_proj.weight": lambda: tensor_getter()[q:q + kv],
                p + "self_attn.v_proj.weight": lambda: tensor_getter()[q + kv:]}
    if name.endswith(FUSED_GATE_UP):
        p = name[: -len(FUSED_GATE_UP)]
        i = cfg.intermediate_size
        return {p + "mlp.gate_proj.weight": lambda: tensor_getter()[:i],
                p + "mlp.up_proj.weight": lambda: tensor_getter()[i:]}
    return {name: tensor_getter}
