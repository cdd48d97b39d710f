"""Reference building blocks of the decoder: RMSNorm, rotary embedding, activations.

Projections and embedding tables are the stored weight schemes' reference modules (``trapetum.schemes``: the
dense ``Linear`` / ``Embedding``, codebook, AQLM, RTN); they share one interface (``in_features``,
``out_features``, ``bias``, ``forward``, ``dequantize``), so model code never asks which one it holds.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedError
from .config import ModelConfig


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


def rope_inv_freq(dim: int, theta: float, scaling: dict | None, max_pos: int) -> torch.Tensor:
    """Inverse frequencies [dim/2] (float32) for plain, linear or llama3-scaled RoPE (as in HF)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old = float(scaling.get("original_max_position_embeddings", 8192))
        low_wl, high_wl = old / low, old / high
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, out)
    raise UnsupportedError(f"RoPE scaling type {kind!r} is not supported")


class Rotary(nn.Module):
    """cos/sin tables for positions; apply() rotates the first ``dim`` features (rotate-half layout)."""

    def __init__(self, dim: int, theta: float, scaling: dict | None, max_pos: int):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", rope_inv_freq(dim, theta, scaling, max_pos), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, dim]
        return emb.cos(), emb.sin()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [B, H, T, hd]; cos/sin [T, dim]
        d = self.dim
        xr, xp = x[..., :d], x[..., d:]
        x1, x2 = xr[..., : d // 2], xr[..., d // 2:]
        rot = torch.cat([-x2, x1], dim=-1)
        out = xr * cos.to(x.dtype) + rot * sin.to(x.dtype)
        return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


def activation(name: str):
    if name == "silu":
        return F.silu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise UnsupportedError(f"activation {name!r} is not supported")


def rotaries(cfg: ModelConfig) -> tuple[Rotary, Rotary | None]:
    """Global rotary and, for Gemma-3, the local (sliding-layer) rotary with its own base."""
    g = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    loc = (Rotary(cfg.rotary_dim, cfg.rope_local_theta, None, cfg.max_position_embeddings)
           if cfg.rope_local_theta else None)
    return g, loc
