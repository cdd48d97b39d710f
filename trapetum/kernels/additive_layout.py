"""Additive-codebook (AQLM) code layouts and the dequantization reference, beside the kernels that read them.

Canonical layout (the Hugging Face AQLM layout, stored byte for byte in ``.cbk`` records of scheme "aqlm")::

    codes      int8 (nbits <= 8) / int16  [out / og, in / ig, M]   index of codebook m = code mod 2**nbits
    codebooks  fp16 [M, 2**nbits, og, ig]
    scales     fp16 [out / og, 1, 1, 1]
    W[o-group, i-group] = scales[o-group] * sum_m codebooks[m, codes[o-group, i-group, m]]

The 2x8 CUDA kernel's "slices" layout (``pack_2x8``; the engine packs each 2x8 projection once): per part,
``[ceil(G / 32) slices][N padded to 16 rows][64 bytes]`` (a slice = 32 input groups x 2 codebooks of one row),
zeros past G and N, each 16-row unit's 1,024 bytes permuted by ``packed_pos`` (the .cu's ``packed_pos``, which
tests/cuda/additive_2x8_host_check.cu prints for tests/test_additive_kernels.py to compare): odd 16-byte chunks
of rows r and r + 8 trade places and rows r % 8 in 2..5 store each chunk with its two 8-byte halves swapped, so
that every lane of the kernel finds its bytes in the order its lookups want. "rows" is the canonical layout
read as stored.

The 2x8 tensor-core kernel's layout (``pack_2x8_mma``; cuda/additive_mma.cu, the "mma" option): per part
``[ceil(N / 32) tiles][G / 8 chunks][32 lanes][16 bytes]``; lane 4 g + t, byte b = 8 s + 2 h + m holds
codebook m's code of row 32 tile + g + 8 h, group 8 chunk + 4 s + t (s = 0, 1; h = 0..3); zeros past N.
A warp's chunk load is 512 contiguous bytes and each lane's 16 bytes are the codes its lookups use.
"""
from __future__ import annotations

import functools
import math

import torch

__all__ = ["codes_to_index", "index_to_codes", "dequantize_aqlm", "SLICE", "UNIT_ROWS", "LAYOUTS_2X8",
           "pad_rows", "packed_pos", "pack_2x8", "unpack_2x8", "MMA_TILE_ROWS", "pack_2x8_mma", "unpack_2x8_mma"]

SLICE = 32  # input groups per 2x8 slice (kSlice in the .cu)
UNIT_ROWS = 16  # rows per 2x8 unit of work (kUnitRows in the .cu)
LAYOUTS_2X8 = ("slices", "rows")
MMA_TILE_ROWS = 32  # rows per tile of the tensor-core 2x8 layout (kTileRows in additive_mma.cu)


def codes_to_index(codes: torch.Tensor, nbits: int) -> torch.Tensor:
    """Stored signed codes -> indices 0 .. 2**nbits - 1 (int64)."""
    return codes.to(torch.int64) % (1 << nbits)


def index_to_codes(idx: torch.Tensor, nbits: int) -> torch.Tensor:
    """Indices 0 .. 2**nbits - 1 -> stored signed codes (int8 for nbits <= 8, else int16), as AQLM packs them."""
    idx = idx.to(torch.int64)
    half = 1 << (nbits - 1)
    signed = torch.where(idx >= half, idx - (1 << nbits), idx)
    return signed.to(torch.int8 if nbits <= 8 else torch.int16)


