"""Hugging Face model families -> ModelConfig (shape + quirk flags), and checkpoint key maps.

A family is data, not code: each entry says which quirks apply. GGUF architectures are
mapped in ``trapetum/formats/gguf.py`` onto the same flags.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from ..errors import ConfigError, UnsupportedError
from .config import LIMITS, ModelConfig
from .families_moe import mla_fields, moe_fields

# HF model_type -> quirk flags that are fixed for the family (the rest is read from config.json).
FAMILY_QUIRKS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"all_sliding": True},
    "qwen2": {"qkv_bias": True},
    "gemma2": {"hidden_act": "gelu_tanh", "norm_offset": 1.0, "scale_embed": True, "sandwich_norms": True,
               "tie_default": True, "sliding_pattern": "alternate", "fp16_overflow": True},
    "gemma3_text": {"hidden_act": "gelu_tanh", "norm_offset": 1.0, "scale_embed": True, "sandwich_norms": True,
                    "qk_norm": True, "tie_default": True, "sliding_pattern": "every_n", "fp16_overflow": True},
    "phi3": {"fused": True, "yarn_is_longrope": True},
    # mixture of experts ("moe": how the config names its experts, models/families_moe.py) and latent attention
    "mixtral": {"moe": "mixtral", "all_sliding": True},
    "qwen2_moe": {"moe": "qwen", "qkv_bias_key": "qkv_bias", "shared_gate": True},
    "qwen3_moe": {"moe": "qwen", "qk_norm": True},
    "deepseek_v2": {"moe": "deepseek", "mla": True, "scoring": "softmax", "rope_interleave": True,
                    "ignore_norm_topk": True},
    "deepseek_v3": {"moe": "deepseek", "mla": True, "scoring": "sigmoid", "router_topk": "noaux_tc",
                    "router_bias": True},
}
ALIASES = {"gemma3": "gemma3_text"}
ROPE_KINDS = ("linear", "llama3", "yarn", "longrope", "dynamic")

# Phi-3 style fused projections, split at load time into the canonical names.
FUSED_QKV = "self_attn.qkv_proj.weight"
FUSED_GATE_UP = "mlp.gate_up_proj.weight"
# transformers 5's stacked experts ([E, 2 Im, D] gate then up; [E, D, Im]), split per expert at load time
STACKED_GATE_UP, STACKED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
# per-layer HF names -> canonical (schema.py): Mixtral's experts, Qwen2-MoE's shared expert, DeepSeek's kv_a
LAYER_RENAMES = (("block_sparse_moe.gate.", "mlp.gate."), ("mlp.shared_expert.", "mlp.shared_experts."),
                 ("self_attn.kv_a_proj_with_mqa.", "self_attn.kv_a_proj."))
EXPERT_RENAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _layer_type(t: str) -> str:
    return {"sliding_attention": "sliding", "full_attention": "full", "sliding": "sliding", "full": "full",
            "chunked_attention": "full"}.get(t, t)


def _show(v: Any) -> str:
    return " ".join(repr(v).split())[:60]


def _int(cfg: dict[str, Any], key: str, where: str, default: Any = None) -> Any:
    """An integer field (an integral float such as 4096.0 is taken as one); absent or null: ``default``, and 0
    too when there is a default (config.json's ``x or default`` convention)."""
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{where}: {key} must be an integer, got {_show(v)}")
    return default if v == 0 and default is not None else v


def _num(d: dict[str, Any], key: str, where: str, default: Any = None, prefix: str = "") -> Any:
    """A finite number field; null or absent: ``default``."""
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{where}: {prefix}{key} must be a finite number, got {_show(v)}")
    return float(v)


def _obj(d: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    v = d.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"{where}: {key} must be an object or null, got {_show(v)}")
    return v


def _rope(cfg: dict[str, Any], where: str) -> tuple[float, dict | None, float | None, float]:
    """(theta, scaling dict or None, local theta or None, partial rotary factor) from either
    the classic keys (rope_theta, rope_scaling) or transformers 5's ``rope_parameters``."""
    partial = _num(cfg, "partial_rotary_factor", where) or 1.0
    params = _obj(cfg, "rope_parameters", where)
    local = _num(cfg, "rope_local_base_freq", where)
    if params:
        if "full_attention" in params or "sliding_attention" in params:
            full = _obj(params, "full_attention", where)
            slide = _obj(params, "sliding_attention", where)
            if slide:
                local = _num(slide, "rope_theta", where, local, "rope_parameters.sliding_attention.")
            params = full
        theta = _num(params, "rope_theta", where, None, "rope_parameters.") or _num(cfg, "rope_theta", where) \
            or 10000.0
        partial = _num(params, "partial_rotary_factor", where, None, "rope_parameters.") or partial
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    else:
        theta = _num(cfg, "rope_theta", where) or 10000.0
        scaling = dict(_obj(cfg, "rope_scaling", where))
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = kind
        scaling.pop("type", None)
        if kind == "su":  # Phi-3's first name for longrope
            kind = scaling["rope_type"] = "longrope"
        if kind == "default":
            scaling = {}
        elif not isinstance(kind, str) or kind not in ROPE_KINDS:
            raise UnsupportedError(f"{where}: RoPE scaling type {_show(kind)} is not supported "
                                   f"({', '.join(ROPE_KINDS)})")
        elif kind in ("llama3", "yarn", "longrope"):
            # transformers: a top-level original_max_position_embeddings (Phi-3) wins over the dict's, which
            # defaults to max_position_embeddings
            top = _int(cfg, "original_max_position_embeddings", where)
            if top is not None:
                scaling["original_max_position_embeddings"] = top
            elif kind != "llama3":
                scaling.setdefault("original_max_position_embeddings",
                                   _int(cfg, "max_position_embeddings", where, 4096))
    return theta, (scaling or None), (local or None), partial


def overflows_fp16(cfg: ModelConfig) -> bool:
    """True for families whose activations can overflow fp16 in a plain torch forward (Gemma): the reference
    decoder on CUDA runs them in bf16 (the engine's kernels accumulate in fp32 and are unaffected)."""
    fam = {"gemma3": "gemma3_text"}.get(cfg.family, cfg.family)
    return bool(FAMILY_QUIRKS.get(fam, {}).get("fp16_overflow"))


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
    need = {"hidden_size": "D", "num_attention_heads": "H", "num_hidden_layers": "L", "intermediate_size": "I",
            "vocab_size": "V"}
    for key in need:
        if key not in cfg:
            raise ConfigError(f"{where}: missing field {key!r}")
    D, H, L, I, V = (_int(cfg, key, where) for key in need)
    for key, v in zip(need, (D, H, L, I, V)):
        if not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{where}: {key} must be a positive integer, got {_show(v)}")
    if L > LIMITS["num_layers"]:     # before anything is sized by it
        raise ConfigError(f"{where}: num_hidden_layers = {L} is past the limit of {LIMITS['num_layers']}")
    Hkv = _int(cfg, "num_key_value_heads", where, H)
    hd = _int(cfg, "head_dim", where, D // H)
    theta, scaling, local_theta, partial = _rope(cfg, where)
    if q.get("yarn_is_longrope") and scaling and scaling["rope_type"] == "yarn":
        scaling["rope_type"] = "longrope"  # Phi-3: transformers reads an old "yarn" as longrope
    extra = moe_fields(cfg, q, L, where)
    if q.get("mla"):
        extra.update(mla_fields(cfg, H, scaling, where))
        Hkv, hd = H, extra.pop("head_dim")

    window = _int(cfg, "sliding_window", where)
    raw_types = cfg.get("layer_types") or []
    if not isinstance(raw_types, list) or not all(isinstance(t, str) for t in raw_types):
        raise ConfigError(f"{where}: layer_types must be a list of strings")
    layer_types = [_layer_type(t) for t in raw_types]
    if not layer_types:
        if q.get("all_sliding") and window:
            layer_types = ["sliding"] * L
        elif q.get("sliding_pattern") == "alternate":
            layer_types = ["sliding" if i % 2 == 0 else "full" for i in range(L)]
        elif q.get("sliding_pattern") == "every_n":
            n = _int(cfg, "sliding_window_pattern", where, 6)
            if n <= 0:
                raise ConfigError(f"{where}: sliding_window_pattern must be positive, got {n}")
            layer_types = ["sliding" if (i + 1) % n else "full" for i in range(L)]
        elif mt == "qwen2" and cfg.get("use_sliding_window") and window:
            mwl = _int(cfg, "max_window_layers", where, L)
            layer_types = ["sliding" if i >= mwl else "full" for i in range(L)]
        elif mt == "phi3" and window:
            layer_types = ["sliding"] * L
        else:
            layer_types = ["full"] * L
    if "sliding" not in layer_types:
        window = None

    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if not isinstance(act, str):
        raise ConfigError(f"{where}: hidden_act must be a string, got {_show(act)}")
    act = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}.get(act, act)
    if q.get("hidden_act"):
        act = {"gelu_pytorch_tanh": "gelu_tanh"}.get(act, act)
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings", "use_sliding_window"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise ConfigError(f"{where}: {key} must be true or false, got {_show(cfg[key])}")
    qpas = _num(cfg, "query_pre_attn_scalar", where)
    if qpas is not None and qpas < 0:
        raise ConfigError(f"{where}: query_pre_attn_scalar must be positive, got {qpas:g}")
    attn_cap = _num(cfg, "attn_logit_softcapping", where)
    final_cap = _num(cfg, "final_logit_softcapping", where)
    attn_bias = bool(cfg.get("attention_bias") or False)
    qkv_bias = bool(q.get("qkv_bias") or attn_bias)
    if q.get("qkv_bias_key"):  # Qwen2-MoE names it (default true)
        v = cfg.get(q["qkv_bias_key"], True)
        if not isinstance(v, bool):
            raise ConfigError(f"{where}: {q['qkv_bias_key']} must be true or false, got {_show(v)}")
        qkv_bias = v or attn_bias
    if q.get("mla") and attn_bias:
        raise UnsupportedError(f"{where}: attention_bias with latent attention is not supported")
    mc = ModelConfig(
        family=mt.replace("_text", ""),
        vocab_size=V, hidden_size=D, intermediate_size=I, num_layers=L, num_heads=H, num_kv_heads=Hkv,
        head_dim=hd,
        max_position_embeddings=_int(cfg, "max_position_embeddings", where, 4096),
        rms_norm_eps=_num(cfg, "rms_norm_eps", where) or 1e-6,
        hidden_act=act,
        norm_offset=float(q.get("norm_offset", 0.0)),
        embed_scale=math.sqrt(D) if q.get("scale_embed") else None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", q.get("tie_default", False))),
        qkv_bias=qkv_bias,
        o_bias=attn_bias,
        mlp_bias=bool(cfg.get("mlp_bias") or False),
        qk_norm=bool(q.get("qk_norm", False)),
        sandwich_norms=bool(q.get("sandwich_norms", False)),
        attn_softcap=attn_cap if mt == "gemma2" else None,
        final_softcap=final_cap if mt in ("gemma2", "gemma3_text") else None,
        attn_scale=extra.pop("attn_scale", None) or (qpas ** -0.5 if qpas else None),
        sliding_window=window or None,
        layer_types=layer_types,
        rope_theta=theta,
        rope_local_theta=local_theta if mt == "gemma3_text" else None,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        **extra,
    )
    return mc.validate(where)


def canonical_layer_name(name: str) -> str:
    """A per-layer HF tensor name in the canonical spelling (LAYER_RENAMES, Mixtral's experts.{e}.w1/w2/w3)."""
    for a, b in LAYER_RENAMES:
        if a in name:
            name = name.replace(a, b, 1)
    marker = ".block_sparse_moe.experts."
    if marker in name:
        head, _, rest = name.partition(marker)
        parts = rest.split(".")
        if len(parts) == 3 and parts[1] in EXPERT_RENAMES:
            name = f"{head}.mlp.experts.{parts[0]}.{EXPERT_RENAMES[parts[1]]}.{parts[2]}"
    return name


def split_fused(name: str, tensor_getter: Callable[[], Any], cfg: ModelConfig) -> dict[str, Callable[[], Any]]:
    """Map one source tensor to canonical getters: the canonical spelling, Phi-3's fused projections split, stacked
    experts split per expert; a layer past the config's (DeepSeek-V3's multi-token-prediction layer) maps to
    nothing."""
    if name.startswith("model.layers."):
        idx = name.split(".", 3)[2]
        if idx.isdigit() and int(idx) >= cfg.num_layers:
            return {}
        name = canonical_layer_name(name)
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
    if name.endswith((STACKED_GATE_UP, STACKED_DOWN)) and cfg.num_experts:
        p = name[: -len(STACKED_DOWN if name.endswith(STACKED_DOWN) else STACKED_GATE_UP)]
        im = cfg.moe_intermediate_size
        out = {}
        for e in range(cfg.num_experts):
            if name.endswith(STACKED_DOWN):
                out[f"{p}mlp.experts.{e}.down_proj.weight"] = lambda e=e: tensor_getter()[e].clone()
            else:
                out[f"{p}mlp.experts.{e}.gate_proj.weight"] = lambda e=e: tensor_getter()[e, :im].clone()
                out[f"{p}mlp.experts.{e}.up_proj.weight"] = lambda e=e: tensor_getter()[e, im:].clone()
        return out
    return {name: tensor_getter}
