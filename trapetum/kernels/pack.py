"""Index packing for per-row codebooks: the canonical layouts that files and the GEMV kernels read.

    bits 8: codes uint8 [out, in]                 one index per byte
    bits 4: codes uint8 [out, ceil(in/2)]         column 2j in the low nibble, 2j+1 in the high nibble
    bits 2: codes uint8 [out, ceil(in/4)]         column 4j+k at bits 2k
    bits 3: codes uint8 [out, 3 * ceil(in/8)]     8 indices per 3 bytes: index k of a group at
                                                  bits 3k of the group's 24-bit little-endian word
    bits 1: codes uint8 [out, ceil(in/8)]         column 8j+k at bit k

Padding columns are packed as index 0 and dropped on unpack.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SUPPORTED_BITS = (1, 2, 3, 4, 8)

__all__ = ["SUPPORTED_BITS", "packed_width", "pack_codes", "unpack_codes"]


def packed_width(in_features: int, bits: int) -> int:
    """Bytes per row of the packed index matrix."""
    _check_bits(bits)
    if bits == 3:
        return 3 * ((in_features + 7) // 8)
    per = 8 // bits
    return (in_features + per - 1) // per


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported index width {bits} bits (supported: {SUPPORTED_BITS})")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: integer [R, C] with values in [0, 2**bits) -> packed uint8 [R, packed_width(C, bits)]."""
    import torch  # here, not at the top: packed_width serves the torch-free .cbk check (formats/cbk_contents.py)

    _check_bits(bits)
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D [out, in], got shape {tuple(codes.shape)}")
    R, C = codes.shape
    c = codes.to(torch.int32)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= (1 << bits)):
        raise ValueError(f"codes out of range for {bits}-bit packing")
    if bits == 8:
        return c.to(torch.uint8).contiguous()
    group = 8 if bits == 3 else 8 // bits
    pad = (-C) % group
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    g = c.view(R, -1, group)  # [R, G, group]
    shifts = torch.arange(group, dtype=torch.int32, device=c.device) * bits
    word = (g << shifts).sum(-1, dtype=torch.int32)  # [R, G]; fields never overlap, sum == or
    if bits == 3:  # 24-bit word -> 3 little-endian bytes
        b = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], -1)
        return b.reshape(R, -1).to(torch.uint8).contiguous()
    return word.to(torch.uint8).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """packed uint8 [R, packed_width(in_features, bits)] -> uint8 indices [R, in_features]."""
    import torch

    _check_bits(bits)
    R = packed.shape[0]
    if packed.dim() != 2 or packed.shape[1] != packed_width(in_features, bits):
        raise ValueError(f"packed codes of shape {tuple(packed.shape)} do not hold {in_features} "
                         f"{bits}-bit indices per row (expected width {packed_width(in_features, bits)})")
    if bits == 8:
        return packed
    p = packed.to(torch.int32)
    if bits == 3:
        b = p.view(R, -1, 3)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)  # [R, G]
        group = 8
    else:
        word = p
        group = 8 // bits
    shifts = torch.arange(group, dtype=torch.int32, device=p.device) * bits
    idx = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, G, group]
    return idx.reshape(R, -1)[:, :in_features].to(torch.uint8)
