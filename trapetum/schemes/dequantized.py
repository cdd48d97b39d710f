"""Schemes that the GPU engine runs as their dequantized weight (a dense projection): rtn.py, ggml.py. Each names
its reference module class (``module``: ``from_record(record, name)``, ``dequantize(dtype)``, a ``bias`` buffer)."""
from __future__ import annotations

import torch

from ..settings import DEFAULT_KERNELS
from .base import Part, Scheme
from .dense import DENSE


class DequantizedScheme(Scheme):
    module: type = None  # the reference module class

    def check(self, record, name):
        self.module.from_record(record, name)

    def reference(self, weight, bias, name, dtype, device):
        mod = self.module.from_record(weight, name)
        if mod.bias is None and bias is not None:  # a bias stored beside the record (a GGUF's)
            mod.bias = bias.contiguous()
        if mod.bias is not None and dtype is not None:
            mod.bias = mod.bias.to(dtype)
        return mod.to(device) if device is not None else mod

    def projection(self, parts: list[Part], device, kopts=DEFAULT_KERNELS, precise=False):
        dense = [Part(p.name, self.dequantize(p.weight, torch.float32).to(device), p.bias) for p in parts]
        return DENSE.projection(dense, device, kopts, precise)

    def gate_up(self, gate, up, act, device, kopts=DEFAULT_KERNELS, precise=False):
        dense = [Part(p.name, self.dequantize(p.weight, torch.float32).to(device), p.bias) for p in (gate, up)]
        return DENSE.gate_up(dense[0], dense[1], act, device, kopts, precise)

    def dequantize(self, weight, dtype=torch.float32):
        return self.module.from_record(weight).dequantize(dtype)
