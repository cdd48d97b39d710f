"""Shared setup for tests/test_kernels_*.py (imported by them; not a pytest conftest).

On a machine without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1) at small
shapes; with CUDA the same tests run at full size. Triton reads TRITON_INTERPRET when a kernel is
decorated: tests/conftest.py sets it before any test module imports a kernel.
"""
from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py should have switched the interpreter on"

import trapetum.kernels.attention as attention  # noqa: E402
import trapetum.kernels.codebook_gemv as codebook_gemv  # noqa: E402
import trapetum.kernels.fused as fused  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
requires_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in float64; NaN never passes."""
    y = y.double().cpu()
    ref = ref.double().cpu()
    if not torch.isfinite(y).all():
        return float("inf")
    d = (y - ref).norm().item()
    n = ref.norm().item()
    return d / n if n > 0 else d


# Relative-norm tolerances per output dtype (fp16 rounding of the output alone is ~2.9e-4).
TOL = {torch.float16: 1e-3, torch.float32: 1e-5}
