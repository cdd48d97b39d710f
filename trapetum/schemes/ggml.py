"""GGUF's block-quantized weights kept as stored (scheme "ggml"): the CPU's decode of a GGUF file reads them in place.

Record (``QuantRecord("ggml", (out, in), {"type": T}, {"blocks": uint8 [out, in / elems * bytes]})``), T one of
``kernels/ggml_host.GGML_TYPES`` (llama.cpp's legacy blocks of 32 weights, Q4_0, Q4_1, Q5_0, Q8_0, and the
K-quant superblocks of 256, Q4_K, Q6_K), each row the
file's block bytes (formats/gguf.py ``LazyTensors.record``; the rows of q / k un-permuted as the dense tensors are).
The weight is exactly what gguf's dequantization gives, so the numbers are the dense fp32 path's up to the order of
the sums. Only the CPU reference decoder asks for these records (``Decoder.from_checkpoint(..., blocks=True)``):
rows up to ``host_gemv.GEMV_ROWS`` run the host GEMV on the blocks (kernels/ggml_host.py: batch-invariant rows, the
same bits for every thread count), more rows (prefill) multiply blocks of dequantized rows; the GPU engine takes the
dequantized fp16 weight as a dense projection. Other GGUF types (F16, Q5_1, Q5_K, ...) stay dense.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FormatError
from .dequantized import DequantizedScheme
from .record import QuantRecord

__all__ = ["GgmlLinear", "GGML"]


def _host():
    from ..kernels import ggml_host
    return ggml_host


class GgmlLinear(nn.Module):
    """Projection over a GGUF block-quantized weight (module docstring)."""

    def __init__(self, qtype: str, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        gh = _host()
        self.qtype, self.in_features = str(qtype), int(in_features)
        self.out_features = int(blocks.shape[0])
        gh.check_weight(gh.GgmlWeight(self.qtype, blocks, self.in_features))
        self.register_buffer("blocks", blocks)
        self.register_buffer("bias", None if bias is None else bias.contiguous())
        self.host = None  # use_host(): the host GEMV (kernels/ggml_host.HostGgml)
        self.host_threads: int | None = None

    @classmethod
    def from_record(cls, record: QuantRecord, name: str = "?") -> "GgmlLinear":
        try:
            qtype = record.params["type"]
            blocks = record.tensors["blocks"]
            if not isinstance(qtype, str) or not isinstance(blocks, torch.Tensor):
                raise TypeError("type must be a string and blocks a tensor")
            if tuple(record.shape) != (int(blocks.shape[0]), int(record.shape[1])):
                raise ValueError(f"shape {list(record.shape)} does not match {int(blocks.shape[0])} block rows")
            return cls(qtype, blocks, int(record.shape[1]), record.bias)
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"quantized tensor {name}: malformed ggml record ({e})") from None

    def to_record(self) -> QuantRecord:
        return QuantRecord("ggml", (self.out_features, self.in_features), {"type": self.qtype},
                           {"blocks": self.blocks}, self.bias)

    def use_host(self, threads: int | None = None, numerics: str = "fp32") -> bool:
        """Route this projection through the host GEMV on its blocks (fp32 numbers whatever ``numerics``: the
        blocks' exact weights times fp32 x); False where it cannot run (blocks not on the CPU, no kernels)."""
        gh = _host()
        if self.blocks.device.type != "cpu" or not gh.available():
            return False
        self.host = gh.HostGgml(gh.GgmlWeight(self.qtype, self.blocks, self.in_features))
        self.host_threads = threads
        return True

    def host_current(self) -> bool:
        return self.host is not None and self.host.weight.blocks is self.blocks

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        gh = _host()
        h = self.host if self.host_current() else gh.HostGgml(gh.GgmlWeight(self.qtype, self.blocks.cpu(),
                                                                           self.in_features))
        return h.dequantize().to(device=self.blocks.device, dtype=dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.host_current() and x2.device.type == "cpu":
            from ..kernels.host_gemv import GEMV_ROWS
            if x2.shape[0] <= GEMV_ROWS:
                y = self.host(x2.to(torch.float32), self.host_threads)
            else:
                y = self.host.matmul(x2)
            if self.bias is not None:
                y = y + self.bias.to(torch.float32)
            return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), b)


class GgmlScheme(DequantizedScheme):
    name = "ggml"
    module = GgmlLinear

    def check(self, record, name):
        """The record's structure, and its weights finite and within the fp16 range the engine stores them in
        (``ggml_host.fits_fp16``, as the GGUF loader checks)."""
        gh = _host()
        mod = GgmlLinear.from_record(record, name)
        if not gh.fits_fp16(gh.GgmlWeight(mod.qtype, mod.blocks.cpu(), mod.in_features)):
            raise FormatError(f"quantized tensor {name}: {mod.qtype} blocks hold NaN, infinite or out-of-range "
                              "weights (beyond +-65504)")


GGML = GgmlScheme()
