"""The reference decoder: the model's blocks (models/blocks) run over TorchOps, as an nn.Module tree whose
submodule names are the canonical checkpoint names (``model.layers.0.self_attn.q_proj``), so that quantizers and
calibration find projections by name.

Every supported family is this one decoder; quirks come from ModelConfig flags. A layer is an attention block
(attention.py, or mla.py: latent attention) then an MLP block (mlp.py, or moe.py: a mixture of experts) of
models/blocks/ (the data path, written once for every executor); ``ModelConfig.block_kinds`` says which.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, FormatError
from ..schemes import registry
from ..schemes.dense import Embedding, Linear
from .batch import ForwardBatch, Mode
from .blocks import decoder_forward, layer_forward
from .checkpoint import Checkpoint
from .config import LATENT_NORM_EPS, ModelConfig
from .cpu_ops import CpuStep
from .kv_cache import KVCache
from .layers import RMSNorm, activation, rotaries
from .sparsity import check_sparse_kinds
from .schema import attention_names, expected_shapes, fetch, mla_names, mlp_names, moe_names
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


class MLAttention(nn.Module):
    """Latent attention's modules (canonical names: q_proj or q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj,
    kv_a_layernorm, kv_b_proj, o_proj)."""

    def __init__(self, mods: dict[str, nn.Module]):
        super().__init__()
        for role, name in (("q", "q_proj"), ("q_a", "q_a_proj"), ("q_a_norm", "q_a_layernorm"), ("q_b", "q_b_proj"),
                           ("kv_a", "kv_a_proj"), ("kv_a_norm", "kv_a_layernorm"), ("kv_b", "kv_b_proj"),
                           ("o", "o_proj")):
            setattr(self, name, mods.get(role))


class Router(nn.Module):
    """The experts' router: fp32 logits [..., E] = x W^T (DeepSeek-V3's correction bias as a buffer; it enters the
    choice of experts only, models/blocks/moe.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            self.register_buffer("e_score_correction_bias", bias)
        else:
            self.e_score_correction_bias = None

    @property
    def bias(self) -> torch.Tensor | None:
        return self.e_score_correction_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class MoE(nn.Module):
    """A mixture-of-experts MLP's modules: gate (Router), experts (MLP each), shared_experts, shared_expert_gate."""

    def __init__(self, router: Router, experts: list[MLP], shared: MLP | None, shared_gate: nn.Module | None):
        super().__init__()
        self.gate = router
        self.experts = nn.ModuleList(experts)
        self.shared_experts = shared
        self.shared_expert_gate = shared_gate


def _gate_up(m: MLP) -> SimpleNamespace:
    return SimpleNamespace(gate_up=(m.gate_proj, m.up_proj, m.act), down=m.down_proj)


