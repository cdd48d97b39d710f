"""Programmatic dependent launch (PDL) for the Triton kernels of the decode step.

The CUDA kernels (``cuda/pdl.cuh``) are launched so that they may start while the previous kernel of the
stream still runs, and they wait (``griddepcontrol.wait``) before touching its outputs. A kernel can
only start early if the kernel before it allows it (``griddepcontrol.launch_dependents``). The small
Triton kernels between the GEMVs (RMSNorm, RoPE + KV append, attention) therefore take a ``PDL``
constexpr: when set they allow their dependents at once and wait for their own inputs before any load,
and they are launched with ``launch_pdl=True`` themselves. Results are unchanged: every kernel still
reads its inputs only after the kernels that wrote them have completed.

On only where it can work and is asked for: a CUDA device of compute capability 9.0+, a Triton with
``launch_pdl`` and ``gdc_wait``, not the interpreter, and kernel options whose ``pdl`` is "all" or "triton"
(``KernelOptions.pdl_triton``; "cuda" keeps it for the CUDA kernels only, to bisect a difference). The CUDA
launchers take the same choice as an argument (``KernelOptions.pdl_cuda``, cuda/pdl.cuh).
"""
from __future__ import annotations

import functools

import torch

from ..settings import DEFAULT_KERNELS, KernelOptions, triton_interpreted

try:
    import triton  # noqa: F401
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except Exception:  # pragma: no cover - older Triton or none: PDL stays off
    tl = None
    gdc_launch_dependents = gdc_wait = None


@functools.lru_cache(maxsize=None)
def _triton_supports_pdl() -> bool:
    if gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        return "launch_pdl" in CUDAOptions.__dataclass_fields__
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device, kopts: KernelOptions = DEFAULT_KERNELS) -> bool:
    """True if Triton kernels on `device` should use PDL (see the module docstring)."""
    if device.type != "cuda" or not kopts.pdl_triton:
        return False
    if triton_interpreted() or not _triton_supports_pdl():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(device: torch.device, kopts: KernelOptions = DEFAULT_KERNELS) -> dict:
    """Keyword arguments for a Triton launch of a kernel with a ``PDL: tl.constexpr`` parameter."""
    return {"PDL": True, "launch_pdl": True} if enabled(device, kopts) else {"PDL": False}


if tl is not None and gdc_wait is not None:

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """First statement of a PDL-aware kernel: let the next kernel start, then wait for the inputs."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()

else:  # pragma: no cover
    if tl is not None:

        @triton.jit
        def pdl_enter(PDL: tl.constexpr):
            pass
