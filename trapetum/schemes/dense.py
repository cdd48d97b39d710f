"""Dense weights (fp16 / bf16 / fp32 tensors of the source): the reference ``Linear`` and the engine's fp16 GEMV.

Stored: a tensor [out, in] and an optional bias [out]. Engine: fp16 rows, concatenated for parts that share an
input; ``gemv`` is the batch-invariant fp16 GEMV (kernels/dense_gemv.py: each weight row read once for all M
activation rows, each row's bits those of a one-row call); prefill multiplies the fp16 weight on tensor cores.
For the precise prefill a source that is not fp16 (fp32 or bf16 checkpoints, GGUF tensors dequantized to fp32)
keeps ``lo`` = fp16((W - fp16(W)) * 2^12).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.dense_gemv import dense_gemv, dense_gemv_gate_up
from ..settings import DEFAULT_KERNELS, KernelOptions
from .base import GateUp, Part, Projection, Scheme, cat_bias, residual16


class Linear(nn.Module):
    """Dense projection y = x W^T + b with W [out_features, in_features] (the reference form)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.weight.data if dtype is None else self.weight.data.to(dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, dtype={self.weight.dtype}"


class Embedding(nn.Module):
    """A dense embedding table [vocab, hidden] (the reference form)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.weight.data if dtype is None else self.weight.data.to(dtype)


class DenseProjection(Projection):
    kind = "fp16"

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, kopts: KernelOptions = DEFAULT_KERNELS,
                 lo: torch.Tensor | None = None, bias_lo: torch.Tensor | None = None):
        self.w = w.to(torch.float16).contiguous()  # [N, K]
        self.out_features, self.in_features = self.w.shape
        self.bias, self.lo, self.bias_lo = bias, lo, bias_lo
        self.kopts = kopts

    def gemv(self, x, out, residual=None):
        dense_gemv(x, self.w, residual, out=out, kopts=self.kopts)
        return self._add_bias(out)

    def weight16(self):
        return self.w

    def nbytes(self):
        return self.w.numel() * 2 + (0 if self.bias is None else self.bias.numel() * 2)


class DenseGateUp(GateUp):
    """act(W[:F] x) * (W[F:2F] x) over the row-stacked [gate; up] fp16 weight, the activation in the GEMV's
    epilogue (no biases)."""
    kind = "fp16"

    def __init__(self, joint: DenseProjection, act: str):
        self.joint, self.act = joint, act
        self.f = joint.out_features // 2

    def gemv(self, x, out):
        return dense_gemv_gate_up(x, self.joint.w, self.f, self.act, out=out, kopts=self.joint.kopts)

    def halves(self, x, linear):
        y = self.joint.matmul(x, linear)
        return y[:, : self.f], y[:, self.f:]

    def nbytes(self):
        return self.joint.nbytes()


class DenseScheme(Scheme):
    name = "dense"

    def reference(self, weight, bias, name, dtype, device):
        kw = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        return Linear(weight.to(**kw), None if bias is None else bias.to(**kw))

    def projection(self, parts: list[Part], device, kopts=DEFAULT_KERNELS, precise=False):
        exact = [p.weight.to(device) for p in parts]
        w16 = torch.cat([e.to(torch.float16) for e in exact]) if len(exact) > 1 else exact[0].to(torch.float16)
        bias, bias_exact = cat_bias(parts, device)
        lo = bias_lo = None
        if precise:
            lo = residual16(torch.cat(exact) if len(exact) > 1 else exact[0], w16)
            bias_lo = residual16(bias_exact, bias)
        return DenseProjection(w16, bias, kopts, lo, bias_lo)

    def gate_up(self, gate, up, act, device, kopts=DEFAULT_KERNELS, precise=False):
        if gate.bias is not None or up.bias is not None:
            return None  # the registry's separate form adds the biases
        return DenseGateUp(self.projection([gate, up], device, kopts, precise), act)

    def dequantize(self, weight, dtype=torch.float32):
        return weight.to(dtype)


DENSE = DenseScheme()
