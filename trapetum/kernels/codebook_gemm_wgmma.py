"""The 4-bit per-row codebook GEMV for 17..256 rows on Hopper's warpgroup MMA (``cuda/codebook_gemm_wgmma.cu``: the
design and why each row keeps the bits of its one-row call through the mma kernel).

Batched decode (the paged engine's steps of many sequences) multiplies up to 256 rows of x by each 4-bit weight;
the grouped mma kernel loads every x fragment through each warp's LSU, 16 weight rows at a time, and that load is
half of its 64-row time (NOTES-kernels.md, session 15). Here x reaches the tensor cores from shared memory, staged
once for 64 weight rows, and the weights are dequantized in registers. ``codebook_gemv`` dispatches to it for tiled
4-bit codes and more than 16 rows when ``KernelOptions.many_rows`` is "wgmma" and ``ready``; elsewhere the grouped
mma kernel runs, with the same bits. Its own extension, compiled for sm_90a (the arch-specific target wgmma needs).
"""
from __future__ import annotations

import torch

from ..settings import DEFAULT_KERNELS, KernelOptions
from .cuda_ext import Extension, available

EXT = Extension(
    "trapetum_cuda_wgmma", ("codebook_gemm_wgmma.cu",),
    "void cb_gemm_wgmma(torch::Tensor x, torch::Tensor codes, torch::Tensor cb, torch::Tensor res, torch::Tensor y,"
    " int64_t epi, int64_t has_res, int64_t f, int64_t nx, int64_t rs, int64_t wg, int64_t pdl);",
    ["cb_gemm_wgmma"], cuda_flags=("-gencode=arch=compute_90a,code=sm_90a",))

ROW_GROUP = 64  # activation rows a block at most (nx): a call of M rows dequantizes every weight ceil(M / 64) times
MIN_ROWS = 17  # up to 16 rows the mma kernel's n-tiles cost what one row costs: it stays
LARGE_N = 8192  # output rows from which it runs at 17..32 rows too (below: the grouped kernel was faster)
LARGE_NK = 1 << 25  # weights from which it runs above 32 rows (4096 x 4096: the grouped kernel was faster)


def takes(m: int, n: int, k: int) -> bool:
    """Whether an m-row call on n x k 4-bit weights (n: the codes' rows, gate/up both halves) goes to this kernel:
    where it measured faster than the grouped mma kernel (H100, session 19, BENCHMARKS.md "Session 19": at 64 rows
    4096x11008 0.65x, gate/up 0.58x, 11008x4096 0.89x, 4096x4096 1.07x; at 32 rows 0.86-0.99x for n >= 11008 and
    1.18-1.34x below). The same bits either way, so this is a speed choice only."""
    return m >= MIN_ROWS and (n >= LARGE_N or (m > 32 and n * k >= LARGE_NK))


def ready(device: torch.device | None, kopts: KernelOptions = DEFAULT_KERNELS) -> bool:
    """Whether the wgmma kernel runs here: kernel options' many_rows "wgmma" and cuda on, an sm_90 device, built."""
    if kopts.many_rows != "wgmma" or not available(device, kopts):
        return False
    if torch.cuda.get_device_capability(device or torch.device("cuda")) != (9, 0):
        return False
    return EXT.ready(device, kopts) is not None


def gemm(x: torch.Tensor, tiled_codes: torch.Tensor, cb: torch.Tensor, out: torch.Tensor, *,
         residual: torch.Tensor | None = None, gate_up_f: int = 0, act: int = 1, nx: int = 0, rs: int = 0,
         wg: int = 0, pdl: bool = False) -> torch.Tensor:
    """out [M, N] = x [M, K] W^T (+ residual) on 4-bit tiled codes (``codebook_layout.tile_codes``), or with
    ``gate_up_f`` the interleaved gate/up rows' act(gate) * up (act 1 SiLU, 2 GELU-tanh) into out [M, gate_up_f].
    nx: activation rows a block (32, 64; 0: by M); rs: residue split across blocks (1, 2, 4, 8; 0: by the grid's
    size); wg: warpgroups a block, 64 weight rows each, sharing the block's x stages (1, 2, 3; 0: 1); every choice gives
    the same bits. Shapes are checked by the launcher (``codebook_gemv`` checks first)."""
    epi = act if gate_up_f else 0
    res = residual if residual is not None else out
    EXT.load().cb_gemm_wgmma(x, tiled_codes, cb, res, out, epi, int(residual is not None), int(gate_up_f), nx, rs,
                             wg, int(pdl))
    return out
