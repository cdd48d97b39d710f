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
MLP_TYPES = ("dense", "moe")
ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope", "dynamic")
ROUTER_SCORINGS = ("softmax", "sigmoid")
# expert choice: "greedy" (top-k of the scores), "group_limited_greedy" (DeepSeek-V2: the topk_group groups with the
# best single score, then top-k inside them), "noaux_tc" (DeepSeek-V3: groups ranked by the sum of their two best
# bias-corrected scores)
ROUTER_TOPK = ("greedy", "group_limited_greedy", "noaux_tc")
LATENT_NORM_EPS = 1e-6  # MLA's q_a / kv_a RMSNorms (DeepSeek builds them with the default eps, not rms_norm_eps)

# Sane limits, far past every real model (the largest have ~260k-token vocabularies, 126 layers, hidden sizes
# near 25k, 128 heads, 10M positions): a file past them is corrupt or hostile, and is refused before anything
# is sized by it.
LIMITS: dict[str, int] = {
    "vocab_size": 1 << 24, "hidden_size": 1 << 18, "intermediate_size": 1 << 20, "num_layers": 4096,
    "num_heads": 4096, "num_kv_heads": 4096, "head_dim": 4096, "max_position_embeddings": 1 << 24,
}
# The same for the mixture-of-experts and latent-attention sizes (0 = the feature is off); the largest real ones:
# 256 routed experts, 8 active, kv_lora_rank 512, q_lora_rank 1536.
MOE_LIMITS: dict[str, int] = {
    "num_experts": 4096, "num_experts_per_tok": 4096, "moe_intermediate_size": 1 << 20,
    "shared_expert_intermediate_size": 1 << 20, "n_group": 4096, "topk_group": 4096,
    "q_lora_rank": 1 << 16, "kv_lora_rank": 1 << 16, "qk_rope_head_dim": 4096, "v_head_dim": 4096,
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
    # Mixture of experts (models/blocks/moe.py); num_experts 0: every MLP is dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each routed expert's intermediate size
    mlp_types: list[str] = field(default_factory=list)  # per layer "dense" | "moe"; empty = all dense
    router_scoring: str = "softmax"  # ROUTER_SCORINGS
    router_topk: str = "greedy"  # ROUTER_TOPK
    n_group: int = 1
    topk_group: int = 1
    router_bias: bool = False  # DeepSeek-V3: e_score_correction_bias, added to the scores for the choice only
    norm_topk_prob: bool = False  # renormalize the chosen experts' weights to sum to 1
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (DeepSeek: n_shared x moe_intermediate_size)
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert scaled by sigmoid(w . x)
    # Multi-head latent attention (models/blocks/mla.py, DeepSeek-V2/V3); kv_lora_rank 0: ordinary attention.
    # With MLA, head_dim is the q/k head size qk_nope_head_dim + qk_rope_head_dim, num_kv_heads = num_heads.
    q_lora_rank: int = 0  # 0: q is one projection
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE pairs (x0, x1), (x2, x3), ... (DeepSeek) instead of rotate-half

    def __post_init__(self) -> None:
        n = self.num_layers if _is_int(self.num_layers) and 0 < self.num_layers <= LIMITS["num_layers"] else 0
        if not self.layer_types and n:
            self.layer_types = ["full"] * n
        if isinstance(self.layer_types, (list, tuple)):   # anything else is refused by validate()
            self.layer_types = list(self.layer_types)
        if not self.mlp_types and n:
            self.mlp_types = ["dense"] * n
        if isinstance(self.mlp_types, (list, tuple)):
            self.mlp_types = list(self.mlp_types)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def rotary_dim(self) -> int:
        if self.mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def context_length(self) -> int:
        """Positions a sequence may reach: max_position_embeddings, times the factor of a dynamic-NTK RoPE (which
        exists to run past it; vLLM sizes its context the same way)."""
        rs = self.rope_scaling or {}
        if rs.get("rope_type") == "dynamic" and _is_real(rs.get("factor")) and rs["factor"] > 1:
            return int(self.max_position_embeddings * rs["factor"])
        return self.max_position_embeddings

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def moe(self) -> bool:
        return "moe" in self.mlp_types

    def block_kinds(self, i: int) -> tuple[str, str]:
        """The block kinds of layer i, in order (models/blocks.FORWARD): attention or mla, then mlp or moe."""
        return ("mla" if self.mla else "attention", "moe" if self.mlp_types[i] == "moe" else "mlp")

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
        self._validate_moe(bad, show)
        self._validate_mla(bad, show)
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim or self.rotary_dim <= 0:
            bad(f"rotary dimension {self.rotary_dim} must be even and within head_dim {self.head_dim}")
        self._validate_rope_scaling(bad, show)
        return self

    def _validate_moe(self, bad, show) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "n_group", "topk_group"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0 or v > MOE_LIMITS[name]:
                bad(f"{name} must be an integer in 0..{MOE_LIMITS[name]}, got {show(v)}")
        for name in ("router_bias", "norm_topk_prob", "shared_expert_gate"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {show(getattr(self, name))}")
        if not isinstance(self.mlp_types, list) or len(self.mlp_types) != self.num_layers:
            bad(f"mlp_types must be a list of {self.num_layers} entries, got {show(self.mlp_types)}")
        for t in self.mlp_types:
            if not isinstance(t, str) or t not in MLP_TYPES:
                bad(f"mlp type {show(t)} is not one of {MLP_TYPES}")
        if "moe" not in self.mlp_types:
            return
        E, k = self.num_experts, self.num_experts_per_tok
        if E < 1:
            bad("num_experts must be positive when a layer is a mixture of experts")
        if not 1 <= k <= E:
            bad(f"num_experts_per_tok ({k}) must be in 1..num_experts ({E})")
        if self.moe_intermediate_size < 1:
            bad("moe_intermediate_size must be positive when a layer is a mixture of experts")
        if self.router_scoring not in ROUTER_SCORINGS:
            bad(f"router_scoring {show(self.router_scoring)} is not supported ({', '.join(ROUTER_SCORINGS)})")
        if self.router_topk not in ROUTER_TOPK:
            bad(f"router_topk {show(self.router_topk)} is not supported ({', '.join(ROUTER_TOPK)})")
        g, tg = self.n_group, self.topk_group
        if g < 1 or E % g:
            bad(f"n_group ({g}) must divide num_experts ({E})")
        if not 1 <= tg <= g:
            bad(f"topk_group ({tg}) must be in 1..n_group ({g})")
        if self.router_topk != "greedy" and k > tg * (E // g):
            bad(f"num_experts_per_tok ({k}) is more than the {tg * (E // g)} experts of topk_group ({tg}) groups")
        if self.router_topk == "noaux_tc" and E // g < 2:
            bad(f"router_topk noaux_tc ranks groups by their two best experts: n_group ({g}) leaves "
                f"{E // g} per group")
        v = self.routed_scaling_factor
        if not _is_real(v) or not 0 < v <= MAX_SCALE:
            bad(f"routed_scaling_factor must be a finite number in (0, {MAX_SCALE:g}], got {show(v)}")
        if self.mlp_bias:
            bad("mlp_bias is not supported with a mixture of experts")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            bad("shared_expert_gate needs a shared expert (shared_expert_intermediate_size > 0)")

    def _validate_mla(self, bad, show) -> None:
        for name in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0 or v > MOE_LIMITS[name]:
                bad(f"{name} must be an integer in 0..{MOE_LIMITS[name]}, got {show(v)}")
        if not isinstance(self.rope_interleave, bool):
            bad(f"rope_interleave must be true or false, got {show(self.rope_interleave)}")
        if not self.mla:
            if self.q_lora_rank or self.qk_rope_head_dim or self.v_head_dim:
                bad("q_lora_rank, qk_rope_head_dim and v_head_dim need kv_lora_rank > 0 (latent attention)")
            return
        r = self.qk_rope_head_dim
        if r <= 0 or r % 2 or r >= self.head_dim:
            bad(f"qk_rope_head_dim ({r}) must be even, positive and below head_dim ({self.head_dim} = "
                "qk_nope_head_dim + qk_rope_head_dim)")
        if self.v_head_dim <= 0:
            bad("v_head_dim must be positive with latent attention")
        if self.num_kv_heads != self.num_heads:
            bad(f"num_kv_heads ({self.num_kv_heads}) must equal num_heads ({self.num_heads}) with latent attention "
                "(every head has its own keys from the latent)")
        if self.num_heads * self.v_head_dim > LIMITS["intermediate_size"]:
            bad(f"num_heads x v_head_dim = {self.num_heads * self.v_head_dim} is past the limit")
        if self.qkv_bias or self.o_bias or self.qk_norm or self.sandwich_norms:
            bad("latent attention takes no qkv_bias, o_bias, qk_norm or sandwich_norms")
        if self.partial_rotary_factor != 1.0:
            bad("latent attention sets its rotary part by qk_rope_head_dim, not partial_rotary_factor")

    def _validate_rope_scaling(self, bad, show) -> None:
        rs = self.rope_scaling
        if rs is None:
            return
        if not isinstance(rs, dict) or not all(isinstance(k, str) for k in rs):
            bad(f"rope_scaling must be an object or null, got {show(rs)}")
        kind = rs.get("rope_type")
        if kind not in ROPE_SCALINGS:
            bad(f"rope_scaling.rope_type {show(kind)} is not supported ({', '.join(ROPE_SCALINGS)})")

        def num(key: str, default: Any = None, lo: float = 1e-3, optional: bool = False) -> float | None:
            v = rs.get(key, default)
            if v is None and optional:
                return None
            if not _is_real(v) or not lo <= v <= MAX_SCALE:
                bad(f"rope_scaling.{key} must be a number in [{lo:g}, {MAX_SCALE:g}], got {show(v)}")
            return float(v)
        if kind in ("linear", "llama3", "dynamic", "yarn"):
            num("factor")
        if kind == "llama3":
            low, high = num("low_freq_factor", 1.0), num("high_freq_factor", 4.0)
            if high <= low:
                bad(f"rope_scaling.high_freq_factor ({high:g}) must be larger than low_freq_factor ({low:g})")
            num("original_max_position_embeddings", 8192, lo=1.0)
        elif kind == "yarn":
            num("original_max_position_embeddings", lo=1.0)
            for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
                num(key, lo=0.0, optional=True)
            if "truncate" in rs and not isinstance(rs["truncate"], bool):
                bad(f"rope_scaling.truncate must be true or false, got {show(rs['truncate'])}")
        elif kind == "longrope":
            num("original_max_position_embeddings", lo=1.0)
            num("factor", lo=1e-3, optional=True)
            num("attention_factor", lo=0.0, optional=True)
            half = self.rotary_dim // 2
            for key in ("short_factor", "long_factor"):
                f = rs.get(key)
                if not isinstance(f, list) or len(f) != half or not all(
                        _is_real(x) and 1e-6 <= x <= MAX_SCALE for x in f):
                    bad(f"rope_scaling.{key} must be a list of {half} positive numbers (rotary dimension / 2), "
                        f"got {show(f)}")

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
