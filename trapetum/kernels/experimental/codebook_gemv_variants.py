"""Variants of the 4-/8-bit codebook GEMV kept for measurements (``cuda/experimental/codebook_gemv_variants.cu``,
an extension of its own: the production build does not compile it). No production path calls them;
``trapetum.eval.bench_kernels`` times them beside the production kernel, and tests/test_kernels_gemv.py checks them
against the float64 reference.

  3   shared-memory pair tables, x one chunk ahead (all lanes load x)
  4   byte-permute (PRMT) lookups from codebook byte planes in registers, no table (4-bit; 8-bit runs 3)
  5   3 with x loaded only by the lanes whose activation row exists
  7   5 without code loads past the last chunk: the production kernel on canonical codes as it was before the
      multi-row work (its M > 1 rows read x in place)
  11  7 on tiled codes (``codebook_layout.tile_codes``): the production kernel as it was, on tiled codes

NOTES-kernels.md has their measurements. Same arguments and layouts as ``codebook_gemv.codebook_gemv`` (variant 11
takes tiled codes, the others canonical codes); bits 4 and 8, M <= 16, the mma shape rule.
"""
from __future__ import annotations

import torch

from ...settings import DEFAULT_KERNELS, KernelOptions
from .. import codebook_gemv as cg
from .. import cuda_ext

VARIANTS = (3, 4, 5, 7, 11)
TILED_VARIANT = 11

EXT = cuda_ext.Extension(
    "trapetum_cb_gemv_variants", ("experimental/codebook_gemv_variants.cu",),
    """
void cb_gemv_variant(torch::Tensor x, torch::Tensor codes, torch::Tensor cb, torch::Tensor res, torch::Tensor y,
                     int64_t bits, int64_t epi, int64_t has_res, int64_t f, int64_t variant, int64_t pdl);
""", ["cb_gemv_variant"])


def available(device: torch.device | None = None, kopts: KernelOptions = DEFAULT_KERNELS) -> bool:
    """True if the variants can run on `device` (CUDA, sm_80+, ``kopts.cuda``) and their extension builds."""
    return EXT.ready(device, kopts) is not None


def _prepare(x, codes, codebook, bits, variant, kopts):
    if variant not in VARIANTS:
        raise ValueError(f"variant: must be one of {VARIANTS}, got {variant!r}")
    n = codebook.shape[0] if isinstance(codebook, torch.Tensor) and codebook.dim() == 2 else -1
    if variant == TILED_VARIANT:
        if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.shape[0] != -(-n // 16) * 16:
            raise ValueError(f"codes: variant 11 takes tiled codes ({-(-n // 16) * 16} rows)")
        cg._check(x, codes[:n], codebook, bits)
    else:
        cg._check(x, codes, codebook, bits)
    x2 = (x.reshape(1, -1) if x.dim() == 1 else x).contiguous()
    if not cg.mma_shape_ok(x2.shape[0], x2.shape[1], bits):
        raise ValueError("x: the variants need bits 4 or 8, M <= 16 and 64 code bytes per row | in")
    ext = EXT.ready(x.device, kopts) if x.device.type == "cuda" else None
    if ext is None:
        raise ValueError(f"variant: the experimental kernels are unavailable here ({EXT.error() or 'needs CUDA'})")
    return ext, x2, codes.contiguous(), codebook.contiguous()


def gemv(x: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, bits: int,
         residual: torch.Tensor | None = None, *, variant: int, out: torch.Tensor | None = None,
         kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """``codebook_gemv`` on kernel variant `variant` (module docstring). Returns fp16 [M, out] (or [out])."""
    ext, x2, codes, codebook = _prepare(x, codes, codebook, bits, variant, kopts)
    M, N = x2.shape[0], codebook.shape[0]
    if residual is not None:
        if residual.dtype != torch.float16 or residual.numel() != M * N or residual.device != x.device:
            raise ValueError(f"residual: expected float16 with {M}x{N} elements on {x.device}")
        residual = residual.reshape(M, N).contiguous()
    y = cg._out(out, (M, N), x.device)
    ext.cb_gemv_variant(x2, codes, codebook, residual if residual is not None else y, y, bits, 0,
                        int(residual is not None), 0, variant, int(kopts.pdl_cuda))
    return y.view(N) if x.dim() == 1 else y


def gemv_gate_up(x: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, bits: int, f: int,
                 act: str = "silu", *, variant: int, out: torch.Tensor | None = None,
                 kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """``codebook_gemv_gate_up`` on kernel variant `variant`. Returns fp16 [M, f] (or [f])."""
    if act not in cg.ACTS:
        raise ValueError(f"act: must be 'silu' or 'gelu_tanh', got {act!r}")
    ext, x2, codes, codebook = _prepare(x, codes, codebook, bits, variant, kopts)
    n = codes.shape[0]
    if n % 16 or not (0 < f <= n // 2) or f <= n // 2 - 8:
        raise ValueError(f"f: {f} does not match an interleaved gate/up matrix of {n} rows")
    y = cg._out(out, (x2.shape[0], f), x.device)
    ext.cb_gemv_variant(x2, codes, codebook, y, y, bits, cg.ACTS[act], 0, f, variant, int(kopts.pdl_cuda))
    return y.view(f) if x.dim() == 1 else y
