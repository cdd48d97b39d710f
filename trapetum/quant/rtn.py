"""RTN (round-to-nearest) integer quantization with groups: the usual 4-bit baseline.

Evaluation only (``scripts/quality.py`` compares it with our codebooks in the same harness).
Per output row and group of ``group`` consecutive input columns, asymmetric min-max:

    scale = (max - min) / (2**bits - 1)       fp16
    zero  = round(-min / scale)               integer in [0, 2**bits - 1]
    q     = clamp(round(w / scale) + zero, 0, 2**bits - 1)
    w_hat = (q - zero) * scale

This is the int4 group-128 RTN of the GPTQ/AWQ papers' baselines. Storage: ``bits`` per weight
plus one fp16 scale and one ``bits``-bit zero point per group, i.e. 4 + 20/128 = 4.156 bits per
weight at int4 g128.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FormatError
from ..schemes.record import QuantRecord

__all__ = ["rtn_quantize", "rtn_dequantize", "RTNLinear", "rtn_bits_per_weight"]


def rtn_bits_per_weight(bits: int = 4, group: int = 128) -> float:
    return bits + (16 + bits) / group


def rtn_quantize(W: torch.Tensor, bits: int = 4, group: int = 128):
    """W [out, in] -> (q uint8 [out, in], scale fp16 [out, G], zero uint8 [out, G]); G = ceil(in/group)."""
    out_f, in_f = W.shape
    G = (in_f + group - 1) // group
    pad = G * group - in_f
    Wf = W.float()
    if pad:  # pad with the row's first column value: it changes no group's min/max range much
        Wf = F.pad(Wf, (0, pad), value=0.0)
    g = Wf.view(out_f, G, group)
    if pad:
        valid = torch.arange(G * group, device=W.device).view(G, group) < in_f
        lo = torch.where(valid, g, torch.full_like(g, float("inf"))).amin(-1)
        hi = torch.where(valid, g, torch.full_like(g, float("-inf"))).amax(-1)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)  # the range always holds 0, as in GPTQ's quantizer
    qmax = (1 << bits) - 1
    scale = ((hi - lo) / qmax).clamp_min(1e-8).to(torch.float16).float().clamp_min(1e-8)
    zero = torch.round(-lo / scale).clamp(0, qmax)
    q = torch.clamp(torch.round(g / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, qmax)
    q = q.view(out_f, G * group)[:, :in_f]
    return q.to(torch.uint8), scale.to(torch.float16), zero.to(torch.uint8)


def rtn_dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out_f, in_f = q.shape
    col_group = torch.arange(in_f, device=q.device) // group
    s = scale.to(dtype)[:, col_group]
    z = zero.to(dtype)[:, col_group]
    return (q.to(dtype) - z) * s


class RTNLinear(nn.Module):
    """Projection with RTN group-quantized weights (reference forward: dequantize, then matmul)."""

    def __init__(self, q, scale, zero, bits: int, group: int, bias=None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.bits, self.group = int(bits), int(group)
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.register_buffer("bias", bias)

    @classmethod
    def from_weight(cls, W: torch.Tensor, bits: int = 4, group: int = 128, bias=None) -> "RTNLinear":
        q, s, z = rtn_quantize(W, bits, group)
        return cls(q, s, z, bits, group, None if bias is None else bias.detach().float())

    @classmethod
    def from_record(cls, record: QuantRecord, name: str = "?") -> "RTNLinear":
        try:
            bits, group = int(record.params["bits"]), int(record.params["group"])
            t = record.tensors
            return cls(t["q"], t["scale"], t["zero"], bits, group, record.bias)
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"quantized tensor {name}: malformed rtn record ({e})") from None

    def to_record(self) -> QuantRecord:
        return QuantRecord("rtn", (self.out_features, self.in_features), {"bits": self.bits, "group": self.group},
                           {"q": self.q, "scale": self.scale, "zero": self.zero}, self.bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return rtn_dequantize(self.q, self.scale, self.zero, self.group, dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), b)

    def bits_per_weight(self) -> float:
        return rtn_bits_per_weight(self.bits, self.group)
