"""Dense GEMV of the engine's fp16 path, 1..16 activation rows: y = x W^T (+ residual), and the fused gate/up form
y = act(x W[:F]^T) * (x W[F:2F]^T) over a row-stacked [gate; up] weight. x [K] or [M, K]; W [N, K].

Backends (``backend=None`` picks the first that applies):
  "cuda"   the CUDA kernel (``cuda/dense_gemv.cu``, through ``cuda_ext``): fp16, in % 8 == 0, M <= 16, kernel
           options' ``cuda`` on. Each weight row read once for all M rows in 512-byte warp loads, fp32
           accumulation, fixed-order warp reduction, residual and activation fused in the epilogue.
  "triton" a Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1): one program per (block of weight rows,
           activation row), tile sizes from K and the device kind only; any float dtype (fp32 accumulation).
  "torch"  one row at a time (``torch.mm`` / ``addmm`` in the weight's dtype, ``fused.act_mul``).

Contracts: every backend is deterministic, and batch-invariant under the same backend and options: row m of an
M-row call has exactly the bits of an M = 1 call on row m (the CUDA kernel's comment says why for it; the Triton
kernel and the torch path compute each row on its own, with shapes that do not depend on M). cuBLAS is not used:
it is not batch-invariant.
"""
from __future__ import annotations

import torch

