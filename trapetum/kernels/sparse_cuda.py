"""The CUDA activation-sparse GEMV of 4-bit per-row codebooks (``cuda/sparse_gemv.cu``; KernelOptions.sparse_kernel
"cuda"), reached through ``sparse_gemv.sparse_project`` when its codes are in the warp-major layout made here.

    warp_major_codes(codes uint8 [N, packed_width(K, 4)], K) -> cw int32 [G, K, 32], G = ceil(N / 256)
        cw[g, k, lane] holds the 4-bit codes of input k for rows 256 g + lane + 32 i, i = 0..7, code i in bits
        4i..4i+3 (rows >= N: code 0), so that a warp reads the codes of one kept input for 256 rows as one
        128-byte line (the input-major ``ct`` of sparse_gemv.py puts them in 32-byte pieces).
    to_input_major(cw, N) -> ct uint8 [K, packed_width(N, 4)]: the same codes in sparse_gemv.py's layout (the
        torch path and the tests read it).

A CUDA kernel's layout module (this one and kernels/sparse_mma.py) gives ``sparse_gemv.sparse_project`` the same
names: LAYOUT, CODE_DTYPE, is_layout(ct), layout_shape(N, K), to_input_major(ct, N), EXT, launch(...).

Kernel contract (the .cu file's comment): blocks of 256 rows x a K range of ``splits(K, N)`` ranges (from the
shape only) x row m; each block lists its row's kept inputs (the select fused into the x load, dense rows: x != 0),
sums fp32 in list order, the last block of a row group (a device counter left at zero) adds the ranges' partials
in range order and writes the epilogue (residual, or act(gate) * up of rows interleaved 8 / 8). Deterministic, a
row's bits those of its one-row call, no host sync (capturable), PDL as KernelOptions.pdl_cuda.
"""
from __future__ import annotations

import torch

from . import cuda_ext
from .pack import pack_codes, unpack_codes

LAYOUT, CODE_DTYPE = "warp-major", "int32"
ROWS = 256  # rows per group (a block)
MAX_KS = 1024  # inputs per K range (the kernel's shared list)
TARGET_BLOCKS = 528  # blocks a launch at M = 1: 4 per SM of the H200's 132 (60 registers: 4 blocks an SM)
MAX_SPLITS = 32
COUNTERS = 1 << 16  # split completion counters per device (this kernel and sparse_gemv's compact one share them)
_COUNTERS: dict[torch.device, torch.Tensor] = {}

_DECLS = """
void cb_sparse_gemv(torch::Tensor x, torch::Tensor cw, torch::Tensor cb, torch::Tensor res, torch::Tensor dense,
                    torch::Tensor y, torch::Tensor part, torch::Tensor cnt, double t, int64_t epi, int64_t has_res,
                    int64_t f, int64_t splits, int64_t pdl);
"""
EXT = cuda_ext.Extension("trapetum_sparse_gemv", ("sparse_gemv.cu",), _DECLS, ["cb_sparse_gemv"])


def ready(device: torch.device, kopts) -> bool:
    """Whether the CUDA sparse GEMV runs on ``device`` under ``kopts`` (sparse_kernel "cuda", the extension built)."""
    return kopts.sparse_kernel == "cuda" and EXT.ready(device, kopts) is not None


def warp_major_codes(codes: torch.Tensor, in_features: int) -> torch.Tensor:
    """Canonical 4-bit row-major codes [N, packed_width(K, 4)] -> warp-major int32 [G, K, 32] (module docstring)."""
    idx = unpack_codes(codes, 4, in_features)  # uint8 [N, K]
    N, K = idx.shape
    G = -(-N // ROWS)
    full = torch.zeros(G * ROWS, K, dtype=torch.uint8, device=idx.device)
    full[:N] = idx
    v = full.view(G, 8, 32, K).permute(0, 3, 2, 1)  # [G, K, lane, i]
    w = torch.zeros(G, K, 32, dtype=torch.int64, device=idx.device)
    for i in range(8):
        w |= v[..., i].to(torch.int64) << (4 * i)
    w = torch.where(w >= 1 << 31, w - (1 << 32), w)  # the uint32 bit pattern as int32
    return w.to(torch.int32).contiguous()


def to_input_major(cw: torch.Tensor, N: int) -> torch.Tensor:
    """Warp-major codes [G, K, 32] -> sparse_gemv.py's input-major uint8 [K, packed_width(N, 4)]."""
    G, K, _ = cw.shape
    w = cw.to(torch.int64) & 0xFFFFFFFF
    idx = torch.stack([(w >> (4 * i)) & 15 for i in range(8)], dim=-1)  # [G, K, lane, i]
    idx = idx.permute(1, 0, 3, 2).reshape(K, G * ROWS)[:, :N]  # row 256 g + 32 i + lane
    return pack_codes(idx.contiguous(), 4)


def is_layout(ct: torch.Tensor) -> bool:
    return ct.dtype == torch.int32 and ct.dim() == 3 and ct.shape[2] == 32


def layout_shape(N: int, K: int) -> tuple[int, int, int]:
    return (-(-N // ROWS), K, 32)


def split_count(K: int, N: int, rows: int, target_blocks: int, max_ks: int) -> int:
    """K ranges per block of ``rows`` rows: from the shape only (never M or the data); at M = 1 the grid at most
    ``target_blocks`` (one wave: no tail of a second), ranges of at least ~128 inputs and at most ``max_ks``."""
    s = max(1, min(target_blocks // -(-N // rows), MAX_SPLITS, -(-K // 128)))
    return max(s, -(-K // max_ks))


def splits(K: int, N: int) -> int:
    """This kernel's K ranges per row group (``split_count``)."""
    return split_count(K, N, ROWS, TARGET_BLOCKS, MAX_KS)


def split_counters(device: torch.device, blocks: int) -> torch.Tensor:
    """The int32 completion counters of a split launch over ``blocks`` row blocks: made once per device, zero;
    every call of either split kernel leaves them zero (the last block of a row block resets its counter), so the
    calls of one stream share them."""
    if blocks > COUNTERS:
        raise ValueError(f"sparse GEMV: {blocks} row blocks, more than the {COUNTERS} counters")
    cnt = _COUNTERS.get(device)
    if cnt is None:
        cnt = _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return cnt


def launch_split(op, rows: int, x2, codes, codebook, out, residual, t, dense_u8, epi, f, kopts, S: int):
    """Call a split sparse kernel ``op`` (this extension's or sparse_mma's: the same arguments) over ``codes``'
    blocks of ``rows`` rows and S K ranges: the shared counters, the fp32 partials of S > 1."""
    M = x2.shape[0]
    B = codes.shape[0]
    cnt = split_counters(x2.device, M * B)
    part = torch.empty(S * M * B * rows if S > 1 else 1, dtype=torch.float32, device=x2.device)
    res = residual if residual is not None else out
    op(x2, codes, codebook, res, dense_u8, out, part, cnt, float(t), int(epi), int(residual is not None), int(f),
       int(S), int(kopts.pdl_cuda))
    return out


def launch(x2, cw, codebook, N, out, residual, t, dense_u8, epi, f, kopts, splits_=None):
    """out = the sparse GEMV of x2 fp16 [M, K] (``sparse_project``'s arguments, checked there)."""
    S = splits(x2.shape[1], N) if splits_ is None else splits_
    return launch_split(EXT.load().cb_sparse_gemv, ROWS, x2, cw, codebook, out, residual, t, dense_u8, epi, f,
                        kopts, S)
