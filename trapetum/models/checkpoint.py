"""The in-memory description every loader produces: config + named tensors + tokenizer.

Tensor names are canonical (Hugging Face Llama style, fused projections split):

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

Norm weights follow the HF convention (Gemma keeps w and applies offset + w).
A tensor may also be a *quantized* tensor group: ``tensors`` then maps the projection's
weight name to an object that ``trapetum.quant.linear`` turns into a module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping


from .config import ModelConfig


class LazyTensors(Mapping[str, Any]):
    """Name -> tensor mapping whose values are produced on first access (and not cached).

    Loaders give a dict of zero-argument callables so that a model is materialized one
    tensor at a time (bounded memory for large checkpoints).
    """

    def __init__(self, getters: dict[str, Callable[[], Any]], formats: dict[str, str] | None = None,
                 shapes: dict[str, tuple[int, ...]] | None = None):
        self._getters = getters
        self.formats = formats or {}  # name -> storage format in the source ("F16", "Q4_K", ...)
        self.shapes = shapes or {}  # name -> logical shape, when known without loading

    def __getitem__(self, name: str) -> Any:
        return self._getters[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._getters)

    def __len__(self) -> int:
        return len(self._getters)


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: Mapping[str, Any]  # canonical name -> torch.Tensor (or quantized record), lazily
    tokenizer: Any  # trapetum.tokenizer.Tokenizer or None
    source: str  # path it came from
    source_format: str  # "hf" | "gguf" | "cbk"
    generation: dict[str, Any] = field(default_factory=dict)  # default sampling settings
    meta: dict[str, Any] = field(default_factory=dict)  # format-specific extras (recipe, provenance)

    def tensor_formats(self) -> dict[str, str]:
        return dict(getattr(self.tensors, "formats", {}) or {})


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
