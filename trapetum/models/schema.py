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

Block kinds (ModelConfig.block_kinds): "attention" (q/k/v/o projections, optional q/k norms, pre and optional post
norm), "mlp" (dense gated MLP: gate/up/down, pre and optional post norm), and

    "mla" (multi-head latent attention, DeepSeek-V2/V3; r = kv_lora_rank, hd = qk_nope + qk_rope):
        self_attn.q_proj [H hd, D]  or  self_attn.q_a_proj [q_lora_rank, D], q_a_layernorm [q_lora_rank],
        self_attn.q_b_proj [H hd, q_lora_rank];  self_attn.kv_a_proj [r + qk_rope, D] (HF kv_a_proj_with_mqa),
        self_attn.kv_a_layernorm [r], self_attn.kv_b_proj [H (qk_nope + v_head_dim), r], self_attn.o_proj [D, H v]
    "moe" (mixture of experts; E experts of intermediate size Im, a shared expert of Is):
        mlp.gate.weight [E, D] (the router), mlp.gate.e_score_correction_bias [E] (router_bias),
        mlp.experts.{e}.{gate,up,down}_proj.weight (Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2),
        mlp.shared_experts.{gate,up,down}_proj.weight (Qwen2-MoE's shared_expert), mlp.shared_expert_gate.weight [1, D]

``attention_names`` / ``mla_names`` / ``mlp_names`` / ``moe_names`` give each role's canonical name;
``layer_projections`` every projection of a layer (what a quantizer quantizes); ``expected_names`` /
``expected_shapes`` the whole model's; ``fetch`` reads one tensor of a checkpoint with its shape checked against
the config.
"""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError, FormatError
from .config import ModelConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # per dense layer
GATE_UP_DOWN = ("gate", "up", "down")


def attention_names(cfg: ModelConfig, i: int) -> dict[str, str | None]:
    """Role -> canonical tensor name (without .weight / .bias) of layer i's attention block."""
    p = f"model.layers.{i}."
    sw = cfg.sandwich_norms
    return {"input_norm": p + "input_layernorm", "q": p + "self_attn.q_proj", "k": p + "self_attn.k_proj",
            "v": p + "self_attn.v_proj", "o": p + "self_attn.o_proj",
            "q_norm": p + "self_attn.q_norm" if cfg.qk_norm else None,
            "k_norm": p + "self_attn.k_norm" if cfg.qk_norm else None,
            "post_norm": p + "post_attention_layernorm" if sw else None}


def mla_names(cfg: ModelConfig, i: int) -> dict[str, str | None]:
    """Role -> canonical tensor name of layer i's latent attention block (q_a / q_a_norm / q_b with q_lora_rank,
    else q)."""
    p = f"model.layers.{i}.self_attn."
    lo = cfg.q_lora_rank > 0
    return {"input_norm": f"model.layers.{i}.input_layernorm", "q": None if lo else p + "q_proj",
            "q_a": p + "q_a_proj" if lo else None, "q_a_norm": p + "q_a_layernorm" if lo else None,
            "q_b": p + "q_b_proj" if lo else None, "kv_a": p + "kv_a_proj", "kv_a_norm": p + "kv_a_layernorm",
            "kv_b": p + "kv_b_proj", "o": p + "o_proj"}


def mlp_names(cfg: ModelConfig, i: int) -> dict[str, str | None]:
    """Role -> canonical tensor name of layer i's MLP block."""
    p = f"model.layers.{i}."
    sw = cfg.sandwich_norms
    return {"norm": p + ("pre_feedforward_layernorm" if sw else "post_attention_layernorm"),
            "gate": p + "mlp.gate_proj", "up": p + "mlp.up_proj", "down": p + "mlp.down_proj",
            "post_norm": p + "post_feedforward_layernorm" if sw else None}


def expert_names(i: int, e: int) -> dict[str, str]:
    """gate / up / down -> canonical name of expert e of layer i."""
    return {r: f"model.layers.{i}.mlp.experts.{e}.{r}_proj" for r in GATE_UP_DOWN}


def moe_names(cfg: ModelConfig, i: int) -> dict[str, Any]:
    """Role -> canonical tensor name(s) of layer i's mixture-of-experts block: norm, router (the tensor is
    ``router + ".weight"``), router_bias (a full tensor name or None), experts (one gate/up/down dict per expert),
    shared (gate/up/down dict or None), shared_gate, post_norm."""
    p = f"model.layers.{i}."
    shared = cfg.shared_expert_intermediate_size > 0
    return {"norm": mlp_names(cfg, i)["norm"], "router": p + "mlp.gate",
            "router_bias": p + "mlp.gate.e_score_correction_bias" if cfg.router_bias else None,
            "experts": [expert_names(i, e) for e in range(cfg.num_experts)],
            "shared": {r: p + f"mlp.shared_experts.{r}_proj" for r in GATE_UP_DOWN} if shared else None,
            "shared_gate": p + "mlp.shared_expert_gate" if cfg.shared_expert_gate else None,
            "post_norm": mlp_names(cfg, i)["post_norm"]}


def layer_projections(cfg: ModelConfig, i: int) -> list[str]:
    """Every projection (canonical name without .weight) of layer i, in block order: what a quantizer quantizes.
    Routers and the shared-expert gate are not projections (kept exact, like norms)."""
    attn, mlp = cfg.block_kinds(i)
    if attn == "mla":
        n = mla_names(cfg, i)
        out = [n[r] for r in ("q", "q_a", "q_b", "kv_a", "kv_b", "o") if n[r] is not None]
    else:
        n = attention_names(cfg, i)
        out = [n[r] for r in ("q", "k", "v", "o")]
    if mlp == "moe":
        m = moe_names(cfg, i)
        for ex in m["experts"]:
            out += [ex[r] for r in GATE_UP_DOWN]
        if m["shared"] is not None:
            out += [m["shared"][r] for r in GATE_UP_DOWN]
    else:
        n = mlp_names(cfg, i)
        out += [n[r] for r in GATE_UP_DOWN]
    return out


def expected_names(cfg: ModelConfig) -> list[str]:
    """Every canonical tensor name a checkpoint with this config must provide (biases excluded)."""
    return [n for n in expected_shapes(cfg) if not n.endswith(".bias")]


def _attention_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    D, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    n = attention_names(cfg, i)
    s = {n["input_norm"] + ".weight": (D,), n["q"] + ".weight": (q, D), n["k"] + ".weight": (kv, D),
         n["v"] + ".weight": (kv, D), n["o"] + ".weight": (D, q)}
    if cfg.qkv_bias:
        s.update({n["q"] + ".bias": (q,), n["k"] + ".bias": (kv,), n["v"] + ".bias": (kv,)})
    if cfg.o_bias:
        s[n["o"] + ".bias"] = (D,)
    if cfg.qk_norm:
        s.update({n["q_norm"] + ".weight": (hd,), n["k_norm"] + ".weight": (hd,)})
    return s


def _mla_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    D, H, r, rope = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    n = mla_names(cfg, i)
    s = {n["input_norm"] + ".weight": (D,), n["kv_a"] + ".weight": (r + rope, D), n["kv_a_norm"] + ".weight": (r,),
         n["kv_b"] + ".weight": (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
         n["o"] + ".weight": (D, H * cfg.v_head_dim)}
    if n["q"] is not None:
        s[n["q"] + ".weight"] = (H * cfg.head_dim, D)
    else:
        qr = cfg.q_lora_rank
        s.update({n["q_a"] + ".weight": (qr, D), n["q_a_norm"] + ".weight": (qr,),
                  n["q_b"] + ".weight": (H * cfg.head_dim, qr)})
    return s


def _gud(names: dict[str, str], D: int, inter: int, bias: bool) -> dict[str, tuple[int, ...]]:
    s = {names["gate"] + ".weight": (inter, D), names["up"] + ".weight": (inter, D),
         names["down"] + ".weight": (D, inter)}
    if bias:
        s.update({names["gate"] + ".bias": (inter,), names["up"] + ".bias": (inter,), names["down"] + ".bias": (D,)})
    return s


def _mlp_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    D = cfg.hidden_size
    n = mlp_names(cfg, i)
    if cfg.block_kinds(i)[1] == "moe":
        m = moe_names(cfg, i)
        s = {m["router"] + ".weight": (cfg.num_experts, D)}
        if m["router_bias"] is not None:
            s[m["router_bias"]] = (cfg.num_experts,)
        for ex in m["experts"]:
            s.update(_gud(ex, D, cfg.moe_intermediate_size, False))
        if m["shared"] is not None:
            s.update(_gud(m["shared"], D, cfg.shared_expert_intermediate_size, False))
        if m["shared_gate"] is not None:
            s[m["shared_gate"] + ".weight"] = (1, D)
    else:
        s = _gud(n, D, cfg.intermediate_size, cfg.mlp_bias)
    return s


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape for dense checkpoints (weights are [out_features, in_features])."""
    D = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, D),
        "model.norm.weight": (D,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update(_mla_shapes(cfg, i) if cfg.mla else _attention_shapes(cfg, i))
        shapes[p + "post_attention_layernorm.weight"] = (D,)
        shapes.update(_mlp_shapes(cfg, i))
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