def dequantize_aqlm(codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [out, in] in ``dtype``: codebook entries summed in float32 (float64 if dtype is float64),
    times the scale, then cast. codes [OG, IG, M]; codebooks [M, K, og, ig]; scales [OG, 1, 1, 1]."""
    M, K, og, ig = codebooks.shape
    OG, IG, _ = codes.shape
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    idx = codes_to_index(codes, int(math.log2(K)))  # [OG, IG, M]
    flat = codebooks.to(acc).reshape(M * K, og * ig)
    offs = torch.arange(M, device=codes.device) * K
    w = flat[(idx + offs).reshape(-1)].view(OG, IG, M, og * ig).sum(2)  # [OG, IG, og*ig]
    w = w.view(OG, IG, og, ig) * scales.to(acc).view(OG, 1, 1, 1)
    return w.permute(0, 2, 1, 3).reshape(OG * og, IG * ig).to(dtype)


def pad_rows(n: int) -> int:
    """Rows of a 2x8 part padded to whole 16-row units (the kernel's partial sums and packed codes)."""
    return -(-n // UNIT_ROWS) * UNIT_ROWS


@functools.lru_cache(maxsize=None)
def packed_pos(device: str = "cpu") -> torch.Tensor:
    """int64 [1024]: where the "slices" layout stores byte b (0..63) of row rr (0..15) of a 16-row unit, in the
    unit's 1,024 bytes, at index rr * 64 + b (the .cu's ``packed_pos``)."""
    rr = torch.arange(16).view(16, 1)
    b = torch.arange(64).view(1, 64)
    r = rr & 7
    half_swap = ((r >> 1) ^ (r >> 2)) & 1
    pos = 512 * ((rr >> 3) ^ ((b >> 4) & 1)) + 64 * r + 16 * (b >> 4) + ((b & 15) ^ (8 * half_swap))
    return pos.reshape(-1).to(device)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS_2X8:
        raise ValueError(f"layout: must be one of {LAYOUTS_2X8}, got {layout!r}")


def pack_2x8(codes: torch.Tensor, layout: str = "slices") -> torch.Tensor:
    """2x8 codes int8 [N, G, 2] in the CUDA kernel's layout, as a flat uint8 buffer: "slices" (module docstring;
    filled one slice at a time: no full-size temporary) or "rows" (the canonical bytes; a view when contiguous)."""
    _check_layout(layout)
    if codes.dim() != 3 or codes.shape[2] != 2 or codes.dtype != torch.int8:
        raise ValueError(f"codes: need int8 [N, G, 2], got {codes.dtype} {tuple(codes.shape)}")
    N, G, _ = codes.shape
    if layout == "rows":
        return codes.contiguous().view(torch.uint8).reshape(-1)
    nslices, npad = -(-G // SLICE), pad_rows(N)
    out = torch.empty(nslices, npad // UNIT_ROWS, UNIT_ROWS * 2 * SLICE, dtype=torch.uint8, device=codes.device)
    pos = packed_pos(str(codes.device))
    for s in range(nslices):
        g0, g1 = s * SLICE, min(G, (s + 1) * SLICE)
        rows = torch.zeros(npad, 2 * SLICE, dtype=torch.uint8, device=codes.device)
        rows[:N, : 2 * (g1 - g0)] = codes[:, g0:g1].reshape(N, -1).view(torch.uint8)
        out[s].index_copy_(1, pos, rows.view(npad // UNIT_ROWS, -1))  # out[s][:, pos[i]] = rows[:, i]
    return out.reshape(-1)


def unpack_2x8(buf: torch.Tensor, N: int, G: int, layout: str = "slices") -> torch.Tensor:
    """Inverse of ``pack_2x8``: int8 [N, G, 2] (a view for "rows", a copy for "slices")."""
    _check_layout(layout)
    if layout == "rows":
        return buf.view(torch.int8).view(N, G, 2)
    nslices, npad = -(-G // SLICE), pad_rows(N)
    v = buf.view(nslices, npad // UNIT_ROWS, -1)[:, :, packed_pos(str(buf.device))]  # canonical row order
    v = v.reshape(nslices, npad, 2 * SLICE).transpose(0, 1)[:N].reshape(N, -1)[:, : 2 * G]
    return v.view(torch.int8).reshape(N, G, 2)


def pack_2x8_mma(codes: torch.Tensor) -> torch.Tensor:
    """2x8 codes int8 [N, G, 2] (G % 8 == 0) in the tensor-core kernel's layout (module docstring), flat uint8."""
    if codes.dim() != 3 or codes.shape[2] != 2 or codes.dtype != torch.int8 or codes.shape[1] % 8:
        raise ValueError(f"codes: need int8 [N, G, 2] with G % 8 == 0, got {codes.dtype} {tuple(codes.shape)}")
    N, G, _ = codes.shape
    tiles = -(-N // MMA_TILE_ROWS)
    c = torch.zeros(tiles * MMA_TILE_ROWS, G, 2, dtype=torch.uint8, device=codes.device)
    c[:N] = codes.view(torch.uint8)
    # [tile, h, g, chunk, s, t, m] -> [tile, chunk, g, t, s, h, m]
    v = c.view(tiles, 4, 8, G // 8, 2, 4, 2).permute(0, 3, 2, 5, 4, 1, 6)
    return v.contiguous().reshape(-1)


def unpack_2x8_mma(buf: torch.Tensor, N: int, G: int) -> torch.Tensor:
    """Inverse of ``pack_2x8_mma``: int8 [N, G, 2]."""
    tiles = -(-N // MMA_TILE_ROWS)
    if buf.numel() != tiles * MMA_TILE_ROWS * G * 2:
        raise ValueError(f"buf: {buf.numel()} bytes, expected {tiles * MMA_TILE_ROWS * G * 2} for {N} x {G} groups")
    v = buf.view(tiles, G // 8, 8, 4, 2, 4, 2).permute(0, 5, 2, 1, 4, 3, 6)  # -> [tile, h, g, chunk, s, t, m]
    return v.reshape(tiles * MMA_TILE_ROWS, G, 2)[:N].contiguous().view(torch.int8)
