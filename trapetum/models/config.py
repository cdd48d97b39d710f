"""Model configuration: the shape of a decoder plus declarative per-family quirk flags.

One decoder serves every family; a family is only a set of values for these fields
(see ``families.py``). Nothing in model code checks the family name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")


@dataclass
class ModelConfig:
    family: str  # "llama", "mistral", "qwen2", "gemma2", "gemma3", "phi3" (informational)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    norm_offset: float = 0.0  # Gemma: RMSNorm weight applied as (offset + w)
    embed_scale: float | None = None  # Gemma: hidden_size ** 0.5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Gemma-3: RMSNorm over head_dim of q and k
    sandwich_norms: bool = False  # Gemma-2/3: post-attention, pre- and post-feedforward norms
    attn_softcap: float | None = None  # Gemma-2: tanh softcap of attention logits
    final_softcap: float | None = None  # Gemma-2: tanh softcap of output logits
    attn_scale: float | None = None  # default head_dim ** -0.5
    sliding_window: int | None = None  # window length for layers of type "sliding"
    layer_types: list[str] = field(default_factory=list)  # per layer "full" | "sliding"; empty = all full
    rope_theta: float = 10000.0
    rope_local_theta: float | None = None  # Gemma-3: RoPE base of sliding layers
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling dict ("linear", "llama3", ...)
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full"] * self.num_layers
        self.layer_types = list(self.layer_types)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def validate(self, where: str = "config") -> "ModelConfig":
        """Raise ConfigError naming the field when the configuration is inconsistent."""
        def bad(msg: str) -> None:
            raise ConfigError(f"{where}: {msg}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            bad(f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.hidden_act not in ACTIVATIONS:
            bad(f"hidden_act {self.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if len(self.layer_types) != self.num_layers:
            bad(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                bad(f"layer type {t!r} is not one of {LAYER_TYPES}")
        if "sliding" in self.layer_types and not self.sliding_window:
            bad("sliding layers need a positive sliding_window")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim or self.rotary_dim <= 0:
            bad(f"rotary dimension {self.rotary_dim} must be even and within head_dim {self.head_dim}")
        if self.rms_norm_eps <= 0:
            bad(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config") -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"{where}: unknown config fields {sorted(unknown)}")
        try:
            cfg = cls(**d)
        except TypeError as e:
            raise ConfigError(f"{where}: {e}") from None
        return cfg.validate(where)
