"""What the split sparse GEMVs share: the K-range count from the shape, the device's completion counters and the
launch of a split kernel. The tensor-core CUDA kernel (kernels/sparse_mma.py, cuda/sparse_mma.cu with
cuda/sparse_split.cuh) and the compacted Triton kernel of kernels/sparse_gemv.py (``_compact_gemv_kernel``) split
a row's K into ranges; the block (program) that finishes a row block last, found by a device counter that it
leaves at zero again, adds the ranges' partials in range order and writes the epilogue. Deterministic, no host
sync (capturable). (History: these came from the module of the first CUDA sparse kernel, deleted once the mma
kernel beat it in every end-to-end cell, BENCHMARKS.md session 17.)
"""
from __future__ import annotations

import torch

MAX_SPLITS = 32
COUNTERS = 1 << 16  # split completion counters per device (the mma kernel and sparse_gemv's compact one share them)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_count(K: int, N: int, rows: int, target_blocks: int, max_ks: int) -> int:
    """K ranges per block of ``rows`` rows: from the shape only (never M or the data); at M = 1 the grid at most
    ``target_blocks`` (one wave: no tail of a second), ranges of at least ~128 inputs and at most ``max_ks``."""
    s = max(1, min(target_blocks // -(-N // rows), MAX_SPLITS, -(-K // 128)))
    return max(s, -(-K // max_ks))


def split_counters(device: torch.device, blocks: int) -> torch.Tensor:
    """The int32 completion counters of a split launch over ``blocks`` row blocks: made once per device, zero;
    every call of a split kernel leaves them zero (the last block of a row block resets its counter), so the
    calls of one stream share them."""
    if blocks > COUNTERS:
        raise ValueError(f"sparse GEMV: {blocks} row blocks, more than the {COUNTERS} counters")
    cnt = _COUNTERS.get(device)
    if cnt is None:
        cnt = _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return cnt


def launch_split(op, rows: int, x2, codes, codebook, out, residual, t, dense_u8, epi, f, kopts, S: int):
    """Call a split CUDA sparse kernel ``op`` (sparse_mma's ``cb_sparse_mma``: x, codes, codebook, residual, dense,
    out, partials, counters, t, epilogue, has_res, f, splits, pdl) over ``codes``' blocks of ``rows`` rows and S K
    ranges: the shared counters, the fp32 partials of S > 1."""
    M = x2.shape[0]
    B = codes.shape[0]
    cnt = split_counters(x2.device, M * B)
    part = torch.empty(S * M * B * rows if S > 1 else 1, dtype=torch.float32, device=x2.device)
    res = residual if residual is not None else out
    op(x2, codes, codebook, res, dense_u8, out, part, cnt, float(t), int(epi), int(residual is not None), int(f),
       int(S), int(kopts.pdl_cuda))
    return out
