"""fp16 GEMV at batch 1 for the engine's fp16 path: y = W x (+ residual), and the fused gate/up
form y = act(W[:F] x) * (W[F:2F] x) over a row-stacked [gate; up] weight.

CUDA kernel (``cuda/dense_gemv.cu``, through ``trapetum.kernels.cuda_ext``): each weight row read once
in 512-byte warp loads, fp32 accumulation, fixed-order warp reduction (bitwise reproducible),
residual and activation fused in the epilogue. It needs in % 8 == 0 and one activation row; other
cases, CPUs and TRAPETUM_TC=0 use cuBLAS / torch (``torch.addmm`` and ``fused.act_mul``).
"""
from __future__ import annotations

import torch

from . import cuda_ext
from .fused import act_mul

_ACTS = {"silu": 1, "gelu_tanh": 2}


def dense_gemv_reference(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [N] = W x (+ residual)."""
    y = w.double() @ x.reshape(-1).double()
    return y if residual is None else y + residual.reshape(-1).double()


def _kernel_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.is_cuda and w.is_cuda and x.dtype == w.dtype == torch.float16 and w.dim() == 2
            and w.is_contiguous() and w.shape[1] % 8 == 0 and x.numel() == w.shape[1] and cuda_ext.ready(x.device) is not None)


def _check(x, w, out, n):
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"w: expected a 2-D [out, in] tensor, got {tuple(getattr(w, 'shape', ()))}")
    if not isinstance(x, torch.Tensor) or x.numel() != w.shape[1]:
        raise ValueError(f"x: expected {w.shape[1]} elements (one row), got shape {tuple(getattr(x, 'shape', ()))}")
    if out is not None and (out.numel() != n or out.dtype != w.dtype or not out.is_contiguous()):
        raise ValueError(f"out: expected a contiguous {w.dtype} tensor with {n} elements")


def dense_gemv(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] x [K] (+ residual [N]) -> [N] (written into `out` if given)."""
    n = w.shape[0] if isinstance(w, torch.Tensor) and w.dim() == 2 else -1
    _check(x, w, out, n)
    if residual is not None and residual.numel() != n:
        raise ValueError(f"residual: expected {n} elements, got {residual.numel()}")
    y = out if out is not None else torch.empty(n, dtype=w.dtype, device=w.device)
    if _kernel_ok(x, w):
        r = residual.contiguous() if residual is not None else y
        cuda_ext.load().dense_gemv(x.contiguous(), w, r, y, 0, int(residual is not None), 0)
    elif residual is not None:
        torch.addmm(residual.reshape(1, -1), x.reshape(1, -1), w.t(), out=y.view(1, -1))
    else:
        torch.mm(x.reshape(1, -1), w.t(), out=y.view(1, -1))
    return y


def dense_gemv_gate_up(x: torch.Tensor, w: torch.Tensor, f: int, act: str, *,
                       out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """act(W[:f] x) * (W[f:2f] x) -> [f]; `scratch` ([2f]) is used only by the fallback."""
    if act not in _ACTS:
        raise ValueError(f"act: must be one of {sorted(_ACTS)}, got {act!r}")
    _check(x, w, out, f)
    if not (0 < f and 2 * f <= w.shape[0]):
        raise ValueError(f"f: {f} does not fit a [gate; up] weight of {w.shape[0]} rows")
    y = out if out is not None else torch.empty(f, dtype=w.dtype, device=w.device)
    if _kernel_ok(x, w):
        cuda_ext.load().dense_gemv(x.contiguous(), w, y, y, _ACTS[act], 0, f)
        return y
    gu = scratch[: 2 * f] if scratch is not None else torch.empty(2 * f, dtype=w.dtype, device=w.device)
    torch.mm(x.reshape(1, -1), w[: 2 * f].t(), out=gu.view(1, -1))
    return act_mul(gu[:f], gu[f:], act, out=y)
