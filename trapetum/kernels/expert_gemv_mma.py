"""The selected experts' 4-/8-bit codebook GEMVs on tensor cores (CUDA C++: ``cuda/expert_gemv_mma.cu``, its file
comment has the design), for DECODE / VERIFY rows; the same two stages as kernels/expert_gemv.py:

    expert_gate_up_mma(x [M, K], idx [M, k], codes, cb, bits, f, act)      -> h [M, k, f]
    expert_down_mma(h [M, k, F], idx, weights [M, k], codes, cb, bits)     -> y [M, D]  (+ residual)

Stacks: expert_gemv.py's codebook layouts (gate/up codes uint8 [E, 2Fp, KB(K)] interleaved 8 gate / 8 up, codebook
fp16 [E, 2Fp, 2**bits]; down codes [E, D, KB(F)], codebook [E, D, 2**bits]), either canonical (``tiled=False``) or
with every expert's codes through ``codebook_layout.tile_codes`` (``tiled=True``: gate/up [E, 2Fp, KB], down
[E, ceil(D/16)*16, KB]); both give the same bits. The ids are read on the device; no host sync, and the only
allocation (down's fp32 partials [M, k, D], and the outputs when not given) comes from torch's caching allocator:
capturable in a CUDA graph.

Requirements (``applies``; the functions raise ValueError naming the argument): bits 4 or 8, 64 code bytes per
row | the input width (4-bit: K % 128 == 0 and F % 128 == 0; 8-bit: % 64), a CUDA device of compute capability
8.0+, ``kopts.cuda`` and the extension built.

Contracts. Each (row m, slot j) is computed exactly as the dense one-row mma GEMV of expert idx[m, j] on that row
(gate/up: bitwise ``codebook_gemv_gate_up`` of the expert's matrix; down: its fp32 dot before rounding); down then
adds the k slots in slot order, y = round(sum_j weights[m, j] * part[m, j] (+ residual[m])) from 0.0 (fused
multiply-adds): row m of an M-row call has exactly the bits of the one-row call on row m whatever the other rows
hold or chose, and replays are bitwise (no atomics). These bits differ from the Triton kernels' (another
summation order); float64 references: ``expert_gemv.expert_gate_up_reference`` / ``expert_down_reference`` on
canonical codes (``untile_stack``).
"""
from __future__ import annotations

import torch

from ..settings import DEFAULT_KERNELS, KernelOptions
from . import cuda_ext
from .codebook_gemv import ACTS
from .codebook_layout import tile_codes, untile_codes


def applies(bits: int, k_in: int, f: int, device, kopts: KernelOptions = DEFAULT_KERNELS) -> bool:
    """True if the CUDA expert GEMVs may run for these shapes on ``device`` under ``kopts``."""
    step = 512 // bits if bits in (4, 8) else 0
    return bool(step) and k_in % step == 0 and f % step == 0 and \
        cuda_ext.ready(torch.device(device), kopts) is not None


def tile_stack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [E, ceil(N/16)*16, KB]: ``tile_codes`` of each expert's canonical codes [E, N, KB]."""
    return torch.stack([tile_codes(c) for c in codes]).contiguous()


def untile_stack(codes: torch.Tensor, n: int) -> torch.Tensor:
    """The canonical [E, n, KB] codes of a tiled stack."""
    return torch.stack([untile_codes(c, n) for c in codes]).contiguous()


def _ext(device, kopts):
    ext = cuda_ext.ready(device, kopts) if device.type == "cuda" else None
    if ext is None:
        raise ValueError(f"device: the CUDA expert GEMVs need a CUDA device of sm_80+ and kopts.cuda "
                         f"({cuda_ext.error() or device})")
    return ext


