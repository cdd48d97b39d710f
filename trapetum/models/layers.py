"""Reference building blocks of the decoder: RMSNorm, rotary embedding (models/rope.py), activations.

Projections and embedding tables are the stored weight schemes' reference modules (``trapetum.schemes``: the
dense ``Linear`` / ``Embedding``, codebook, AQLM, RTN); they share one interface (``in_features``,
``out_features``, ``bias``, ``forward``, ``dequantize``), so model code never asks which one it holds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedError
from .config import ModelConfig
from .rope import Rotary, rope_inv_freq  # noqa: F401  (re-exported: the engine and tests import them from here)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; the weight is applied as (offset + w) (Gemma: offset 1)."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (self.weight.float() + self.offset)).to(x.dtype)


def activation(name: str):
    if name == "silu":
        return F.silu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise UnsupportedError(f"activation {name!r} is not supported")


def rotaries(cfg: ModelConfig) -> tuple[Rotary, Rotary | None]:
    """Global rotary and, for Gemma-3, the local (sliding-layer) rotary with its own base (models/rope.py)."""
    g = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, cfg.rope_interleave)
    loc = (Rotary(cfg.rotary_dim, cfg.rope_local_theta, None, cfg.max_position_embeddings, cfg.rope_interleave)
           if cfg.rope_local_theta else None)
    return g, loc
