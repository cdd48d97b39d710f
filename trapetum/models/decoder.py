"""One decoder for every supported family; quirks come from ModelConfig flags.

Data path of one block (HF semantics):
    h = x + [post_attention_norm](attn(input_norm(x)))          # post norm only with sandwich_norms
    y = h + [post_ffn_norm](mlp(ffn_norm(h)))                    # ffn_norm = post_attention_layernorm
                                                                  # (or pre_feedforward_layernorm with sandwich_norms)
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, FormatError
from .checkpoint import Checkpoint, expected_shapes
from ..schemes.record import QuantRecord
from .kv_cache import KVCache
from .config import ModelConfig
from .layers import Embedding, Linear, RMSNorm, Rotary, activation, rotaries


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, mods: dict[str, nn.Module]):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (mods[x] for x in ("q", "k", "v", "o"))
        self.q_norm = mods.get("q_norm")
        self.k_norm = mods.get("k_norm")
        self.sliding = cfg.layer_types[layer] == "sliding"

    def forward(self, x: torch.Tensor, rope: Rotary, cos: torch.Tensor, sin: torch.Tensor,
                start: int, cache: KVCache | None) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = self.k_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        v = self.v_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        if cache is not None:
            k, v = cache.store(self.layer, start, k, v)  # [B, Hkv, S, hd], S = start + T
        S = k.shape[2]
        rep = cfg.num_heads // cfg.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        qpos = torch.arange(start, start + T, device=x.device)[:, None]
        kpos = torch.arange(S, device=x.device)[None, :]
        allowed = kpos <= qpos  # [T, S]
        if self.sliding:
            allowed = allowed & (qpos - kpos < cfg.sliding_window)
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * cfg.scale  # [B, H, T, S]
        if cfg.attn_softcap is not None:
            s = torch.tanh(s / cfg.attn_softcap) * cfg.attn_softcap
        s = s.masked_fill(~allowed, float("-inf"))
        out = torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
        out = out.transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, mods: dict[str, nn.Module]):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mods["gate"], mods["up"], mods["down"]
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, mods: dict[str, nn.Module]):
        super().__init__()
        self.self_attn = Attention(cfg, layer, mods)
        self.mlp = MLP(cfg, mods)
        self.input_layernorm = mods["input_norm"]
        self.post_attention_layernorm = mods["post_attn_norm"]
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = mods["pre_ffn_norm"]
            self.post_feedforward_layernorm = mods["post_ffn_norm"]
        self.local = cfg.layer_types[layer] == "sliding"

    def forward(self, x, ropes, start, cache):
        rope, cos, sin = ropes[1] if (self.local and ropes[1] is not None) else ropes[0]
        a = self.self_attn(self.input_layernorm(x), rope, cos, sin, start, cache)
        if self.sandwich:
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Decoder-only transformer. Submodule names equal the canonical checkpoint names
    (``model.layers.0.self_attn.q_proj``), so quantizers replace projections by name."""

    def __init__(self, cfg: ModelConfig, embed: nn.Module, blocks: list[Block], norm: RMSNorm, lm_head: nn.Module):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = embed
        self.model.layers = nn.ModuleList(blocks)
        self.model.norm = norm
        self.lm_head = lm_head
        g, loc = rotaries(cfg)
        self.rope_global, self.rope_local = g, loc
        self.released: str | None = None  # set when a GPU engine took over the codes (GpuEngine own_weights)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, start_pos: int = 0,
                last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] float32 (or [B, 1, V] with last_only)."""
        if self.released is not None:
            from ..errors import UnsupportedError
            raise UnsupportedError(f"this decoder's quantized codes were handed to the GPU engine ({self.released}); "
                                   "use the engine (Model.runner), or load with keep_reference=True")
        cfg = self.config
        x = self.model.embed_tokens(tokens)
        if cfg.embed_scale is not None:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        T = tokens.shape[1]
        pos = torch.arange(start_pos, start_pos + T, device=tokens.device)
        ropes = [(self.rope_global, *self.rope_global.cos_sin(pos))]
        ropes.append((self.rope_local, *self.rope_local.cos_sin(pos)) if self.rope_local is not None else None)
        for block in self.model.layers:
            x = block(x, ropes, start_pos, cache)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.model.norm(x)).float()
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        p = next(self.parameters())
        return KVCache(self.config, batch, max_len or self.config.max_position_embeddings, p.dtype, p.device)

    def projections(self) -> dict[str, nn.Module]:
        """Canonical name -> projection module (q/k/v/o, gate/up/down, lm_head)."""
        out = {}
        for name, mod in self.named_modules():
            if name.endswith("_proj") or name == "lm_head":
                out[name] = mod
        return out

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "Decoder":
        cfg = ckpt.config
        shapes = expected_shapes(cfg)
        src = ckpt.source

        def fetch(name: str, required: bool = True) -> Any:
            if name not in ckpt.tensors:
                if required:
                    raise FormatError(f"{src}: tensor {name!r} is missing")
                return None
            t = ckpt.tensors[name]
            want = shapes.get(name)
            got = tuple(t.shape) if isinstance(t, QuantRecord) else tuple(t.shape)
            if want is not None and got != want:
                raise ConfigError(f"{src}: tensor {name!r} has shape {list(got)} but the config implies {list(want)}")
            return t

        def dense(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype)

        def proj(name: str) -> nn.Module:
            w = fetch(name + ".weight")
            b = fetch(name + ".bias", required=False)
            if isinstance(w, QuantRecord):
                from ..quant.linear import build_linear
                return build_linear(w, dtype=dtype, device=device)
            return Linear(dense(w), dense(b) if b is not None else None)

        def norm(name: str) -> RMSNorm:
            return RMSNorm(dense(fetch(name)), cfg.rms_norm_eps, cfg.norm_offset)

        e = fetch("model.embed_tokens.weight")
        if isinstance(e, QuantRecord):
            from ..quant.linear import build_embedding
            embed = build_embedding(e, dtype=dtype, device=device)
        else:
            embed = Embedding(dense(e))
        blocks = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            mods: dict[str, nn.Module] = {x: proj(p + f"self_attn.{x}_proj") for x in "qkvo"}
            mods.update({x: proj(p + f"mlp.{x}_proj") for x in ("gate", "up", "down")})
            mods["input_norm"] = norm(p + "input_layernorm.weight")
            mods["post_attn_norm"] = norm(p + "post_attention_layernorm.weight")
            if cfg.qk_norm:
                mods["q_norm"] = norm(p + "self_attn.q_norm.weight")
                mods["k_norm"] = norm(p + "self_attn.k_norm.weight")
            if cfg.sandwich_norms:
                mods["pre_ffn_norm"] = norm(p + "pre_feedforward_layernorm.weight")
                mods["post_ffn_norm"] = norm(p + "post_feedforward_layernorm.weight")
            blocks.append(Block(cfg, i, mods))
        final_norm = norm("model.norm.weight")
        if "lm_head.weight" in ckpt.tensors:
            lm_head = proj("lm_head")
        elif cfg.tie_word_embeddings and isinstance(embed, Embedding):
            lm_head = Linear(embed.weight.data)
        elif cfg.tie_word_embeddings and hasattr(embed, "as_linear"):
            lm_head = embed.as_linear()  # quantized table shared with the head
        elif cfg.tie_word_embeddings:
            lm_head = Linear(embed.dequantize().to(dtype))
        else:
            raise FormatError(f"{src}: tensor 'lm_head.weight' is missing and embeddings are not tied")
        model = cls(cfg, embed, blocks, final_norm, lm_head)
        return model.to(device)
