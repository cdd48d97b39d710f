"""Host (CPU) GEMV of dense fp32 weights over M rows whose every row is independent of the others.

    dense_gemv_host(x [M, K] fp32, w [N, K] fp32, bias [N] or None, residual [M, N] or None, threads)
        -> y fp32 [M, N],  y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) (+ residual[m, n])

A torch matmul over M rows need not give row m the bits of the one-row product (BLAS picks blockings by shape);
this kernel (host/dense_host.c) computes each output element in one fixed order that depends only on its own x
row and w row, so row m is bitwise the M = 1 result for every M, on every instruction set the library's clones
use, and for every thread count (tests/test_dense_host.py). Each weight row is read once for all M rows, so a
batch of M rows costs about one row's weight traffic: the batch scheduler's decode forward on dense models
(runtime/paged_ops.py). ``reference``: float64.

Built like the codebook host kernels (kernels/host_gemv.py: the system's C compiler at first use, cached under
``~/.cache/trapetum/host/``), as a library of its own; ``available()`` False when it cannot be built.
"""
from __future__ import annotations

import ctypes
import subprocess
import threading
from pathlib import Path

import torch

from . import host_gemv as hg

SOURCE = Path(__file__).resolve().parent / "host" / "dense_host.c"

_lock = threading.Lock()
_lib = None
_err: str | None = None
_tried = False


def _build() -> ctypes.CDLL:
    lib = hg.compile_library("dense_host", (SOURCE,))
    L, P, I = ctypes.c_long, ctypes.c_void_p, ctypes.c_int
    lib.tp_dense_gemv.restype = I
    lib.tp_dense_gemv.argtypes = [P, L, L, L, P, L, L, P, L, P, P, L, I]
    return lib


def _load():
    global _lib, _err, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _err = str(e)
            _tried = True
    return _lib


def available() -> bool:
    return _load() is not None


def error() -> str | None:
    return _err


def _rows(name: str, t: torch.Tensor, cols: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or t.shape[1] != cols or t.stride(1) != 1:
        raise ValueError(f"dense host GEMV: {name} must be fp32 [rows, {cols}] on the CPU with unit column stride, "
                         f"got {t.dtype} {tuple(t.shape)}")


def dense_gemv_host(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None, threads: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x w^T (+ bias) (+ residual), fp32 [M, N] (module docstring)."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"dense host GEMV unavailable: {_err}")
    N, K = w.shape
    _rows("x", x, K)
    _rows("w", w, K)
    M = x.shape[0]
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (N,) or not bias.is_contiguous()):
        raise ValueError(f"dense host GEMV: bias must be fp32 [{N}] contiguous")
    if residual is not None:
        _rows("residual", residual, N)
        if residual.shape[0] != M:
            raise ValueError(f"dense host GEMV: residual must have {M} rows")
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    _rows("out", out, N)
    t = torch.get_num_threads() if threads is None else int(threads)
    rc = lib.tp_dense_gemv(x.data_ptr(), x.stride(0), M, K, w.data_ptr(), w.stride(0), N, out.data_ptr(),
                           out.stride(0), None if bias is None else bias.data_ptr(),
                           None if residual is None else residual.data_ptr(),
                           0 if residual is None else residual.stride(0), max(1, t))
    if rc != 0:
        raise ValueError(f"dense host GEMV: bad arguments (code {rc})")
    return out


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """float64 x w^T (+ bias) (+ residual): [M, N]."""
    y = x.double() @ w.double().T
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y
