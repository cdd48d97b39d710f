"""Tensor names and shapes per block kind: the one statement of what a checkpoint of a config holds.

Names are canonical (Hugging Face Llama style, fused projections split):

    model.embed_tokens.weight
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   (+ .bias where present)
    model.layers.{i}.self_attn.{q,k}_norm.weight        (qk_norm families)
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.pre_feedforward_layernorm.weight   (sandwich_norms families)
    model.layers.{i}.post_feedforward_layernorm.weight  (sandwich_norms families)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.norm.weight
    lm_head.weight                                       (absent when tied)

Block kinds today: "attention" (q/k/v/o projections, optional q/k norms, pre and optional post norm) and "mlp"
(dense gated MLP: gate/up/down, pre and optional post norm). ``attention_names`` / ``mlp_names`` give each
role's canonical name; ``expected_names`` / ``expected_shapes`` the whole model's; ``fetch`` reads one tensor
of a checkpoint with its shape checked against the config.
"""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError, FormatError
from .config import ModelConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # per layer


def attention_names(cfg: ModelConfig, i: int) -> dict[str, str | None]:
    """Role -> canonical tensor name (without .weight / .bias) of layer i's attention block."""
    p = f"model.layers.{i}."
    sw = cfg.sandwich_norms
    return {"input_norm": p + "input_layernorm", "q": p + "self_attn.q_proj", "k": p + "self_attn.k_proj",
            "v": p + "self_attn.v_proj", "o": p + "self_attn.o_proj",
            "q_norm": p + "self_attn.q_norm" if cfg.qk_norm else None,
            "k_norm": p + "self_attn.k_norm" if cfg.qk_norm else None,
            "post_norm": p + "post_attention_layernorm" if sw else None}


def mlp_names(cfg: ModelConfig, i: int) -> dict[str, str | None]:
    """Role -> canonical tensor name of layer i's MLP block."""
    p = f"model.layers.{i}."
    sw = cfg.sandwich_norms
    return {"norm": p + ("pre_feedforward_layernorm" if sw else "post_attention_layernorm"),
            "gate": p + "mlp.gate_proj", "up": p + "mlp.up_proj", "down": p + "mlp.down_proj",
            "post_norm": p + "post_feedforward_layernorm" if sw else None}


def expected_names(cfg: ModelConfig) -> list[str]:
    """Every canonical tensor name a checkpoint with this config must provide (biases excluded)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if cfg.sandwich_norms:
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
    return names


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape for dense checkpoints (weights are [out_features, in_features])."""
    D, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, D),
        "model.norm.weight": (D,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (q, D), p + "self_attn.k_proj.weight": (kv, D),
            p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, q),
            p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D),
            p + "mlp.down_proj.weight": (D, I),
        })
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (D,)
        if cfg.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (I,), p + "mlp.up_proj.bias": (I,), p + "mlp.down_proj.bias": (D,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if cfg.sandwich_norms:
            shapes.update({p + "pre_feedforward_layernorm.weight": (D,),
                           p + "post_feedforward_layernorm.weight": (D,)})
    return shapes


def fetch(ckpt, name: str, required: bool = True, shapes: dict[str, tuple[int, ...]] | None = None) -> Any:
    """Tensor (or QuantRecord) ``name`` of a Checkpoint, its shape checked against the config (``shapes``:
    expected_shapes(config), passed by callers that fetch many); None when absent and not ``required``
    (FormatError when required)."""
    if name not in ckpt.tensors:
        if required:
            raise FormatError(f"{ckpt.source}: tensor {name!r} is missing")
        return None
    t = ckpt.tensors[name]
    want = (shapes if shapes is not None else expected_shapes(ckpt.config)).get(name)
    got = tuple(t.shape)
    if want is not None and got != want:
        raise ConfigError(f"{ckpt.source}: tensor {name!r} has shape {list(got)} but the config implies {list(want)}")
    return t
