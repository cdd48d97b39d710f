"""Load-time layouts of per-row codebook weights for the GEMV kernels (``codebook_gemv``).

The .cbk file keeps the canonical packing (``trapetum.kernels.pack``); these repacks are made once when the
engine is built and are pure permutations / paddings of the canonical bytes:

  interleave_gate_up   gate and up projections in one matrix, rows in groups of 16: 8 gate rows, then the same
                       8 up rows (F padded to a multiple of 8 with zero rows); the fused gate/up epilogue reads
                       act(gate) * up from one 16-row tile.
  tile_codes           the CUDA kernel's tiled code layout: per 16-row tile and 64-byte chunk c, the tile's
                       1,024 bytes ordered [h][g][t][16 B] = rows g + 8h, bytes 16t..16t+15 of chunk c, so the
                       kernel's lane (g, t) loads 512 contiguous bytes per warp instruction. Rows padded to 16
                       with zeros (never stored).
  untile_codes         the inverse of ``tile_codes``.
"""
from __future__ import annotations

import torch


def interleave_gate_up(gate_codes, gate_codebook, up_codes, up_codebook):
    """Rows in groups of 16 (8 gate, then the same 8 up rows); F is padded to a multiple of 8 with zero rows.

    codes uint8 [F, KB] and codebooks fp16 [F, C] of both projections -> (codes [2*Fp, KB], codebook [2*Fp, C], F)
    with Fp = ceil(F / 8) * 8."""
    if gate_codes.shape != up_codes.shape or gate_codebook.shape != up_codebook.shape:
        raise ValueError("up_codes: gate and up projections must have the same shapes")
    f, kb = gate_codes.shape
    fp = -(-f // 8) * 8
    nc = gate_codebook.shape[1]

    def pad(t):
        out = torch.zeros(fp, t.shape[1], dtype=t.dtype, device=t.device)
        out[:f] = t
        return out.reshape(fp // 8, 8, t.shape[1])

    codes = torch.stack([pad(gate_codes), pad(up_codes)], 1).reshape(2 * fp, kb).contiguous()
    cb = torch.stack([pad(gate_codebook), pad(up_codebook)], 1).reshape(2 * fp, nc).contiguous()
    return codes, cb, f


def tile_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, KB] (KB % 64 == 0) -> [ceil(N/16)*16, KB] in the tiled layout (module docstring)."""
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.dtype != torch.uint8:
        raise ValueError("codes: expected a 2-D uint8 tensor")
    N, KB = codes.shape
    if KB % 64:
        raise ValueError(f"codes: {KB} bytes per row is not a multiple of 64")
    npad = -(-N // 16) * 16
    full = codes if npad == N else torch.cat([codes, codes.new_zeros(npad - N, KB)])
    t = full.reshape(npad // 16, 2, 8, KB // 64, 4, 16).permute(0, 3, 1, 2, 4, 5)
    return t.contiguous().reshape(npad, KB)


def untile_codes(tiled: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``tile_codes``: the canonical [n, KB] codes."""
    npad, KB = tiled.shape
    if npad % 16 or KB % 64 or not 0 < n <= npad:
        raise ValueError(f"tiled: shape {tuple(tiled.shape)} is not a tiled layout of {n} rows")
    t = tiled.reshape(npad // 16, KB // 64, 2, 8, 4, 16).permute(0, 2, 3, 1, 4, 5)
    return t.contiguous().reshape(npad, KB)[:n]
