"""Rotary position embedding: every RoPE scaling type, as Hugging Face transformers computes it.

    default / linear / llama3   fixed inverse frequencies
    yarn                        fixed frequencies (NTK-by-parts ramp between interpolation and extrapolation) and an
                                attention factor multiplying cos and sin (``mscale`` / ``mscale_all_dim``; DeepSeek's
                                extra softmax factor mscale(factor, mscale_all_dim)^2 is the config's attn_scale)
    longrope (su)               Phi-3 / Phi-4-mini: per-frequency factors, ``short_factor`` while the sequence is at most
                                ``original_max_position_embeddings`` tokens long, ``long_factor`` past it; an attention
                                factor sqrt(1 + ln(factor) / ln(original)) on cos and sin
    dynamic                     dynamic NTK: past ``max_position_embeddings`` tokens the base grows with the length

The length-dependent kinds (longrope, dynamic) choose their frequencies by the length ``seq_len`` the sequence
reaches in a forward pass, as transformers does (``dynamic_rope_update``): a prompt pass of T tokens rotates every
position with the frequencies of length T; a decode step at position p with those of length p + 1. So the rotation
of a position depends on the pass that wrote it: decoding a prompt token by token is not the prompt pass when the
prompt crosses the threshold (transformers behaves the same; its Phi-3 ``generate`` re-runs the whole sequence once
when it crosses ``original_max_position_embeddings``, which a KV-cache runtime does not do). Engine tables:
``table(n)`` row p rotated as a decode step at p (verify rows are decode steps), ``table(n, seq_len=T)`` a prompt pass.

``interleave`` (DeepSeek): the rotary features are pairs (x0, x1), (x2, x3), ... each rotated by one frequency; the
result is laid out de-interleaved ([rotated evens, rotated odds], transformers' ``apply_rotary_pos_emb_interleave``),
which is rotate-half RoPE of the de-interleaved input (what the engine's kernels compute after a fixed permutation).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import UnsupportedError
from .rope_scale import yarn_mscale

LENGTH_DEPENDENT = ("longrope", "dynamic")


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(dim: int, theta: float, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = float(s["original_max_position_embeddings"])
    factor = float(s["factor"]) if s.get("factor") is not None else max_pos / orig
    af = s.get("attention_factor")
    if af is None:
        m, mall = s.get("mscale"), s.get("mscale_all_dim")
        af = yarn_mscale(factor, m) / yarn_mscale(factor, mall) if m and mall else yarn_mscale(factor)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))
    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(af)


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old = float(s.get("original_max_position_embeddings", 8192))
    low_wl, high_wl = old / low, old / high
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return torch.where(medium, smoothed, out)


def rope_inv_freq(dim: int, theta: float, scaling: dict | None, max_pos: int) -> torch.Tensor:
    """Inverse frequencies [dim/2] float32 of a sequence within the short length (the only ones for fixed kinds)."""
    return RopeSpec(dim, theta, scaling, max_pos).inv_freq


class RopeSpec:
    """The frequencies of one RoPE configuration (module docstring), as functions of the sequence length."""

    def __init__(self, dim: int, theta: float, scaling: dict | None, max_pos: int):
        self.dim, self.theta, self.max_pos = dim, float(theta), int(max_pos)
        s = dict(scaling or {})
        self.kind = kind = s.get("rope_type", "default")
        self.scaling = s
        self.attention_factor = 1.0
        self.threshold: int | None = None  # length-dependent kinds: longer sequences use other frequencies
        inv = _base_inv_freq(dim, self.theta)
        if kind == "default":
            pass
        elif kind == "linear":
            inv = inv / float(s["factor"])
        elif kind == "llama3":
            inv = _llama3(inv, s)
        elif kind == "yarn":
            inv, self.attention_factor = _yarn(dim, self.theta, s, max_pos)
        elif kind == "longrope":
            orig = int(s["original_max_position_embeddings"])
            factor = float(s["factor"]) if s.get("factor") is not None else max_pos / orig
            af = s.get("attention_factor")
            if af is None:
                af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
            self.attention_factor, self.threshold = float(af), orig
            shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            self.long_inv = 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * self.theta ** shape)
            inv = 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * self.theta ** shape)
        elif kind == "dynamic":
            self.threshold = self.max_pos
        else:
            raise UnsupportedError(f"RoPE scaling type {kind!r} is not supported")
        self.inv_freq = inv.float()

    @property
    def length_dependent(self) -> bool:
        return self.threshold is not None

    def inv_freq_at(self, seq_len: int) -> torch.Tensor:
        """[dim/2] float32: the frequencies of a pass whose sequence reaches ``seq_len`` tokens."""
        return self.inv_freq_rows(torch.tensor([seq_len - 1]))[0]

    def inv_freq_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, dim/2] float32: the frequencies of each position rotated as a decode step there (seq_len = p + 1)."""
        pos = positions.to(torch.int64).cpu().view(-1)
        inv = self.inv_freq[None, :].expand(pos.numel(), -1)
        if self.threshold is None:
            return inv
        long = (pos + 1 > self.threshold)[:, None]
        if self.kind == "longrope":
            return torch.where(long, self.long_inv[None, :], inv)
        # dynamic NTK (transformers' _compute_dynamic_ntk_parameters, in float32 as there)
        d = self.dim
        factor = float(self.scaling["factor"])
        sl = torch.clamp(pos + 1, min=self.max_pos)
        base = self.theta * ((factor * sl / self.max_pos) - (factor - 1)) ** (d / (d - 2))  # [T] float32
        grown = 1.0 / (base[:, None] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)[None, :])
        return torch.where(long, grown.float(), inv)

    def table(self, n: int, seq_len: int | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) fp32 [n, dim/2] for the engine's kernels, times the attention factor: row p as a decode
        step at p, or (``seq_len``) every row as in one pass of that length. Computed in float64 from the float32
        frequencies (as kernels.fused.rope_tables)."""
        pos = torch.arange(n, dtype=torch.int64)
        if seq_len is not None:
            inv = self.inv_freq_at(seq_len)[None, :].expand(n, -1)
        else:
            inv = self.inv_freq_rows(pos)
        f = pos.to(torch.float64)[:, None] * inv.to(torch.float64)
        af = self.attention_factor
        return (f.cos() * af).float().to(device), (f.sin() * af).float().to(device)


class Rotary(nn.Module):
    """cos/sin for positions (transformers' float32 arithmetic, times the attention factor); ``apply`` rotates the
    first ``dim`` features of x (rotate-half, or interleaved pairs)."""

    def __init__(self, dim: int, theta: float, scaling: dict | None, max_pos: int, interleave: bool = False):
        super().__init__()
        self.dim, self.interleave = dim, interleave
        self.spec = RopeSpec(dim, theta, scaling, max_pos)
        self.register_buffer("inv_freq", self.spec.inv_freq.clone(), persistent=False)

    @property
    def length_dependent(self) -> bool:
        return self.spec.length_dependent

    def cos_sin(self, positions: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim] of a pass over ``positions`` reaching ``seq_len`` (default max(positions) + 1)."""
        inv = self.inv_freq
        if self.spec.length_dependent:
            n = int(positions.max()) + 1 if seq_len is None else seq_len
            inv = self.spec.inv_freq_at(n).to(positions.device)
        freqs = positions.float()[:, None] * inv.float()[None, :]  # [T, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, dim]
        af = self.spec.attention_factor
        if af != 1.0:
            return emb.cos() * af, emb.sin() * af
        return emb.cos(), emb.sin()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [B, H, T, hd]; cos/sin [T, dim]
        d = self.dim
        xr, xp = x[..., :d], x[..., d:]
        if self.interleave:
            c, s = cos[..., : d // 2].to(x.dtype), sin[..., : d // 2].to(x.dtype)
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        else:
            x1, x2 = xr[..., : d // 2], xr[..., d // 2:]
            rot = torch.cat([-x2, x1], dim=-1)
            out = xr * cos.to(x.dtype) + rot * sin.to(x.dtype)
        return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


def deinterleave_index(dim: int) -> torch.Tensor:
    """Feature order [0, 2, 4, ..., 1, 3, 5, ...] of ``dim`` interleaved rotary features: rotate-half RoPE of
    x[..., idx] equals the interleaved rotation of x (both laid out de-interleaved)."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])
