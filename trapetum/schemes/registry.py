"""The stored weight schemes by name, and the one place that maps a stored weight to its scheme.

    scheme_of(weight)                      dense tensor -> "dense"; QuantRecord -> its ``scheme`` (FormatError if
                                           this build does not read it)
    part(name, weight, bias)               a Part, the bias taken from the record for quantized weights
    reference_linear / reference_embedding the torch reference modules
    projection(parts, ...)                 one engine projection over parts sharing an input: the scheme's fused
                                           form when every part has the same scheme and it can concatenate
                                           them (and ``fuse``), else a ConcatProjection of one per part
    gate_up(gate, up, act, ...)            the scheme's fused act(gate) * up form, else the separate form
    embedding_table(weight, device)        the engine's fp16 embedding table [V, D]
Adding a scheme is one module with a ``Scheme`` subclass, listed in SCHEMES.
"""
from __future__ import annotations

import torch

from ..errors import FormatError
from ..settings import DEFAULT_KERNELS, KernelOptions
from .aqlm import AQLM
from .base import ConcatProjection, GateUp, Part, Projection, Scheme, SeparateGateUp
from .codebook import CODEBOOK
from .dense import DENSE
from .ggml import GGML
from .record import QuantRecord
from .rtn import RTN

SCHEMES: dict[str, Scheme] = {s.name: s for s in (DENSE, CODEBOOK, AQLM, RTN, GGML)}


def scheme_of(weight) -> Scheme:
    if isinstance(weight, torch.Tensor):
        return DENSE
    if isinstance(weight, QuantRecord):
        s = SCHEMES.get(weight.scheme) if weight.scheme != "dense" else None
        if s is None:
            readable = ", ".join(n for n in SCHEMES if n != "dense")
            raise FormatError(f"unknown quantization scheme {weight.scheme!r} (this build reads: {readable})")
        return s
    raise FormatError(f"expected a tensor or a QuantRecord, got {type(weight).__name__}")


def part(name: str, weight, bias: torch.Tensor | None = None) -> Part:
    """The Part of a stored projection: a quantized record carries its own bias."""
    if isinstance(weight, QuantRecord):
        return Part(name, weight, weight.bias)
    return Part(name, weight, bias)


def reference_linear(weight, bias=None, name: str = "?", *, dtype: torch.dtype | None = torch.float32,
                     device: str | torch.device | None = "cpu") -> torch.nn.Module:
    """The reference module of a stored projection (``dtype``: the compute dtype of its bias / dense weight; None
    keeps the stored dtypes; ``device`` None keeps the stored device)."""
    try:
        return scheme_of(weight).reference(weight, bias, name, dtype, device)
    except FormatError as e:
        msg = str(e)
        raise FormatError(msg if msg.startswith("quantized tensor") else f"quantized tensor {name}: {msg}") from None


def reference_embedding(weight, name: str = "model.embed_tokens.weight", *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> torch.nn.Module:
    """The reference module of an embedding table: dense, or a codebook record (rows gathered)."""
    if isinstance(weight, torch.Tensor):
        from .dense import Embedding
        return Embedding(weight.to(device=device, dtype=dtype))
    if not isinstance(weight, QuantRecord) or weight.scheme != "codebook":
        raise FormatError(f"quantized tensor {name}: embeddings support only the codebook scheme, "
                          f"got {getattr(weight, 'scheme', type(weight).__name__)!r}")
    return CODEBOOK.embedding(weight, name, dtype, device)


def projection(parts: list[Part], device, kopts: KernelOptions = DEFAULT_KERNELS, *, fuse: bool = True,
               precise: bool = False) -> Projection:
    schemes = {scheme_of(p.weight).name for p in parts}
    if len(parts) == 1 or (fuse and len(schemes) == 1 and scheme_of(parts[0].weight).can_concat(parts)):
        return scheme_of(parts[0].weight).projection(parts, device, kopts, precise)
    return ConcatProjection([scheme_of(p.weight).projection([p], device, kopts, precise) for p in parts])


def gate_up(gate: Part, up: Part, act: str, device, kopts: KernelOptions = DEFAULT_KERNELS, *, fuse: bool = True,
            precise: bool = False) -> GateUp:
    if not fuse:
        return SeparateGateUp(act, projection([gate], device, kopts, precise=precise),
                              projection([up], device, kopts, precise=precise))
    s = scheme_of(gate.weight)
    if s is scheme_of(up.weight):
        g = s.gate_up(gate, up, act, device, kopts, precise)
        if g is not None:
            return g
    return SeparateGateUp(act, projection([gate, up], device, kopts, precise=precise))


def dequantize(weight, dtype: torch.dtype = torch.float32, name: str = "?") -> torch.Tensor:
    """The dense [out, in] weight a stored weight stands for (a record checked first: FormatError naming ``name``)."""
    if isinstance(weight, torch.Tensor):
        return weight.to(dtype)
    return reference_linear(weight, None, name, dtype=None, device=None).dequantize(dtype)


def embedding_table(weight, device, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The engine's embedding table [V, D] (a quantized table dequantized: exact for fp16 codebooks)."""
    table = weight if isinstance(weight, torch.Tensor) else dequantize(weight, dtype)
    return table.to(device=device, dtype=dtype)
