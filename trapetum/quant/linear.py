"""Transitional: the quantized modules moved to trapetum/schemes (codebook.py, aqlm.py, rtn.py) and their
construction to ``schemes.registry``; these names remain until the last importers move."""
from __future__ import annotations

import torch

from ..schemes import registry
from ..schemes.codebook import CodebookEmbedding, CodebookLinear  # noqa: F401

__all__ = ["CodebookLinear", "CodebookEmbedding", "build_linear", "build_embedding"]


def build_linear(record, name: str = "?", *, dtype: torch.dtype | None = None, device=None):
    return registry.reference_linear(record, None, name, dtype=dtype, device=device)


def build_embedding(record, name: str = "model.embed_tokens.weight", *, dtype: torch.dtype | None = None, device=None):
    return registry.reference_embedding(record, name, dtype=dtype or torch.float32, device=device)
