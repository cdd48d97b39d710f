"""Whether Triton kernels can run on a device: the one check every kernel wrapper uses.

Triton is optional on CPU-only installs. On a CPU tensor Triton runs only under its interpreter
(TRITON_INTERPRET=1, read by Triton itself when a kernel is decorated; ``settings.triton_interpreted``).
"""
from __future__ import annotations

import torch

from ..settings import triton_interpreted

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except Exception:  # pragma: no cover - exercised only without triton
    HAVE_TRITON = False


# Pointer arguments of the multi-row GEMVs that point at a row of an activation, residual or output: their
# alignment differs between the rows of an M-row call and a one-row call (row r starts r * K elements in), and
# Triton specializes a kernel on a pointer's 16-byte alignment, which can change the loads' vector width, the
# layout and with it a reduction's order. Not specialized, every row runs the same compiled kernel.
ROW_POINTERS = ("x_ptr", "res_ptr", "y_ptr")


def triton_ok(device: torch.device) -> bool:
    """True if a Triton kernel can run on `device` (CUDA, or the CPU under the interpreter)."""
    if not HAVE_TRITON:
        return False
    return device.type == "cuda" or triton_interpreted()
