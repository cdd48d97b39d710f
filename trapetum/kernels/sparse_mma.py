"""The tensor-core activation-sparse GEMV of 4-bit per-row codebooks (``cuda/sparse_mma.cu``; KernelOptions.sparse_kernel
"mma"), reached through ``sparse_gemv.sparse_project`` when its codes are in the tile-major layout made here.

    tile_codes(codes uint8 [N, packed_width(K, 4)], K) -> ct uint8 [T, K, 64], T = ceil(N / 128)
        ct[tt, k, b] = code of row 128 tt + 2b (low nibble) | code of row 128 tt + 2b + 1 (high nibble), rows >= N
        code 0: sparse_gemv.input_major_codes cut into 64-byte tiles of 128 rows, so that the codes of one kept
        input for a block's 128 rows are one 64-byte piece and a block's pieces lie in one K x 64-byte run.
    to_input_major(ct, N) -> sparse_gemv.py's input-major uint8 [K, packed_width(N, 4)] (the torch path, tests).
The CUDA layout module interface that ``sparse_gemv.sparse_project`` reads (sparse_gemv.CUDA_LAYOUTS): LAYOUT,
CODE_DTYPE, is_layout(ct), layout_shape(N, K), to_input_major(ct, N), EXT, launch(...). The default sparse kernel
(KernelOptions.sparse_kernel "mma") where the extension builds; elsewhere the codes stay input-major and the
Triton / torch path runs.

Kernel contract (the .cu file's comment): blocks of 128 rows x a K range of ``splits(K, N)`` ranges (from the
shape only) x row m; each block lists its row's kept inputs (the select fused into the x load, dense rows: x != 0),
the last block of a row tile (a device counter left at zero, kernels/sparse_split.py's, shared with the compacted
Triton kernel) adds the ranges' partials in range order and writes the epilogue (residual, or act(gate) * up of
rows interleaved 8 / 8). Deterministic, a row's bits those of its one-row call, no host sync (capturable), PDL as
KernelOptions.pdl_cuda.
"""
from __future__ import annotations

import torch

from . import cuda_ext
from .pack import packed_width, unpack_codes
from .sparse_split import launch_split, split_count

LAYOUT, CODE_DTYPE = "tile-major", "uint8"
ROWS = 128  # rows per tile (a block)
MAX_KS = 2048  # inputs per K range (the kernel's shared list of 16-bit entries)
MAX_K = 65536  # inputs of a projection (16-bit list entries)
TARGET_BLOCKS = 396  # blocks a launch at M = 1: 3 per SM of the H200's 132 (72 KB of shared memory a block)

_DECLS = """
void cb_sparse_mma(torch::Tensor x, torch::Tensor ct, torch::Tensor cb, torch::Tensor res, torch::Tensor dense,
                   torch::Tensor y, torch::Tensor part, torch::Tensor cnt, double t, int64_t epi, int64_t has_res,
                   int64_t f, int64_t splits, int64_t pdl);
"""
EXT = cuda_ext.Extension("trapetum_sparse_mma", ("sparse_mma.cu",), _DECLS, ["cb_sparse_mma"])


def ready(device: torch.device, kopts) -> bool:
    """Whether the tensor-core sparse GEMV runs on ``device`` under ``kopts`` (sparse_kernel "mma", built); the
    caller keeps projections of more than MAX_K inputs on the input-major path."""
    return kopts.sparse_kernel == "mma" and EXT.ready(device, kopts) is not None


def tile_codes(codes: torch.Tensor, in_features: int) -> torch.Tensor:
    """Canonical 4-bit row-major codes [N, packed_width(K, 4)] -> tile-major uint8 [T, K, 64] (module docstring)."""
    idx = unpack_codes(codes, 4, in_features)  # uint8 [N, K]
    N, K = idx.shape
    T = -(-N // ROWS)
    full = torch.zeros(T * ROWS, K, dtype=torch.uint8, device=idx.device)
    full[:N] = idx
    v = full.view(T, ROWS // 2, 2, K)  # [tt, b, lo/hi, k]
    byte = v[:, :, 0] | (v[:, :, 1] << 4)  # [tt, b, k]
    return byte.permute(0, 2, 1).contiguous()


def to_input_major(ct: torch.Tensor, N: int) -> torch.Tensor:
    """Tile-major codes [T, K, 64] -> sparse_gemv.py's input-major uint8 [K, packed_width(N, 4)]."""
    T, K, _ = ct.shape
    return ct.permute(1, 0, 2).reshape(K, T * 64)[:, :packed_width(N, 4)].contiguous()


def is_layout(ct: torch.Tensor) -> bool:
    return ct.dtype == torch.uint8 and ct.dim() == 3 and ct.shape[2] == 64


def layout_shape(N: int, K: int) -> tuple[int, int, int]:
    return (-(-N // ROWS), K, 64)


def splits(K: int, N: int) -> int:
    """K ranges per row tile (sparse_split.split_count with this kernel's tile, target grid and range limit)."""
    return split_count(K, N, ROWS, TARGET_BLOCKS, MAX_KS)


def launch(x2, ct, codebook, N, out, residual, t, dense_u8, epi, f, kopts, splits_=None):
    """out = the sparse GEMV of x2 fp16 [M, K] (``sparse_project``'s arguments, checked there)."""
    S = splits(x2.shape[1], N) if splits_ is None else splits_
    return launch_split(EXT.load().cb_sparse_mma, ROWS, x2, ct, codebook, out, residual, t, dense_u8, epi, f, kopts,
                        S)