def _check(x, idx, codes, cb, bits, k_in, rows, tiled, name):
    if bits not in (4, 8):
        raise ValueError(f"bits: the CUDA expert GEMVs take 4 or 8, got {bits!r}")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float16 or not x.is_contiguous():
        raise ValueError("x: expected a contiguous float16 tensor")
    if k_in % (512 // bits):
        raise ValueError(f"{name}: input width {k_in} is not a multiple of {512 // bits} (64 code bytes per row)")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != x.shape[0] or idx.shape[1] < 1 \
            or idx.dtype not in (torch.int32, torch.int64) or idx.device != x.device:
        raise ValueError(f"idx: expected int32/int64 [{x.shape[0]}, k] on {x.device}")
    if not 1 <= idx.numel() <= 65535:
        raise ValueError(f"idx: {idx.numel()} (row, slot) pairs, the kernel takes 1 to 65535")
    kb = k_in * bits // 8
    want_rows = -(-rows // 16) * 16 if tiled else rows
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() != 3 \
            or tuple(codes.shape[1:]) != (want_rows, kb) or not codes.is_contiguous() or codes.device != x.device:
        raise ValueError(f"{name}: expected contiguous uint8 codes [E, {want_rows}, {kb}] on {x.device}, got "
                         f"{getattr(codes, 'dtype', None)} {tuple(getattr(codes, 'shape', ()))}")
    if not isinstance(cb, torch.Tensor) or cb.dtype != torch.float16 or not cb.is_contiguous() \
            or tuple(cb.shape) != (codes.shape[0], rows, 1 << bits) or cb.device != x.device:
        raise ValueError(f"{name}: codebook must be contiguous float16 {(codes.shape[0], rows, 1 << bits)}")
    return idx.contiguous()


def expert_gate_up_mma(x: torch.Tensor, idx: torch.Tensor, codes: torch.Tensor, cb: torch.Tensor, bits: int, f: int,
                       act: str = "silu", *, tiled: bool = False, out: torch.Tensor | None = None,
                       kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """h [M, k, f] fp16 = act(gate_e x[m]) * up_e x[m], e = idx[m, j] (module docstring); x fp16 [M, K]."""
    if act not in ACTS:
        raise ValueError(f"act: must be one of {sorted(ACTS)}, got {act!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: expected [M, K], got {tuple(getattr(x, 'shape', ()))}")
    rows = codes.shape[1] if isinstance(codes, torch.Tensor) and codes.dim() == 3 else 0
    if rows % 16 or not (isinstance(f, int) and rows // 2 - 8 < f <= rows // 2):
        raise ValueError(f"f: {f} does not match an interleaved gate/up stack of {rows} rows")
    idx = _check(x, idx, codes, cb, bits, x.shape[1], rows, tiled, "codes")
    ext = _ext(x.device, kopts)
    M, ks = idx.shape
    y = torch.empty(M, ks, f, dtype=torch.float16, device=x.device) if out is None else out
    if not isinstance(y, torch.Tensor) or y.dtype != torch.float16 or tuple(y.shape) != (M, ks, f) \
            or not y.is_contiguous() or y.device != x.device:
        raise ValueError(f"out: expected a contiguous float16 [{M}, {ks}, {f}] tensor on {x.device}")
    ext.cb_expert_gate_up(x, idx, codes, cb, y, bits, ACTS[act], f, int(tiled), int(kopts.pdl_cuda))
    return y


def expert_down_mma(h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, codes: torch.Tensor,
                    cb: torch.Tensor, bits: int, residual: torch.Tensor | None = None, *, tiled: bool = False,
                    out: torch.Tensor | None = None, kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """y [M, D] fp16 = sum_j weights[m, j] down_e h[m, j] (+ residual [M, D]), slots in order (module docstring)."""
    if not isinstance(h, torch.Tensor) or h.dim() != 3:
        raise ValueError(f"h: expected [M, k, F], got {tuple(getattr(h, 'shape', ()))}")
    M, ks, F = h.shape
    D = cb.shape[1] if isinstance(cb, torch.Tensor) and cb.dim() == 3 else 0
    idx = _check(h, idx, codes, cb, bits, F, D, tiled, "codes")
    if idx.shape[1] != ks:
        raise ValueError(f"idx: {idx.shape[1]} slots for h's {ks}")
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (M, ks) or weights.device != h.device:
        raise ValueError(f"weights: expected [{M}, {ks}] on {h.device}")
    weights = weights.float().contiguous()
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.dtype != torch.float16 or \
                tuple(residual.shape) != (M, D) or residual.device != h.device:
            raise ValueError(f"residual: expected float16 [{M}, {D}] on {h.device}")
        residual = residual.contiguous()
    ext = _ext(h.device, kopts)
    y = torch.empty(M, D, dtype=torch.float16, device=h.device) if out is None else out
    if not isinstance(y, torch.Tensor) or y.dtype != torch.float16 or tuple(y.shape) != (M, D) \
            or not y.is_contiguous() or y.device != h.device:
        raise ValueError(f"out: expected a contiguous float16 [{M}, {D}] tensor on {h.device}")
    part = torch.empty(M, ks, D, dtype=torch.float32, device=h.device)
    ext.cb_expert_down(h, idx, weights, codes, cb, residual if residual is not None else y, part, y, bits,
                       int(residual is not None), int(tiled), int(kopts.pdl_cuda))
    return y
