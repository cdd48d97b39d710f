"""What a stored weight scheme is, and the two forms a stored projection takes.

A checkpoint holds, for every projection, a *stored weight*: a dense tensor, or a ``QuantRecord`` (scheme
name, logical shape, parameters, raw tensors), plus an optional bias. One module per scheme (``dense``,
``codebook``, ``aqlm``, ``rtn``) owns everything that scheme means; ``registry`` maps a stored weight to its
scheme. A ``Scheme`` gives:

    check(record, name)                       validate a record's tensors against its shape and parameters
                                              (FormatError naming the tensor; nothing large is allocated)
    reference(weight, bias, name, dtype, device) -> nn.Module
                                              the torch reference: ``forward(x[..., in])``, ``dequantize()``,
                                              ``in_features``, ``out_features``, ``bias``
    projection(parts, device, kopts, precise) -> Projection
                                              the engine form of one or several parts that read the same input
                                              (q/k/v, gate/up), concatenated along the output rows, in the
                                              kernel's layout, on ``device``
    gate_up(gate, up, act, device, kopts, precise) -> GateUp | None
                                              a fused act(gate(x)) * up(x) form, if the scheme has one

The engine form (``Projection``):

    gemv(x [M, K], out [M, N], residual=None) -> out    decode / verify rows, M = 1..rows_per_call, fp16.
                                              Batch-invariant: row m of the result is bitwise what a call with
                                              row m alone gives
    rows_per_call                             the most rows one gemv takes (16; the tiled 4/8-bit codebook
                                              projections more: one launch over groups of 16); batched decode
                                              splits larger batches into calls of that many
    reads_fragments(m) -> bits | None         the fragment order (kernels/codebook_layout.py) in which an m-row
                                              gemv may take x as ``Fragments`` (its producer writes that order and
                                              the GEMV skips its copy); None: row-major only
    weight16() -> [N, K] fp16                 the weights the GEMV multiplies by (dequantized on demand)
    matmul(x [T, K], linear=fp16_linear)      prefill: ``linear(x, weight16(), bias, lo, bias_lo)``
    bias, lo, bias_lo                         fp16 or None; lo / bias_lo: fp16((exact - fp16) * 2^12) residuals of
                                              sources that are not fp16 numbers, kept only for the precise prefill
    nbytes()                                  bytes the engine holds for it
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels.fused import act_mul
from ..settings import DEFAULT_KERNELS, KernelOptions
from .record import QuantRecord

LO_SCALE = 4096.0  # 2^12: a residual below half an fp16 ulp of the weight, scaled back into fp16's normal range


@dataclass
class Part:
    """One stored projection handed to a scheme: its canonical name, weight (tensor or record) and bias."""
    name: str
    weight: torch.Tensor | QuantRecord
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])


def fp16_linear(x, w, bias=None, lo=None, bias_lo=None):
    """The default prefill GEMM: fp16 tensor cores, fp16 output (``lo`` residuals are not used)."""
    return F.linear(x, w, bias)


def residual16(exact: torch.Tensor | None, hi: torch.Tensor | None) -> torch.Tensor | None:
    """fp16((exact - hi) * 2^12), or None when ``exact`` equals ``hi`` in fp16 (nothing to add)."""
    if exact is None or hi is None or exact.dtype == torch.float16:
        return None
    d = exact.to(device=hi.device, dtype=torch.float32) - hi.float()
    if not bool(d.any()):
        return None
    return (d * LO_SCALE).to(torch.float16)


def cat_bias(parts: list[Part], device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the parts' biases concatenated in fp16 on ``device``, their exact source concatenated) or (None, None);
    parts without a bias contribute zeros."""
    if all(p.bias is None for p in parts):
        return None, None
    exact = torch.cat([p.bias.to(device) if p.bias is not None else torch.zeros(p.out_features, device=device)
                       for p in parts])
    return exact.to(torch.float16), exact


