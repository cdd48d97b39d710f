"""The column sweep inside one GPTQ block (``quant/gptq.gptq_assign``): every row of a block quantized column by
column to its own scalar codebook, each column's error fed forward to the block's later columns.

Layouts (all float64 except the codes; row-major, any row stride for W):
  W     [R, B]   the block's columns of the (already lazily updated) weights, read only
  U     [B, B]   the block's diagonal part of the upper Cholesky factor of H^-1 (contiguous)
  book  [R, K]   ascending centroids per row;  mid [R, K-1] their midpoints (mid[:, k] = (c_k + c_{k+1}) / 2)
  codes [R, B]   int64 out: for column i, the number of midpoints below w_i (torch.searchsorted, right=False)
  E     [R, B]   float64 out: err_i = (w_i - c[code_i]) / U_ii
and for j > i the not yet quantized columns move: w_j <- w_j - err_i * U_ij (a product, then a difference).

Two implementations with the same contract:
  sweep_torch   the reference: a Python loop over the B columns, [R]-vector ops per column (the CPU path).
  sweep_triton  one kernel: a program keeps BLOCK_R rows x the whole block in registers and runs the B steps
                there (column i picked out by a masked sum, which adds zeros only; the code by counting the
                midpoints below w; the centroid by a masked sum). Compiled with floating-point contraction off
                (``enable_fp_fusion=False``: no fused multiply-add), so every value goes through the same float64
                operations as in sweep_torch and the two agree bit for bit (tests/test_gptq_sweep.py).
The torch loop costs ~8 kernel launches per column on a GPU (C launches-rounds per projection); the kernel one
launch per block.
"""
from __future__ import annotations

import torch

from .triton_util import triton_ok

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

__all__ = ["sweep_torch", "sweep_triton", "sweep", "midpoints", "MAX_KERNEL_BLOCK"]

MAX_KERNEL_BLOCK = 256  # widest block the kernel takes (its rows x block tiles live in registers); "auto" above: torch


def midpoints(book: torch.Tensor) -> torch.Tensor:
    """[R, K-1] float64 midpoints of ascending per-row centroids ``book`` [R, K] (float64)."""
    return ((book[:, :-1] + book[:, 1:]) * 0.5).contiguous()


def _check(W, U, book, mid):
    R, B = W.shape
    if U.shape != (B, B) or book.dim() != 2 or book.shape[0] != R or mid.shape != (R, book.shape[1] - 1):
        raise ValueError(f"gptq sweep: W {tuple(W.shape)}, U {tuple(U.shape)}, book {tuple(book.shape)}, "
                         f"mid {tuple(mid.shape)} do not match")
    if not all(t.dtype == torch.float64 for t in (W, U, book, mid)):
        raise ValueError("gptq sweep: W, U, book and mid must be float64")


def sweep_torch(W: torch.Tensor, U: torch.Tensor, book: torch.Tensor, mid: torch.Tensor):
    """(codes int64 [R, B], E float64 [R, B]): the reference (module docstring)."""
    _check(W, U, book, mid)
    W1 = W.clone()
    B = W1.shape[1]
    codes = torch.empty(W1.shape, dtype=torch.long, device=W1.device)
    E1 = torch.empty_like(W1)
    for i in range(B):
        w = W1[:, i:i + 1]
        a = torch.searchsorted(mid, w.contiguous())
        codes[:, i:i + 1] = a
        e = (w - torch.gather(book, 1, a)) / U[i, i]
        W1[:, i + 1:].sub_(e * U[i:i + 1, i + 1:])
        E1[:, i:i + 1] = e
    return codes, E1


