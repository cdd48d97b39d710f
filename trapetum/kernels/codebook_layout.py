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

Activation rows have one run-time layout besides row-major: the mma GEMV's fragment order (FRAG_ROWS <= M <= 16
rows of K features; the kernel's comment in ``cuda/codebook_gemv_mma.cu`` says why). With PT = ``frag_pieces(bits)``
(4 for a 4-bit consumer, 2 for an 8-bit one), feature k of row m (piece r = k // 8 of 8 halves, element j = k % 8;
chunk c = r // (4 PT), lane t = (r // PT) % 4, i = r % PT) sits at element
    ((((c * PT + i) * M + m) * 4 + t) * 8 + j                                      (``frag_index``)
of a [M, K] buffer, so that each warp instruction of the GEMV reads 512 contiguous bytes. Producers whose only
consumer is such a GEMV (RMSNorm, the attention merge, the gate/up epilogue) write this order directly and hand
over ``Fragments(data, bits)``; the GEMV then skips its own copy into fragment order (one launch per projection).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .triton_util import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

FRAG_ROWS = 3  # the mma GEMV reads x in fragment order from this many rows on (kFragRows in the kernel)


def frag_pieces(bits: int) -> int:
    """16-byte pieces of x per lane and 64-byte code chunk of the mma GEMV at ``bits`` (4 or 8)."""
    if bits not in (4, 8):
        raise ValueError(f"bits: fragment order exists for 4- and 8-bit GEMVs, got {bits!r}")
    return 4 if bits == 4 else 2


def frag_index(m, k, M: int, pt: int):
    """Element offset of row m, feature k in fragment order (module docstring); ints or int tensors."""
    r, j = k // 8, k % 8
    c, t, i = r // (4 * pt), (r // pt) % 4, r % pt
    return (((c * pt + i) * M + m) * 4 + t) * 8 + j


def _frag_check(x: torch.Tensor, bits: int) -> int:
    pt = frag_pieces(bits)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] % (32 * pt):
        raise ValueError(f"x: fragment order needs [M, K] rows with K % {32 * pt} == 0, "
                         f"got {tuple(getattr(x, 'shape', ()))}")
    return pt


def to_fragments(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Row-major x [M, K] -> the same values in fragment order (a [M, K] buffer; the reference of the kernels)."""
    pt = _frag_check(x, bits)
    M, K = x.shape
    m = torch.arange(M, device=x.device).view(-1, 1)
    k = torch.arange(K, device=x.device).view(1, -1)
    out = torch.empty(M * K, dtype=x.dtype, device=x.device)
    out[frag_index(m, k, M, pt).reshape(-1)] = x.reshape(-1)
    return out.view(M, K)


def from_fragments(xf: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``to_fragments``: the row-major [M, K] rows."""
    pt = _frag_check(xf, bits)
    M, K = xf.shape
    m = torch.arange(M, device=xf.device).view(-1, 1)
    k = torch.arange(K, device=xf.device).view(1, -1)
    return xf.reshape(-1)[frag_index(m, k, M, pt)]


class Fragments(NamedTuple):
    """M activation rows in the fragment order of a ``bits``-bit mma GEMV: ``data`` [M, K] holds the permuted
    values (module docstring). Only a projection whose ``reads_fragments(M)`` is ``bits`` accepts it."""
    data: torch.Tensor
    bits: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def rows(self) -> torch.Tensor:
        """The row-major rows (a copy; for tests and fallbacks)."""
        return from_fragments(self.data, self.bits)


if HAVE_TRITON:
    @triton.jit
    def frag_offset(m, k, M, PT: tl.constexpr):
        """``frag_index`` in a Triton kernel (k an int tensor of features, m the row)."""
        r = k // 8
        c = r // (4 * PT)
        t = (r // PT) % 4
        i = r % PT
        return (((c * PT + i) * M + m) * 4 + t) * 8 + (k % 8)


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