from ..settings import DEFAULT_KERNELS, KernelOptions
from . import cuda_ext
from .codebook_gemv import ACTS as _ACTS
from .fused import act_mul
from .triton_util import HAVE_TRITON, ROW_POINTERS, triton_ok

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .codebook_gemv import gated_act, triton_block_k

    @triton.jit(do_not_specialize=ROW_POINTERS)
    def _dense_kernel(x_ptr, w_ptr, res_ptr, y_ptr, N, K, F, stride_xm, stride_w, stride_rm, stride_ym,
                      HAS_RES: tl.constexpr, EPI: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # One program: outputs [BLOCK_N * pid_n, +BLOCK_N) x activation row m = program_id(1).
        # EPI 0: y[m, o] = W[o] . x[m] (+ res[m, o]); EPI 1 / 2: y[m, o] = act(W[o] . x[m]) * (W[F + o] . x[m]).
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        ro = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        omask = ro < (N if EPI == 0 else F)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            wmask = omask[:, None] & kmask[None, :]
            xv = tl.load(x_ptr + m * stride_xm + rk, mask=kmask, other=0.0).to(tl.float32)
            wg = tl.load(w_ptr + ro[:, None] * stride_w + rk[None, :], mask=wmask, other=0.0).to(tl.float32)
            acc += tl.sum(wg * xv[None, :], axis=1)
            if EPI != 0:
                wu = tl.load(w_ptr + (F + ro)[:, None] * stride_w + rk[None, :], mask=wmask, other=0.0).to(tl.float32)
                acc_u += tl.sum(wu * xv[None, :], axis=1)
        if EPI == 0:
            if HAS_RES:
                acc += tl.load(res_ptr + m * stride_rm + ro, mask=omask, other=0.0).to(tl.float32)
            tl.store(y_ptr + m * stride_ym + ro, acc.to(y_ptr.dtype.element_ty), mask=omask)
        else:
            h = gated_act(acc, acc_u, EPI)
            tl.store(y_ptr + m * stride_ym + ro, h.to(y_ptr.dtype.element_ty), mask=omask)


def dense_gemv_reference(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """float64 W x (+ residual): [N] for x [K], [M, N] for x [M, K]."""
    y = x.double() @ w.double().T
    return y if residual is None else y + residual.reshape(y.shape).double()


def dense_gemv_gate_up_reference(x: torch.Tensor, w: torch.Tensor, f: int, act: str) -> torch.Tensor:
    """float64 act(x W[:f]^T) * (x W[f:2f]^T): [f] or [M, f]."""
    g = x.double() @ w[:f].double().T
    u = x.double() @ w[f:2 * f].double().T
    a = g * torch.sigmoid(g) if act == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
    return a * u


def _rows(x, w, out, n, name):
    """Checks; returns (x2 [M, K] contiguous, y [M, n], squeeze)."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] < 1:
        raise ValueError(f"w: expected a 2-D [out, in] tensor, got {tuple(getattr(w, 'shape', ()))}")
    K = w.shape[1]
    if not isinstance(x, torch.Tensor) or x.dim() not in (1, 2) or x.shape[-1] != K or x.numel() == 0:
        raise ValueError(f"x: expected [{K}] or [M, {K}], got shape {tuple(getattr(x, 'shape', ()))}")
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"x: expected {w.dtype} on {w.device} like w, got {x.dtype} on {x.device}")
    squeeze = x.dim() == 1
    x2 = (x.reshape(1, K) if squeeze else x).contiguous()
    M = x2.shape[0]
    if out is None:
        y = torch.empty(M, n, dtype=w.dtype, device=w.device)
    elif not isinstance(out, torch.Tensor) or out.numel() != M * n or out.dtype != w.dtype or not out.is_contiguous() \
            or out.device != w.device:
        raise ValueError(f"out: expected a contiguous {w.dtype} tensor with {M}x{n} elements on {w.device}")
    else:
        y = out.view(M, n)
    return x2, y, squeeze


def _backend(backend, x2, w, kopts) -> str:
    if backend is None:
        if (x2.is_cuda and x2.dtype == torch.float16 and w.is_contiguous() and w.shape[1] % 8 == 0
                and x2.shape[0] <= 16 and cuda_ext.ready(x2.device, kopts) is not None):
            return "cuda"
        return "triton" if triton_ok(x2.device) else "torch"
    if backend not in ("cuda", "triton", "torch"):
        raise ValueError(f"backend: must be 'cuda', 'triton', 'torch' or None, got {backend!r}")
    if backend == "cuda" and not (x2.is_cuda and x2.dtype == torch.float16 and w.is_contiguous()
                                  and w.shape[1] % 8 == 0 and x2.shape[0] <= 16
                                  and cuda_ext.ready(x2.device, kopts) is not None):
        raise ValueError(f"backend: 'cuda' needs fp16 on a CUDA device, in % 8 == 0, M <= 16 and the kernels "
                         f"({cuda_ext.error() or 'kernel options cuda on, sm_80+'})")
    if backend == "triton" and not triton_ok(x2.device):
        raise ValueError("backend: 'triton' needs a CUDA device or TRITON_INTERPRET=1")
    return backend


def _triton(x2, w, res, y, epi, f):
    M, K = x2.shape
    if w.stride(1) != 1:
        w = w.contiguous()
    block_n = 32 if x2.device.type == "cpu" else 16
    n_out = w.shape[0] if epi == 0 else f
    r = res if res is not None else y
    _dense_kernel[(triton.cdiv(n_out, block_n), M)](
        x2, w, r, y, w.shape[0], K, f, x2.stride(0), w.stride(0), r.stride(0), y.stride(0),
        HAS_RES=res is not None, EPI=epi, BLOCK_N=block_n, BLOCK_K=triton_block_k(K, x2.device), num_warps=4)


def dense_gemv(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None, backend: str | None = None,
               kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """x [K] or [M, K] @ W [N, K]^T (+ residual shaped like y) -> [N] or [M, N] (written into `out` if given)."""
    n = w.shape[0] if isinstance(w, torch.Tensor) and w.dim() == 2 else -1
    x2, y, squeeze = _rows(x, w, out, n, "out")
    M = x2.shape[0]
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.numel() != M * n or residual.device != w.device:
            raise ValueError(f"residual: expected {M}x{n} elements on {w.device}, got "
                             f"{tuple(getattr(residual, 'shape', ()))}")
        residual = residual.reshape(M, n).to(w.dtype).contiguous()
    be = _backend(backend, x2, w, kopts)
    if be == "cuda":
        r = residual if residual is not None else y
        cuda_ext.load().dense_gemv(x2, w, r, y, 0, int(residual is not None), 0, int(kopts.pdl_cuda))
    elif be == "triton":
        _triton(x2, w, residual, y, 0, 0)
    else:
        for m in range(M):
            if residual is not None:
                torch.addmm(residual[m:m + 1], x2[m:m + 1], w.t(), out=y[m:m + 1])
            else:
                torch.mm(x2[m:m + 1], w.t(), out=y[m:m + 1])
    return y.view(n) if squeeze else y


def dense_gemv_gate_up(x: torch.Tensor, w: torch.Tensor, f: int, act: str, *,
                       out: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
                       backend: str | None = None, kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """act(x W[:f]^T) * (x W[f:2f]^T) -> [f] or [M, f]; `scratch` ([2f], w's dtype) is used by the torch path only."""
    if act not in _ACTS:
        raise ValueError(f"act: must be one of {sorted(_ACTS)}, got {act!r}")
    x2, y, squeeze = _rows(x, w, out, f, "out")
    if not (isinstance(f, int) and 0 < f and 2 * f <= w.shape[0]):
        raise ValueError(f"f: {f} does not fit a [gate; up] weight of {w.shape[0]} rows")
    be = _backend(backend, x2, w, kopts)
    if be == "cuda":
        cuda_ext.load().dense_gemv(x2, w, y, y, _ACTS[act], 0, f, int(kopts.pdl_cuda))
    elif be == "triton":
        _triton(x2, w, None, y, _ACTS[act], f)
    else:
        if scratch is not None and (scratch.numel() < 2 * f or scratch.dtype != w.dtype):
            raise ValueError(f"scratch: expected at least {2 * f} elements of {w.dtype}")
        gu = scratch.reshape(-1)[: 2 * f] if scratch is not None else torch.empty(2 * f, dtype=w.dtype, device=w.device)
        for m in range(x2.shape[0]):
            torch.mm(x2[m:m + 1], w[: 2 * f].t(), out=gu.view(1, -1))
            act_mul(gu[:f], gu[f:], act, out=y[m])
    return y.view(f) if squeeze else y
