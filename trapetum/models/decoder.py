"""The reference decoder: the model's blocks (models/blocks) run over TorchOps, as an nn.Module tree whose
submodule names are the canonical checkpoint names (``model.layers.0.self_attn.q_proj``), so that quantizers and
calibration find projections by name.

Every supported family is this one decoder; quirks come from ModelConfig flags. A layer is an attention block
then an MLP block (models/blocks/attention.py, mlp.py: the data path, written once for every executor).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from ..errors import FormatError
from ..schemes import registry
from ..schemes.dense import Embedding, Linear
from .batch import ForwardBatch, Mode
from .blocks import decoder_forward, layer_forward
from .checkpoint import Checkpoint
from .config import ModelConfig
from .kv_cache import KVCache
from .layers import RMSNorm, activation, rotaries
from .schema import attention_names, expected_shapes, fetch, mlp_names
from .torch_ops import TorchOps


class Attention(nn.Module):
    def __init__(self, mods: dict[str, nn.Module]):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (mods[x] for x in ("q", "k", "v", "o"))
        self.q_norm = mods.get("q_norm")
        self.k_norm = mods.get("k_norm")


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, mods: dict[str, nn.Module]):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mods["gate"], mods["up"], mods["down"]
        self.act = activation(cfg.hidden_act)


class Block(nn.Module):
    """One decoder layer's modules; ``blocks`` gives them to the block functions by role."""

    def __init__(self, cfg: ModelConfig, layer: int, mods: dict[str, nn.Module]):
        super().__init__()
        self.self_attn = Attention(mods)
        self.mlp = MLP(cfg, mods)
        self.input_layernorm = mods["input_norm"]
        self.post_attention_layernorm = mods["post_attn_norm"]
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = mods["pre_ffn_norm"]
            self.post_feedforward_layernorm = mods["post_ffn_norm"]
        self.layer_index = layer  # its KV-cache layer (a streamed one-block decoder sets the model's index)
        self.sliding = cfg.layer_types[layer] == "sliding"

    @property
    def blocks(self) -> list:
        a, m, sw = self.self_attn, self.mlp, self.sandwich
        attn = SimpleNamespace(input_norm=self.input_layernorm, qkv=(a.q_proj, a.k_proj, a.v_proj), o=a.o_proj,
                               q_norm=a.q_norm, k_norm=a.k_norm, layer=self.layer_index, sliding=self.sliding,
                               post_norm=self.post_attention_layernorm if sw else None)
        mlp = SimpleNamespace(norm=self.pre_feedforward_layernorm if sw else self.post_attention_layernorm,
                              gate_up=(m.gate_proj, m.up_proj, m.act), down=m.down_proj,
                              post_norm=self.post_feedforward_layernorm if sw else None)
        return [("attention", attn), ("mlp", mlp)]


