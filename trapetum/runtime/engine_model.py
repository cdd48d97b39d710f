"""The engine's model, built from a Checkpoint through the weight schemes, tensor by tensor, straight into the
kernels' layouts on the device (no reference decoder in between; the source tensors are read one at a time and
dropped, so loading peaks near the engine's own weights).

    EngineModel: embed (fp16 [V, D]), layers (EngineLayer: ``blocks`` = [("attention", AttnWeights) or
                 ("mla", MlaWeights), ("mlp", MlpWeights) or ("moe", MoeWeights)]), final_norm (fp32 [D]),
                 head (Projection)
The roles and their tensor names come from models/schema.py; each projection's form from schemes/registry.py
(q/k/v and gate/up fused where the scheme allows and ``Options.fuse``). A Placement (runtime/placement.py) may
keep the embedding table in host RAM (``EngineModel.embed`` on the CPU; a dense head tied to it gets its own copy on
the device) and every MoE layer's routed experts (``MoeWeights.experts`` a HostExperts, runtime/host_experts.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import FormatError
from ..models.checkpoint import Checkpoint
from ..models.sparsity import SiteThresholds
from ..models.schema import attention_names, expected_shapes, fetch, mla_names, mlp_names, moe_names
from ..schemes import registry
from ..schemes.base import GateUp, Projection, residual16
from ..settings import Options
from .engine_experts import stack_experts
from .host_experts import HostExperts
from .placement import ON_DEVICE, Placement


@dataclass
class AttnWeights:
    layer: int
    sliding: bool
    input_norm: torch.Tensor
    qkv: Projection
    o: Projection
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor | None
    sparsity: SiteThresholds | None = None  # activation sparsity (models/sparsity.py), set by the engine


@dataclass
class MlpWeights:
    norm: torch.Tensor
    gate_up: GateUp
    down: Projection
    post_norm: torch.Tensor | None
    sparsity: SiteThresholds | None = None


@dataclass
class MlaWeights:
    """Latent attention (models/blocks/mla.py): q or q_a / q_a_norm / q_b, kv_a, kv_a_norm, kv_b, o."""
    layer: int
    input_norm: torch.Tensor
    q: Projection | None
    q_a: Projection | None
    q_a_norm: torch.Tensor | None
    q_b: Projection | None
    kv_a: Projection
    kv_a_norm: torch.Tensor
    kv_b: Projection
    o: Projection
    sliding: bool = False
    w_uk_t: torch.Tensor | None = None  # Options.mla "latent": kv_b's key / value blocks (runtime/engine_latent.py)
    w_uv: torch.Tensor | None = None

    def projections(self) -> list:
        return [w for w in (self.q, self.q_a, self.q_b, self.kv_a, self.kv_b, self.o) if w is not None]

    def tensors(self) -> list:
        return [t for t in (self.input_norm, self.q_a_norm, self.kv_a_norm, self.w_uk_t, self.w_uv) if t is not None]


@dataclass
class ExpertWeights:
    gate_up: GateUp
    down: Projection


@dataclass
class EngineRouter:
    """An MoE layer's router: ``proj`` the dense fp16 projection [E, D] (a batch-invariant GEMV; its logits are
    rounded to fp16 like every engine projection's), ``bias`` fp32 [E] or None (DeepSeek-V3's correction bias)."""
    proj: Projection
    bias: torch.Tensor | None


@dataclass
class MoeWeights:
    """A mixture-of-experts MLP (models/blocks/moe.py); ``experts`` an ExpertSet (runtime/engine_experts.py: the
    per-expert projections, views of the layer's stacks where the expert GEMVs apply), or a HostExperts (the
    routed experts in host RAM: runtime/host_experts.py)."""
    norm: torch.Tensor
    router: EngineRouter
    experts: list[ExpertWeights]
    shared: ExpertWeights | None
    shared_gate: Projection | None
    post_norm: torch.Tensor | None

    def projections(self) -> list:
        routed = [] if getattr(self.experts, "on_host", False) else self.experts
        out = [self.router.proj] + [w for e in routed for w in (e.gate_up, e.down)]
        if self.shared is not None:
            out += [self.shared.gate_up, self.shared.down]
        return out + ([self.shared_gate] if self.shared_gate is not None else [])

    def tensors(self) -> list:
        return [t for t in (self.norm, self.router.bias, self.post_norm) if t is not None]


@dataclass
class EngineLayer:
    blocks: list  # [(kind, weights)]

    @property
    def attention(self) -> AttnWeights:
        return self.blocks[0][1]

    @property
    def mlp(self) -> MlpWeights:
        return self.blocks[1][1]


@dataclass
class EngineModel:
    embed: torch.Tensor
    layers: list[EngineLayer]
    final_norm: torch.Tensor
    head: Projection
    embed_lo: torch.Tensor | None = None  # precise prefill: fp16((exact - embed) * 2^12) of a non-fp16 source
    embed_host: bool = False  # the table in host RAM (Placement.embed_host)

    def projections(self) -> list:
        out = [self.head]
        for L in self.layers:
            for _, w in L.blocks:
                out += w.projections() if hasattr(w, "projections") else (
                    [w.qkv, w.o] if isinstance(w, AttnWeights) else [w.gate_up, w.down])
        return out

    def host_weight_bytes(self) -> int:
        """Bytes of the weights in host RAM (runtime/placement.py): the embedding table kept there, host experts."""
        n = self.embed.numel() * self.embed.element_size() if self.embed_host else 0
        for L in self.layers:
            for _, w in L.blocks:
                if getattr(getattr(w, "experts", None), "on_host", False):
                    n += w.experts.nbytes()
        return n

    def weight_bytes(self) -> int:
        """Bytes of the engine's weights on its device (a head tied to the embedding table counted once; the
        tensors in host RAM: ``host_weight_bytes``)."""
        n = 0 if self.embed_host else self.embed.numel() * self.embed.element_size()
        n += self.final_norm.numel() * self.final_norm.element_size()
        head = self.head
        shared = getattr(head, "w", None) is not None and head.w.data_ptr() == self.embed.data_ptr()
        n += 0 if shared else head.nbytes()
        n += sum(p.nbytes() for p in self.projections()[1:])
        for L in self.layers:
            for _, w in L.blocks:
                ts = w.tensors() if hasattr(w, "tensors") else (
                    [w.input_norm, w.q_norm, w.k_norm, w.post_norm] if isinstance(w, AttnWeights)
                    else [w.norm, w.post_norm])
                n += sum(t.numel() * t.element_size() for t in ts if t is not None)
        return n


def enable_sparse(w) -> None:
    """A sparsity layer's block weights (AttnWeights / MlpWeights): the input-major codes of its site projections
    (q/k/v, o, gate/up, down) made where their scheme has a sparse GEMV (4/8-bit codebooks); the others keep the
    select plus their dense kernel (runtime/engine_ops.py)."""
    for name in ("qkv", "o", "gate_up", "down"):
        proj = getattr(w, name, None)
        if hasattr(proj, "enable_sparse"):
            proj.enable_sparse()


def build_model(ckpt: Checkpoint, device: torch.device, options: Options, precise: bool = False,
                placement: Placement = ON_DEVICE) -> EngineModel:
    """The engine's weights for ``ckpt`` on ``device``, where ``placement`` puts them (module docstring)."""
    cfg = ckpt.config
    shapes = expected_shapes(cfg)
    kopts, fuse = options.kernels, options.fuse

    def get(name, required=True):
        return fetch(ckpt, name, required, shapes)

    def part(name):
        return registry.part(name + ".weight", get(name + ".weight"), get(name + ".bias", required=False))

    def proj(*names):
        return registry.projection([part(n) for n in names], device, kopts, fuse=fuse, precise=precise)

    def norm(name):
        return None if name is None else get(name + ".weight").to(device=device, dtype=torch.float32)

    e = get("model.embed_tokens.weight")
    embed = registry.embedding_table(e, "cpu" if placement.embed_host else device)
    embed_lo = residual16(e, embed) if precise and isinstance(e, torch.Tensor) else None
    def gate_up(names):
        return registry.gate_up(part(names["gate"]), part(names["up"]), cfg.hidden_act, device, kopts, fuse=fuse,
                                precise=precise)

    def opt(name):
        return None if name is None else proj(name)

    layers = []
    for i in range(cfg.num_layers):
        attn_kind, mlp_kind = cfg.block_kinds(i)
        if attn_kind == "mla":
            an = mla_names(cfg, i)
            attn = MlaWeights(layer=i, input_norm=norm(an["input_norm"]), q=opt(an["q"]), q_a=opt(an["q_a"]),
                              q_a_norm=norm(an["q_a_norm"]), q_b=opt(an["q_b"]), kv_a=proj(an["kv_a"]),
                              kv_a_norm=norm(an["kv_a_norm"]), kv_b=proj(an["kv_b"]), o=proj(an["o"]))
        else:
            an = attention_names(cfg, i)
            attn = AttnWeights(layer=i, sliding=cfg.layer_types[i] == "sliding", input_norm=norm(an["input_norm"]),
                               qkv=proj(an["q"], an["k"], an["v"]), o=proj(an["o"]), q_norm=norm(an["q_norm"]),
                               k_norm=norm(an["k_norm"]), post_norm=norm(an["post_norm"]))
        mn = mlp_names(cfg, i)
        if mlp_kind == "moe":
            m = moe_names(cfg, i)
            router = get(m["router"] + ".weight")
            router = registry.projection([registry.part(m["router"] + ".weight", router.float())], device, kopts,
                                         precise=precise)
            bias = None if m["router_bias"] is None else get(m["router_bias"]).to(device=device, dtype=torch.float32)
            if placement.experts_host:
                experts = HostExperts.build(ckpt, m["experts"], cfg.hidden_act, ckpt.source)
            else:
                experts = stack_experts([ExpertWeights(gate_up(ex), proj(ex["down"])) for ex in m["experts"]])
            shared = ExpertWeights(gate_up(m["shared"]), proj(m["shared"]["down"])) if m["shared"] else None
            mlp = MoeWeights(norm=norm(m["norm"]), router=EngineRouter(router, bias), experts=experts, shared=shared,
                             shared_gate=opt(m["shared_gate"]), post_norm=norm(m["post_norm"]))
        else:
            mlp = MlpWeights(norm=norm(mn["norm"]), gate_up=gate_up(mn), down=proj(mn["down"]),
                             post_norm=norm(mn["post_norm"]))
        layers.append(EngineLayer([(attn_kind, attn), (mlp_kind, mlp)]))
    if "lm_head.weight" in ckpt.tensors:
        head = proj("lm_head")
    elif cfg.tie_word_embeddings:
        # a dense table is the head's weight as it is (one fp16 copy for both); a quantized table becomes a
        # projection of its own record (its kernel layout), the embedding its dequantized rows
        w = embed if isinstance(e, torch.Tensor) else e
        head = registry.projection([registry.part("lm_head.weight", w)], device, kopts, precise=precise)
        if precise and isinstance(e, torch.Tensor):
            head.lo = embed_lo
    else:
        raise FormatError(f"{ckpt.source}: tensor 'lm_head.weight' is missing and embeddings are not tied")
    return EngineModel(embed, layers, norm("model.norm"), head, embed_lo, embed_host=placement.embed_host)
