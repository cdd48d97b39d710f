"""The engine's model, built from a Checkpoint through the weight schemes, tensor by tensor, straight into the
kernels' layouts on the device (no reference decoder in between; the source tensors are read one at a time and
dropped, so loading peaks near the engine's own weights).

    EngineModel: embed (fp16 [V, D]), layers (EngineLayer: ``blocks`` = [("attention", AttnWeights),
                 ("mlp", MlpWeights)]), final_norm (fp32 [D]), head (Projection)
The roles and their tensor names come from models/schema.py; each projection's form from schemes/registry.py
(q/k/v and gate/up fused where the scheme allows and ``Options.fuse``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import FormatError
from ..models.checkpoint import Checkpoint
from ..models.schema import attention_names, expected_shapes, fetch, mlp_names
from ..schemes import registry
from ..schemes.base import GateUp, Projection, residual16
from ..settings import Options


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


@dataclass
class MlpWeights:
    norm: torch.Tensor
    gate_up: GateUp
    down: Projection
    post_norm: torch.Tensor | None


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

    def projections(self) -> list:
        out = [self.head]
        for L in self.layers:
            a, m = L.attention, L.mlp
            out += [a.qkv, a.o, m.gate_up, m.down]
        return out

    def weight_bytes(self) -> int:
        """Bytes of the engine's weights (a head tied to the embedding table counted once)."""
        n = self.embed.numel() * self.embed.element_size() + self.final_norm.numel() * self.final_norm.element_size()
        head = self.head
        shared = getattr(head, "w", None) is not None and head.w.data_ptr() == self.embed.data_ptr()
        n += 0 if shared else head.nbytes()
        for L in self.layers:
            a, m = L.attention, L.mlp
            n += a.qkv.nbytes() + a.o.nbytes() + m.gate_up.nbytes() + m.down.nbytes()
            n += sum(t.numel() * t.element_size() for t in (a.input_norm, a.q_norm, a.k_norm, a.post_norm,
                                                             m.norm, m.post_norm) if t is not None)
        return n


def build_model(ckpt: Checkpoint, device: torch.device, options: Options, precise: bool = False) -> EngineModel:
    """The engine's weights for ``ckpt`` on ``device`` (module docstring)."""
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
    embed = registry.embedding_table(e, device)
    embed_lo = residual16(e, embed) if precise and isinstance(e, torch.Tensor) else None
    layers = []
    for i in range(cfg.num_layers):
        an, mn = attention_names(cfg, i), mlp_names(cfg, i)
        attn = AttnWeights(layer=i, sliding=cfg.layer_types[i] == "sliding", input_norm=norm(an["input_norm"]),
                           qkv=proj(an["q"], an["k"], an["v"]), o=proj(an["o"]), q_norm=norm(an["q_norm"]),
                           k_norm=norm(an["k_norm"]), post_norm=norm(an["post_norm"]))
        gu = registry.gate_up(part(mn["gate"]), part(mn["up"]), cfg.hidden_act, device, kopts, fuse=fuse,
                              precise=precise)
        mlp = MlpWeights(norm=norm(mn["norm"]), gate_up=gu, down=proj(mn["down"]), post_norm=norm(mn["post_norm"]))
        layers.append(EngineLayer([("attention", attn), ("mlp", mlp)]))
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
    return EngineModel(embed, layers, norm("model.norm"), head, embed_lo)