class Decoder(nn.Module):
    """Decoder-only transformer (the torch reference). Submodule names equal the canonical checkpoint names."""

    def __init__(self, cfg: ModelConfig, embed: nn.Module, blocks: list[nn.Module], norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = embed
        self.model.layers = nn.ModuleList(blocks)
        self.model.norm = norm
        self.lm_head = lm_head
        g, loc = rotaries(cfg)
        self.rope_global, self.rope_local = g, loc

    # the model as decoder_forward reads it
    @property
    def embed(self):
        return self.model.embed_tokens

    @property
    def layers(self):
        return self.model.layers

    @property
    def final_norm(self):
        return self.model.norm

    @property
    def head(self):
        return self.lm_head

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, start_pos: int = 0,
                last_only: bool = False, mode: Mode = Mode.PREFILL) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] float32 (or [B, 1, V] with last_only). ``mode`` VERIFY computes the
        rows one by one (row r bitwise the one-token forward at start_pos + r; models/torch_ops.py)."""
        T = tokens.shape[1]
        batch = ForwardBatch(mode, tokens, start_pos, T, "last" if last_only else "all")
        pos = torch.arange(start_pos, start_pos + T, device=tokens.device)
        ops = TorchOps(self.config, (self.rope_global, self.rope_local), pos, cache, mode)
        return decoder_forward(batch, ops, self)

    def run_layer(self, layer: nn.Module, x: torch.Tensor, start_pos: int = 0,
                  cache: KVCache | None = None) -> torch.Tensor:
        """One layer's blocks on a residual stream x [B, T, D] at positions start_pos .. (calibration walks the
        model layer by layer)."""
        T = x.shape[1]
        pos = torch.arange(start_pos, start_pos + T, device=x.device)
        batch = ForwardBatch(Mode.PREFILL, torch.zeros(x.shape[:2], dtype=torch.long, device=x.device), start_pos, T)
        return layer_forward(x, batch, TorchOps(self.config, (self.rope_global, self.rope_local), pos, cache), layer)

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        p = next(self.parameters())
        return KVCache(self.config, batch, max_len or self.config.max_position_embeddings, p.dtype, p.device)

    def use_host_kernels(self, threads: int | None = None) -> int:
        """Route the projections that can (4/8-bit codebooks on the CPU) through the host GEMV
        (``CodebookLinear.use_host``; their dense copies dropped); ``threads``: None follows
        ``torch.get_num_threads()``. Returns how many projections use it."""
        return sum(1 for m in self.modules() if hasattr(m, "use_host") and m.use_host(threads))

    def projections(self) -> dict[str, nn.Module]:
        """Canonical name -> projection module (q/k/v/o, gate/up/down, lm_head)."""
        return {name: mod for name, mod in self.named_modules() if name.endswith("_proj") or name == "lm_head"}

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "Decoder":
        cfg = ckpt.config
        shapes = expected_shapes(cfg)

        def get(name: str, required: bool = True):
            return fetch(ckpt, name, required, shapes)

        def proj(name: str) -> nn.Module:
            w = get(name + ".weight")
            return registry.reference_linear(w, get(name + ".bias", required=False), name + ".weight",
                                             dtype=dtype, device=device)

        def norm(name: str) -> RMSNorm:
            return RMSNorm(get(name + ".weight").to(device=device, dtype=dtype), cfg.rms_norm_eps, cfg.norm_offset)

        embed = registry.reference_embedding(get("model.embed_tokens.weight"), dtype=dtype, device=device)
        blocks = []
        for i in range(cfg.num_layers):
            an, mn = attention_names(cfg, i), mlp_names(cfg, i)
            mods: dict[str, nn.Module] = {r: proj(an[r]) for r in ("q", "k", "v", "o")}
            mods.update({r: proj(mn[r]) for r in ("gate", "up", "down")})
            mods["input_norm"] = norm(an["input_norm"])
            mods["post_attn_norm"] = norm(f"model.layers.{i}.post_attention_layernorm")
            if cfg.qk_norm:
                mods["q_norm"], mods["k_norm"] = norm(an["q_norm"]), norm(an["k_norm"])
            if cfg.sandwich_norms:
                mods["pre_ffn_norm"], mods["post_ffn_norm"] = norm(mn["norm"]), norm(mn["post_norm"])
            blocks.append(Block(cfg, i, mods))
        final_norm = norm("model.norm")
        if "lm_head.weight" in ckpt.tensors:
            lm_head = proj("lm_head")
        elif cfg.tie_word_embeddings and isinstance(embed, Embedding):
            lm_head = Linear(embed.weight.data)
        elif cfg.tie_word_embeddings and hasattr(embed, "as_linear"):
            lm_head = embed.as_linear()  # quantized table shared with the head
        elif cfg.tie_word_embeddings:
            lm_head = Linear(embed.dequantize().to(dtype))
        else:
            raise FormatError(f"{ckpt.source}: tensor 'lm_head.weight' is missing and embeddings are not tied")
        return cls(cfg, embed, blocks, final_norm, lm_head).to(device)