class Projection:
    """Base of the engine forms (module docstring)."""
    kind = "?"
    in_features: int
    out_features: int
    bias: torch.Tensor | None = None
    lo: torch.Tensor | None = None
    bias_lo: torch.Tensor | None = None
    rows_per_call = 16

    def gemv(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def reads_fragments(self, m: int) -> int | None:
        return None

    def weight16(self) -> torch.Tensor:
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, linear: Callable = fp16_linear) -> torch.Tensor:
        return linear(x, self.weight16(), self.bias, self.lo, self.bias_lo)

    def _add_bias(self, out: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            out.add_(self.bias)
        return out


class ConcatProjection(Projection):
    """Projections that read one input, run one after another into their columns of ``out`` (no fusion:
    ``Options.fuse`` off, or parts whose schemes cannot be concatenated)."""
    kind = "concat"

    def __init__(self, parts: list[Projection]):
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.rows_per_call = min(p.rows_per_call for p in parts)
        self.bounds = [0]
        for p in parts:
            self.bounds.append(self.bounds[-1] + p.out_features)

    def gemv(self, x, out, residual=None):
        if residual is not None:
            raise ValueError("residual: a concatenation of projections takes none")
        for p, lo, hi in zip(self.parts, self.bounds, self.bounds[1:]):
            if out.shape[0] == 1:  # one row: the part's slice of out is contiguous
                p.gemv(x, out[:, lo:hi])
            else:
                out[:, lo:hi].copy_(p.gemv(x, torch.empty(out.shape[0], hi - lo, dtype=out.dtype, device=out.device)))
        return out

    def matmul(self, x, linear=fp16_linear):
        return torch.cat([p.matmul(x, linear) for p in self.parts], -1)

    def weight16(self):
        return torch.cat([p.weight16() for p in self.parts])

    def nbytes(self):
        return sum(p.nbytes() for p in self.parts)


def act_mul_fp16(g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
    return act_mul(g.contiguous(), u.contiguous(), act)


class GateUp:
    """act(gate(x)) * up(x) in the engine: ``gemv(x [M, K], out [M, F])`` for decode / verify rows (batch-invariant),
    ``matmul(x [T, K], linear, act_mul)`` for prefill (``act_mul`` of the two fp16 or fp32 halves).
    ``reads_fragments(m)`` as Projection's; ``writes_fragments``: gemv(x, None, out_frag_bits=b) returns its rows as
    ``Fragments`` in the fragment order of a b-bit consumer (its epilogue writes them there)."""
    kind = "?"
    f: int
    act: str
    writes_fragments = False
    rows_per_call = 16  # as Projection's

    def gemv(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reads_fragments(self, m: int) -> int | None:
        return None

    def halves(self, x: torch.Tensor, linear: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate(x), up(x)) [T, F] each, through ``linear``."""
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, linear: Callable = fp16_linear,
               act_mul: Callable = act_mul_fp16) -> torch.Tensor:
        g, u = self.halves(x, linear)
        return act_mul(g, u, self.act)

    def nbytes(self) -> int:
        raise NotImplementedError


class SeparateGateUp(GateUp):
    """Two projections (or one projection over [gate; up]) and the activation kernel: the unfused form."""
    kind = "separate"

    def __init__(self, act: str, gate: Projection, up: Projection | None = None):
        """``up`` None: ``gate`` is one projection over the stacked [gate; up] rows."""
        self.act, self.gate, self.up = act, gate, up
        self.f = gate.out_features if up is not None else gate.out_features // 2
        self.rows_per_call = min(gate.rows_per_call, 16 if up is None else up.rows_per_call)

    def gemv(self, x, out):
        M, f = x.shape[0], self.f
        if self.up is None:
            gu = self.gate.gemv(x, torch.empty(M, 2 * f, dtype=out.dtype, device=out.device))
            g, u = gu[:, :f], gu[:, f:]
        else:
            g = self.gate.gemv(x, torch.empty(M, f, dtype=out.dtype, device=out.device))
            u = self.up.gemv(x, torch.empty(M, f, dtype=out.dtype, device=out.device))
        return act_mul(g.contiguous(), u.contiguous(), self.act, out=out)

    def halves(self, x, linear):
        if self.up is None:
            y = self.gate.matmul(x, linear)
            return y[:, : self.f], y[:, self.f:]
        return self.gate.matmul(x, linear), self.up.matmul(x, linear)

    def nbytes(self):
        return self.gate.nbytes() + (self.up.nbytes() if self.up is not None else 0)


class Scheme:
    """A stored weight scheme (module docstring). Subclasses override what applies."""
    name = "?"

    def check(self, record: QuantRecord, name: str) -> None:
        pass

    def reference(self, weight, bias, name: str, dtype: torch.dtype, device) -> torch.nn.Module:
        raise NotImplementedError

    def can_concat(self, parts: list[Part]) -> bool:
        return True

    def projection(self, parts: list[Part], device, kopts: KernelOptions = DEFAULT_KERNELS,
                   precise: bool = False) -> Projection:
        raise NotImplementedError

    def gate_up(self, gate: Part, up: Part, act: str, device, kopts: KernelOptions = DEFAULT_KERNELS,
                precise: bool = False) -> GateUp | None:
        return None

    def dequantize(self, weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError
