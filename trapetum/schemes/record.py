"""A quantized projection as stored: scheme name, logical shape, parameters and raw tensors.

Loaders (``.cbk``) put a ``QuantRecord`` where a checkpoint would hold a dense weight;
``trapetum.schemes.registry`` turns it into the module (reference) or projection (engine) of its scheme.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class QuantRecord:
    scheme: str  # "codebook" (per-row scalar codebook) | "aqlm" (additive) | ...
    shape: tuple[int, int]  # logical (out_features, in_features)
    params: dict[str, Any] = field(default_factory=dict)  # e.g. {"bits": 4}
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. {"codes": ..., "codebook": ...}
    bias: torch.Tensor | None = None
