"""Model configuration: the shape of a decoder plus declarative per-family quirk flags.

One decoder serves every family; a family is only a set of values for these fields
(see ``families.py``). Nothing in model code checks the family name.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")
ROPE_SCALINGS = ("linear", "llama3")

# Sane limits, far past every real model (the largest have ~260k-token vocabularies, 126 layers, hidden sizes
# near 25k, 128 heads, 10M positions): a file past them is corrupt or hostile, and is refused before anything
# is sized by it.
LIMITS: dict[str, int] = {
    "vocab_size": 1 << 24, "hidden_size": 1 << 18, "intermediate_size": 1 << 20, "num_layers": 4096,
    "num_heads": 4096, "num_kv_heads": 4096, "head_dim": 4096, "max_position_embeddings": 1 << 24,
}
MAX_FLOAT = 1e15  # RoPE bases
MAX_SCALE = 1e6   # softcaps, scales, RoPE scaling factors


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
        if not self.layer_types and _is_int(self.num_layers) and 0 < self.num_layers <= LIMITS["num_layers"]:
            self.layer_types = ["full"] * self.num_layers
        if isinstance(self.layer_types, (list, tuple)):   # anything else is refused by validate()
            self.layer_types = list(self.layer_types)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def validate(self, where: str = "config") -> "ModelConfig":
        """Raise ConfigError naming the field when a value has the wrong type, is out of range (``LIMITS``,
        ``MAX_FLOAT``) or is inconsistent with another: everything that would otherwise fail (or allocate
        without bound) later, in the decoder or the sampler."""
        def bad(msg: str) -> None:
            raise ConfigError(f"{where}: {msg}")

        def show(v: Any) -> str:
            return " ".join(repr(v).split())[:60]

        def real(name: str, v: Any, lo: float, hi: float, lo_open: bool = True) -> None:
            if not _is_real(v) or not (lo < v if lo_open else lo <= v) or v > hi:
                bad(f"{name} must be a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {show(v)}")

        if not isinstance(self.family, str) or not 0 < len(self.family) <= 64:
            bad(f"family must be a short string, got {show(self.family)}")
        for name, hi in LIMITS.items():
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                bad(f"{name} must be a positive integer, got {show(v)}")
            if v > hi:
                bad(f"{name} = {v} is past the limit of {hi}")
        if self.num_heads % self.num_kv_heads:
            bad(f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_heads * self.head_dim > LIMITS["intermediate_size"]:
            bad(f"num_heads x head_dim = {self.num_heads * self.head_dim} is past the limit of "
                f"{LIMITS['intermediate_size']}")
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACTIVATIONS:
            bad(f"hidden_act {show(self.hidden_act)} is not supported (supported: {', '.join(ACTIVATIONS)})")
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "sandwich_norms"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {show(getattr(self, name))}")
        if not isinstance(self.layer_types, list):
            bad(f"layer_types must be a list, got {show(self.layer_types)}")
        if len(self.layer_types) != self.num_layers:
            bad(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        for t in self.layer_types:
            if not isinstance(t, str) or t not in LAYER_TYPES:
                bad(f"layer type {show(t)} is not one of {LAYER_TYPES}")
        if self.sliding_window is not None and (not _is_int(self.sliding_window) or self.sliding_window <= 0
                                                or self.sliding_window > LIMITS["max_position_embeddings"]):
            bad(f"sliding_window must be a positive integer or null, got {show(self.sliding_window)}")
        if "sliding" in self.layer_types and not self.sliding_window:
            bad("sliding layers need a positive sliding_window")
        # Lower bounds keep the float32 arithmetic finite: a RoPE base below 1 or a subnormal epsilon, softcap or
        # scaling factor becomes 0 in float32 and a division by it NaN (5e-324 is a valid JSON number).
        real("rms_norm_eps", self.rms_norm_eps, 1e-30, 1.0, lo_open=False)
        real("norm_offset", self.norm_offset, -16.0, 16.0, lo_open=False)
        real("rope_theta", self.rope_theta, 1.0, MAX_FLOAT, lo_open=False)
        real("partial_rotary_factor", self.partial_rotary_factor, 0.0, 1.0)
        if self.rope_local_theta is not None:
            real("rope_local_theta", self.rope_local_theta, 1.0, MAX_FLOAT, lo_open=False)
        for name in ("embed_scale", "attn_scale"):
            if getattr(self, name) is not None:
                real(name, getattr(self, name), 0.0, MAX_SCALE)
        for name in ("attn_softcap", "final_softcap"):
            if getattr(self, name) is not None:
                real(name, getattr(self, name), 1e-3, MAX_SCALE, lo_open=False)
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim or self.rotary_dim <= 0:
            bad(f"rotary dimension {self.rotary_dim} must be even and within head_dim {self.head_dim}")
        self._validate_rope_scaling(bad, show)
        return self

    def _validate_rope_scaling(self, bad, show) -> None:
        rs = self.rope_scaling
        if rs is None:
            return
        if not isinstance(rs, dict) or not all(isinstance(k, str) for k in rs):
            bad(f"rope_scaling must be an object or null, got {show(rs)}")
        kind = rs.get("rope_type")
        if kind not in ROPE_SCALINGS:
            bad(f"rope_scaling.rope_type {show(kind)} is not supported ({', '.join(ROPE_SCALINGS)})")

        def num(key: str, default: Any = None, lo: float = 1e-3) -> float:
            v = rs.get(key, default)
            if not _is_real(v) or not lo <= v <= MAX_SCALE:
                bad(f"rope_scaling.{key} must be a number in [{lo:g}, {MAX_SCALE:g}], got {show(v)}")
            return float(v)
        num("factor")
        if kind == "llama3":
            low, high = num("low_freq_factor", 1.0), num("high_freq_factor", 4.0)
            if high <= low:
                bad(f"rope_scaling.high_freq_factor ({high:g}) must be larger than low_freq_factor ({low:g})")
            num("original_max_position_embeddings", 8192, lo=1.0)

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
