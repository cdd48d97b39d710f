"""Codebook dequantization to a dense fp16 weight, for tensor-core prefill.

W[r, c] = codebook[r, idx(r, c)] with the canonical packed layout (``trapetum.kernels.pack``).
The torch reference (``trapetum.kernels.codebook_gemv.dequantize``) unpacks to int64 indices and
gathers: about 20 bytes of memory traffic per weight. The Triton kernel reads the packed byte
once and writes the fp16 weight: 2.5 bytes per weight at 4 bits; the row's codebook (32 bytes at
4 bits) stays in L1. On CUDA with the tensor-core extension, 4-bit rows whose byte count is a
multiple of 16 go to its ``cb_dequant4`` kernel instead (byte-permute lookups from registers,
16-byte loads and stores; launched without PDL: a prefill kernel); kernel options with ``cuda`` off keep them on
Triton. Every path writes exactly the reference's values (a gather of fp16 centroids: no arithmetic).
"""
from __future__ import annotations

import torch

from ..settings import DEFAULT_KERNELS, KernelOptions
from . import cuda_ext
from .codebook_gemv import dequantize as dequantize_reference
from .triton_util import HAVE_TRITON, triton_ok

BITS = (2, 4, 8)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _dequant_kernel(codes_ptr, cb_ptr, w_ptr, N, K, KB, stride_c, stride_cb, stride_w,
                        BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
        PER: tl.constexpr = 8 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # output rows
        b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)  # packed byte columns
        rm = r < N
        c = tl.load(codes_ptr + r[:, None] * stride_c + b[None, :], mask=rm[:, None] & (b[None, :] < KB),
                    other=0).to(tl.int32)
        for j in tl.static_range(PER):
            idx = (c >> (j * BITS)) & MASK
            col = b * PER + j
            m = rm[:, None] & (col[None, :] < K)
            v = tl.load(cb_ptr + r[:, None] * stride_cb + idx, mask=m, other=0.0)
            tl.store(w_ptr + r[:, None] * stride_w + col[None, :], v, mask=m)


def dequantize(codes: torch.Tensor, codebook: torch.Tensor, bits: int, in_features: int,
               *, out: torch.Tensor | None = None, kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """Dense fp16 W [out, in_features] from packed codes uint8 [out, ceil(in*bits/8)] and codebook
    fp16 [out, 2**bits]: the CUDA kernel (4-bit, see the module docstring), else Triton on CUDA (or under
    TRITON_INTERPRET=1), else torch."""
    if bits not in BITS:
        raise ValueError(f"bits: must be one of {BITS}, got {bits!r}")
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"codes: expected uint8 [out, packed], got {codes.dtype} {tuple(codes.shape)}")
    n, kb = codes.shape
    if kb != -(-in_features * bits // 8):
        raise ValueError(f"codes: {kb} bytes per row do not hold {in_features} {bits}-bit indices")
    if codebook.shape != (n, 1 << bits) or codebook.dtype != torch.float16 or codebook.device != codes.device:
        raise ValueError(f"codebook: expected float16 [{n}, {1 << bits}] on {codes.device}")
    if out is None:
        out = torch.empty(n, in_features, dtype=torch.float16, device=codes.device)
    elif out.shape != (n, in_features) or out.dtype != torch.float16 or out.stride(1) != 1:
        raise ValueError(f"out: expected float16 [{n}, {in_features}] with a contiguous last dim")
    codes = codes.contiguous()
    codebook = codebook.contiguous()
    if bits == 4 and kb % 16 == 0 and codes.is_cuda and out.is_contiguous() and in_features == 2 * kb:
        ext = cuda_ext.ready(codes.device, kopts)
        if ext is not None:  # CUDA kernel: byte-permute lookups, 16-byte loads and stores
            ext.cb_dequant4(codes, codebook, out)
            return out
    if not triton_ok(codes.device):
        return out.copy_(dequantize_reference(codes, codebook, bits, in_features))
    BLOCK_R, BLOCK_B = 16, 64
    grid = (triton.cdiv(n, BLOCK_R), triton.cdiv(kb, BLOCK_B))
    _dequant_kernel[grid](codes, codebook, out, n, in_features, kb, codes.stride(0), codebook.stride(0),
                          out.stride(0), BITS=bits, BLOCK_R=BLOCK_R, BLOCK_B=BLOCK_B, num_warps=4)
    return out