class Block(nn.Module):
    """One decoder layer's modules; ``blocks`` gives them to the block functions by role."""

    def __init__(self, cfg: ModelConfig, layer: int, mods: dict[str, nn.Module]):
        super().__init__()
        self.kinds = cfg.block_kinds(layer)
        self.self_attn = MLAttention(mods) if self.kinds[0] == "mla" else Attention(mods)
        self.mlp = mods["moe"] if self.kinds[1] == "moe" else MLP(cfg, mods)
        self.input_layernorm = mods["input_norm"]
        self.post_attention_layernorm = mods["post_attn_norm"]
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = mods["pre_ffn_norm"]
            self.post_feedforward_layernorm = mods["post_ffn_norm"]
        self.layer_index = layer  # its KV-cache layer (a streamed one-block decoder sets the model's index)
        self.sliding = cfg.layer_types[layer] == "sliding"
        self.sparsity = None  # SiteThresholds of the layer (activation sparsity, Decoder.set_sparsity) or None

    @property
    def blocks(self) -> list:
        a, m, sw = self.self_attn, self.mlp, self.sandwich
        if self.kinds[0] == "mla":
            attn = SimpleNamespace(input_norm=self.input_layernorm, q=a.q_proj, q_a=a.q_a_proj, q_a_norm=a.q_a_layernorm,
                                   q_b=a.q_b_proj, kv_a=a.kv_a_proj, kv_a_norm=a.kv_a_layernorm, kv_b=a.kv_b_proj,
                                   o=a.o_proj, layer=self.layer_index, sliding=False)
        else:
            attn = SimpleNamespace(input_norm=self.input_layernorm, qkv=(a.q_proj, a.k_proj, a.v_proj), o=a.o_proj,
                                   q_norm=a.q_norm, k_norm=a.k_norm, layer=self.layer_index, sliding=self.sliding,
                                   post_norm=self.post_attention_layernorm if sw else None, sparsity=self.sparsity)
        norm = self.pre_feedforward_layernorm if sw else self.post_attention_layernorm
        post = self.post_feedforward_layernorm if sw else None
        if self.kinds[1] == "moe":
            mlp = SimpleNamespace(norm=norm, router=m.gate, experts=[_gate_up(e) for e in m.experts],
                                  shared=_gate_up(m.shared_experts) if m.shared_experts is not None else None,
                                  shared_gate=m.shared_expert_gate, post_norm=post)
        else:
            mlp = SimpleNamespace(norm=norm, gate_up=(m.gate_proj, m.up_proj, m.act), down=m.down_proj,
                                  post_norm=post, sparsity=self.sparsity)
        return [(self.kinds[0], attn), (self.kinds[1], mlp)]


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
        self.cpu_step: CpuStep | None = None  # use_host_kernels(): decode steps on the CPU executor (cpu_ops.py)

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
        step = self.cpu_step
        if step is not None and step.applies(tokens, cache):  # 1..16 rows of one sequence: the host kernels
            return step.run(decoder_forward, batch, cache, self).unsqueeze(0)
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

    def set_sparsity(self, table) -> None:
        """Activation sparsity (models/sparsity.py): a SparsityTable of this model's layers, or None (dense: the
        blocks then run exactly the dense path). Only attention + dense-MLP layers take thresholds."""
        if table is not None:
            check_sparse_kinds(self.config)
            if len(table.layers) != len(self.model.layers):
                raise FormatError(f"the sparsity table has {len(table.layers)} layers, the model "
                                  f"{len(self.model.layers)}")
        for i, block in enumerate(self.model.layers):
            block.sparsity = None if table is None else table.layers[i]
        if self.cpu_step is not None:
            self.cpu_step.invalidate()  # its plan holds the blocks' parameters, thresholds included

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        p = next(self.parameters())
        return KVCache(self.config, batch, max_len or self.config.context_length, p.dtype, p.device)

    def use_host_kernels(self, threads: int | None = None, step: bool = True, numerics: str = "fp32") -> int:
        """Route the projections that can (4/8-bit codebooks on the CPU) through the host GEMV
        (``CodebookLinear.use_host``; their dense copies dropped); ``threads``: None follows
        ``torch.get_num_threads()``. ``step``: passes of 1..16 rows over an fp32 CPU cache then run the CPU
        executor (models/cpu_ops.py: fused GEMVs, the small ops in C) where the model is dense (attention + MLP
        blocks). ``numerics``: "fp32" or "int8" (``Options.host_numerics``: the int8 dot, 4- and 8-bit).
        Returns how many projections use the host GEMV."""
        n = sum(1 for m in self.modules() if hasattr(m, "use_host") and m.use_host(threads, numerics=numerics))
        self.cpu_step = CpuStep(self.config, (self.rope_global, self.rope_local), threads) if n and step else None
        return n

    def projections(self) -> dict[str, nn.Module]:
        """Canonical name -> projection module (q/k/v/o, gate/up/down, MLA's and the experts' projections,
        lm_head)."""
        return {name: mod for name, mod in self.named_modules() if name.endswith("_proj") or name == "lm_head"}

    def routers(self) -> dict[str, nn.Module]:
        """Canonical name -> router of each mixture-of-experts layer (``model.layers.{i}.mlp.gate``): its input is
        every row of the layer's MLP (calibration's fallback for experts that see few rows)."""
        return {name: mod for name, mod in self.named_modules() if isinstance(mod, Router)}

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", blocks: bool = False) -> "Decoder":
        """The reference decoder of ``ckpt``. ``blocks``: projections (and a tied head) whose source offers the
        weight as stored (``LazyTensors.record``: a GGUF's legacy block-quantized rows, schemes/ggml.py) keep
        it so, not dequantized: the CPU's decode then reads the blocks (``use_host_kernels``)."""
        cfg = ckpt.config
        shapes = expected_shapes(cfg)
        record = getattr(ckpt.tensors, "record", None) if blocks else None

        def get(name: str, required: bool = True):
            return fetch(ckpt, name, required, shapes)

        def stored(name: str):
            """The record of tensor ``name`` as stored, where ``blocks`` asks for it and the source has one."""
            rec = record(name) if record is not None and name in ckpt.tensors else None
            if rec is not None and tuple(rec.shape) != shapes.get(name, tuple(rec.shape)):
                raise ConfigError(f"{ckpt.source}: tensor {name!r} has shape {list(rec.shape)} but the config "
                                  f"implies {list(shapes[name])}")
            return rec

        def proj(name: str) -> nn.Module:
            w = stored(name + ".weight")
            w = get(name + ".weight") if w is None else w
            return registry.reference_linear(w, get(name + ".bias", required=False), name + ".weight",
                                             dtype=dtype, device=device)

        def norm(name: str, eps: float = cfg.rms_norm_eps) -> RMSNorm:
            return RMSNorm(get(name + ".weight").to(device=device, dtype=dtype), eps, cfg.norm_offset)

        def mlp(names: dict) -> MLP:
            return MLP(cfg, {r: proj(names[r]) for r in ("gate", "up", "down")})

        embed = registry.reference_embedding(get("model.embed_tokens.weight"), dtype=dtype, device=device)
        blocks = []
        for i in range(cfg.num_layers):
            attn_kind, mlp_kind = cfg.block_kinds(i)
            mods: dict[str, nn.Module] = {}
            if attn_kind == "mla":
                an = mla_names(cfg, i)
                mods.update({r: proj(an[r]) for r in ("q", "q_a", "q_b", "kv_a", "kv_b", "o") if an[r] is not None})
                mods.update({r: norm(an[r], LATENT_NORM_EPS) for r in ("q_a_norm", "kv_a_norm") if an[r] is not None})
            else:
                an = attention_names(cfg, i)
                mods.update({r: proj(an[r]) for r in ("q", "k", "v", "o")})
                if cfg.qk_norm:
                    mods["q_norm"], mods["k_norm"] = norm(an["q_norm"]), norm(an["k_norm"])
            mods["input_norm"] = norm(an["input_norm"])
            mods["post_attn_norm"] = norm(f"model.layers.{i}.post_attention_layernorm")
            mn = mlp_names(cfg, i)
            if mlp_kind == "moe":
                m = moe_names(cfg, i)
                bias = get(m["router_bias"]) if m["router_bias"] is not None else None
                router = Router(get(m["router"] + ".weight").to(device=device, dtype=torch.float32),
                                None if bias is None else bias.to(device=device, dtype=torch.float32))
                mods["moe"] = MoE(router, [mlp(e) for e in m["experts"]],
                                  mlp(m["shared"]) if m["shared"] is not None else None,
                                  proj(m["shared_gate"]) if m["shared_gate"] is not None else None)
            else:
                mods.update({r: proj(mn[r]) for r in ("gate", "up", "down")})
            if cfg.sandwich_norms:
                mods["pre_ffn_norm"], mods["post_ffn_norm"] = norm(mn["norm"]), norm(mn["post_norm"])
            blocks.append(Block(cfg, i, mods))
        final_norm = norm("model.norm")
        tied = stored("model.embed_tokens.weight") if cfg.tie_word_embeddings else None
        if "lm_head.weight" in ckpt.tensors:
            lm_head = proj("lm_head")
        elif tied is not None:  # the head reads the embedding's blocks (the table stays dense for lookups)
            lm_head = registry.reference_linear(tied, None, "model.embed_tokens.weight", dtype=dtype, device=device)
        elif cfg.tie_word_embeddings and isinstance(embed, Embedding):
            lm_head = Linear(embed.weight.data)
        elif cfg.tie_word_embeddings and hasattr(embed, "as_linear"):
            lm_head = embed.as_linear()  # quantized table shared with the head
        elif cfg.tie_word_embeddings:
            lm_head = Linear(embed.dequantize().to(dtype))
        else:
            raise FormatError(f"{ckpt.source}: tensor 'lm_head.weight' is missing and embeddings are not tied")
        return cls(cfg, embed, blocks, final_norm, lm_head).to(device)
