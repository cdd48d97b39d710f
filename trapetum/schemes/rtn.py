"""RTN (round-to-nearest) integer weights with groups (scheme "rtn"): the usual 4-bit baseline, evaluation only.

Stored (``QuantRecord("rtn", (out, in), {"bits": b, "group": g}, {"q", "scale", "zero"})``): per output row and
group of ``g`` consecutive input columns, ``w_hat = (q - zero) * scale`` (q uint8 [out, in], scale fp16 [out, G],
zero uint8 [out, G], G = ceil(in / g)). The quantizer is ``trapetum.quant.rtn``. Engine: the dequantized fp16
weight as a dense projection.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FormatError
from .dequantized import DequantizedScheme
from .record import QuantRecord

__all__ = ["RTNLinear", "rtn_dequantize", "rtn_bits_per_weight", "RTN"]


def rtn_bits_per_weight(bits: int = 4, group: int = 128) -> float:
    return bits + (16 + bits) / group


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


class RtnScheme(DequantizedScheme):
    name = "rtn"
    module = RTNLinear


RTN = RtnScheme()