if triton is not None:
    @triton.jit
    def _sweep_kernel(w_ptr, stride_w, u_ptr, book_ptr, mid_ptr, codes_ptr, e_ptr, R, B, K,
                      BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_B)
        ks = tl.arange(0, BLOCK_K)
        rmask = rows < R
        cmask = cols < B
        r64 = rows.to(tl.int64)
        tile = rmask[:, None] & cmask[None, :]
        Wt = tl.load(w_ptr + r64[:, None] * stride_w + cols[None, :], mask=tile, other=0.0)
        kmask = rmask[:, None] & (ks[None, :] < K)
        cb = tl.load(book_ptr + r64[:, None] * K + ks[None, :], mask=kmask, other=0.0)
        mmask = rmask[:, None] & (ks[None, :] < K - 1)
        md = tl.load(mid_ptr + r64[:, None] * (K - 1) + ks[None, :], mask=mmask, other=0.0)
        Et = tl.zeros([BLOCK_R, BLOCK_B], dtype=tl.float64)
        At = tl.zeros([BLOCK_R, BLOCK_B], dtype=tl.int32)
        for i in range(0, B):
            pick = cols[None, :] == i
            w = tl.sum(tl.where(pick, Wt, 0.0), axis=1)  # exact: w plus zeros
            a = tl.sum(tl.where(mmask & (md < w[:, None]), 1, 0), axis=1)
            q = tl.sum(tl.where(ks[None, :] == a[:, None], cb, 0.0), axis=1)
            uii = tl.load(u_ptr + i * B + i)
            urow = tl.load(u_ptr + i * B + cols, mask=cmask & (cols > i), other=0.0)
            e = (w - q) / uii
            Wt = tl.where(cols[None, :] > i, Wt - e[:, None] * urow[None, :], Wt)
            Et = tl.where(pick, e[:, None], Et)
            At = tl.where(pick, a[:, None], At)
        tl.store(e_ptr + r64[:, None] * B + cols[None, :], Et, mask=tile)
        tl.store(codes_ptr + r64[:, None] * B + cols[None, :], At.to(tl.int64), mask=tile)


def sweep_triton(W: torch.Tensor, U: torch.Tensor, book: torch.Tensor, mid: torch.Tensor,
                 block_r: int | None = None):
    """(codes int64 [R, B], E float64 [R, B]): the kernel (module docstring); equal to ``sweep_torch``.
    B <= MAX_KERNEL_BLOCK; ``block_r`` rows per program (default 16, 8 for blocks wider than 128)."""
    _check(W, U, book, mid)
    if not triton_ok(W.device):
        raise ValueError(f"gptq sweep: Triton cannot run on {W.device}")
    if W.shape[1] > MAX_KERNEL_BLOCK:
        raise ValueError(f"gptq sweep: the kernel takes blocks up to {MAX_KERNEL_BLOCK} columns, not {W.shape[1]}")
    if block_r is None:
        block_r = 16 if W.shape[1] <= 128 else 8
    if W.stride(1) != 1:
        W = W.contiguous()
    R, B = W.shape
    K = book.shape[1]
    U, book, mid = U.contiguous(), book.contiguous(), mid.contiguous()
    codes = torch.empty(R, B, dtype=torch.long, device=W.device)
    E = torch.empty(R, B, dtype=torch.float64, device=W.device)
    if R == 0 or B == 0:
        return codes, E
    _sweep_kernel[(triton.cdiv(R, block_r),)](
        W, W.stride(0), U, book, mid, codes, E, R, B, K, BLOCK_R=block_r,
        BLOCK_B=triton.next_power_of_2(B), BLOCK_K=triton.next_power_of_2(max(K, 2)), num_warps=4,
        enable_fp_fusion=False)
    return codes, E


def sweep(W: torch.Tensor, U: torch.Tensor, book: torch.Tensor, mid: torch.Tensor, impl: str = "auto"):
    """``impl``: "torch", "triton" or "auto" (the kernel on CUDA for blocks up to MAX_KERNEL_BLOCK columns, the
    loop elsewhere)."""
    if impl == "auto":
        impl = ("triton" if W.device.type == "cuda" and triton_ok(W.device) and W.shape[1] <= MAX_KERNEL_BLOCK
                else "torch")
    if impl == "triton":
        return sweep_triton(W, U, book, mid)
    if impl != "torch":
        raise ValueError(f"gptq sweep: impl {impl!r} is not torch, triton or auto")
    return sweep_torch(W, U, book, mid)
