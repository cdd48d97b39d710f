"""The expert GEMVs of kernels/expert_gemv.py for AQLM 2x8 experts (two codebooks of 256 8-wide entries, in_group 8,
out_group 1; kernels/additive_layout.py's canonical layout): the same launches, contracts and arguments, the weights
decoded by gathering the two codebook entries of each code pair (the per-matrix codebooks, 8 KiB, stay in L1).

    W[o, 8g:8g+8] = scales[o] * (codebooks[0, codes[o, g, 0]] + codebooks[1, codes[o, g, 1]])   (codes mod 256)

Stacks (an id is an offset):
    gate/up  codes int8 [E, 2, F, K/8, 2] (part 0 gate, 1 up), codebooks fp16 [E, 2, 2, 256, 8], scales fp16 [E, 2, F]
    down     codes int8 [E, D, F/8, 2],                          codebooks fp16 [E, 2, 256, 8],    scales fp16 [E, D]
A row's dot product: the groups in order, BLOCK_G groups a tile, fp32; times its scale after the sum. One program
per (row block, (row, slot)) for gate/up and per (row block, row) for down, tile sizes from the device kind only:
row m of an M-row call has the bits of the one-row call (tested). float64 references beside them.
"""
from __future__ import annotations

import torch

from .additive_layout import dequantize_aqlm
from .codebook_gemv import ACTS, _act_ref
from .triton_util import HAVE_TRITON, triton_ok

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .codebook_gemv import gated_act


def available(device: torch.device) -> bool:
    return triton_ok(device)


def _dense(codes, cb, sc):
    """float64 [N, 8G] of one matrix (canonical codes [N, G, 2], codebooks [2, 256, 8], scales [N])."""
    return dequantize_aqlm(codes, cb.view(2, 256, 1, 8), sc.view(-1, 1, 1, 1), torch.float64)


def expert_gate_up_2x8_reference(x, idx, codes, cb, sc, act="silu") -> torch.Tensor:
    """float64 h [M, k, F]."""
    E = codes.shape[0]
    G = torch.stack([_dense(codes[e, 0], cb[e, 0], sc[e, 0]) for e in range(E)])
    U = torch.stack([_dense(codes[e, 1], cb[e, 1], sc[e, 1]) for e in range(E)])
    e = idx.long()
    g = torch.einsum("mjfk,mk->mjf", G[e], x.double())
    u = torch.einsum("mjfk,mk->mjf", U[e], x.double())
    return _act_ref(g, act) * u


def expert_down_2x8_reference(h, idx, weights, codes, cb, sc, residual=None) -> torch.Tensor:
    """float64 y [M, D]."""
    W = torch.stack([_dense(codes[e], cb[e], sc[e]) for e in range(codes.shape[0])])
    y = torch.einsum("mjdf,mjf,mj->md", W[idx.long()], h.double(), weights.double())
    return y if residual is None else y + residual.double()


if HAVE_TRITON:

    @triton.jit
    def _dot_2x8(x_row, codes_base, cb_base, rn, nmask, G, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
        """fp32 [BLOCK_N]: rows rn of one 2x8 matrix (codes [*, G, 2], codebooks [2, 256, 8]) times x (8G fp16)."""
        t8 = tl.arange(0, 8)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for g0 in range(0, G, BLOCK_G):
            gg = g0 + tl.arange(0, BLOCK_G)
            gmask = gg < G
            m2 = nmask[:, None] & gmask[None, :]
            off = (rn[:, None] * G + gg[None, :]) * 2
            c0 = tl.load(codes_base + off, mask=m2, other=0).to(tl.int32) & 255
            c1 = tl.load(codes_base + off + 1, mask=m2, other=0).to(tl.int32) & 255
            m3 = m2[:, :, None]
            w0 = tl.load(cb_base + c0[:, :, None] * 8 + t8[None, None, :], mask=m3, other=0.0).to(tl.float32)
            w1 = tl.load(cb_base + 2048 + c1[:, :, None] * 8 + t8[None, None, :], mask=m3, other=0.0).to(tl.float32)
            xv = tl.load(x_row + gg[:, None] * 8 + t8[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
            acc += tl.sum(tl.sum((w0 + w1) * xv[None, :, :], 2), 1)
        return acc

    @triton.jit(do_not_specialize=("x_ptr", "idx_ptr", "y_ptr"))
    def _gate_up_2x8_kernel(x_ptr, idx_ptr, c_ptr, cb_ptr, sc_ptr, y_ptr, K, F, KS, ACT: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
        pid_n = tl.program_id(0)
        r = tl.program_id(1)
        m = r // KS
        e = tl.load(idx_ptr + r).to(tl.int64)
        G = K // 8
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < F
        x_row = x_ptr + m * K
        part = F * G * 2  # code bytes of one part
        cbase = c_ptr + e * 2 * part
        g = _dot_2x8(x_row, cbase, cb_ptr + e * 8192, rn, nmask, G, BLOCK_N, BLOCK_G)
        u = _dot_2x8(x_row, cbase + part, cb_ptr + e * 8192 + 4096, rn, nmask, G, BLOCK_N, BLOCK_G)
        g = g * tl.load(sc_ptr + e * 2 * F + rn, mask=nmask, other=0.0).to(tl.float32)
        u = u * tl.load(sc_ptr + e * 2 * F + F + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + r * F + rn, gated_act(g, u, ACT).to(tl.float16), mask=nmask)

    @triton.jit(do_not_specialize=("x_ptr", "idx_ptr", "rw_ptr", "res_ptr", "y_ptr"))
    def _down_2x8_kernel(x_ptr, idx_ptr, rw_ptr, c_ptr, cb_ptr, sc_ptr, res_ptr, y_ptr, N, F, KS: tl.constexpr,
                         HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        G = F // 8
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        y = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in range(KS):  # slots in order; a loop, not unrolled (six unrolled 2x8 dot products spilled)
            e = tl.load(idx_ptr + m * KS + j).to(tl.int64)
            c = tl.load(rw_ptr + m * KS + j)
            d = _dot_2x8(x_ptr + (m * KS + j) * F, c_ptr + e * N * G * 2, cb_ptr + e * 4096, rn, nmask, G,
                         BLOCK_N, BLOCK_G)
            d = d * tl.load(sc_ptr + e * N + rn, mask=nmask, other=0.0).to(tl.float32)
            y += c * d
        if HAS_RES:
            y += tl.load(res_ptr + m * N + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * N + rn, y.to(tl.float16), mask=nmask)


def _blocks(device):
    return (32, 64) if device.type == "cpu" else (16, 32)


def _check(codes, cb, sc, shape_codes, shape_cb, shape_sc, device):
    for name, t, want, dt in (("codes", codes, shape_codes, torch.int8), ("codebooks", cb, shape_cb, torch.float16),
                              ("scales", sc, shape_sc, torch.float16)):
        if not isinstance(t, torch.Tensor) or t.dtype != dt or tuple(t.shape) != tuple(want) or not t.is_contiguous() \
                or t.device != device:
            raise ValueError(f"{name}: expected contiguous {dt} {tuple(want)} on {device}, got "
                             f"{getattr(t, 'dtype', None)} {tuple(getattr(t, 'shape', ()))}")


def _rows(x, idx):
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float16 or not x.is_contiguous():
        raise ValueError("x: expected a contiguous float16 tensor")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != x.shape[0] or \
            idx.dtype not in (torch.int32, torch.int64) or idx.device != x.device:
        raise ValueError(f"idx: expected int32/int64 [{x.shape[0]}, k] on {x.device}")
    if not triton_ok(x.device):
        raise ValueError("device: the expert GEMVs need a CUDA device or TRITON_INTERPRET=1")
    return idx.contiguous()


def expert_gate_up_2x8(x, idx, codes, cb, sc, act="silu", *, out=None) -> torch.Tensor:
    """h [M, k, F] fp16 (module docstring); x fp16 [M, K], K % 8 == 0."""
    if act not in ACTS:
        raise ValueError(f"act: must be one of {sorted(ACTS)}, got {act!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] % 8:
        raise ValueError(f"x: expected [M, K] with K % 8 == 0, got {tuple(getattr(x, 'shape', ()))}")
    idx = _rows(x, idx)
    M, K = x.shape
    ks = idx.shape[1]
    E, F = codes.shape[0], codes.shape[2] if codes.dim() == 5 else -1
    _check(codes, cb, sc, (E, 2, F, K // 8, 2), (E, 2, 2, 256, 8), (E, 2, F), x.device)
    y = torch.empty(M, ks, F, dtype=torch.float16, device=x.device) if out is None else out
    bn, bg = _blocks(x.device)
    _gate_up_2x8_kernel[(triton.cdiv(F, bn), M * ks)](x, idx, codes, cb, sc, y, K, F, ks, ACT=ACTS[act],
                                                      BLOCK_N=bn, BLOCK_G=bg, num_warps=4)
    return y


def expert_down_2x8(h, idx, weights, codes, cb, sc, residual=None, *, out=None) -> torch.Tensor:
    """y [M, D] fp16 = sum_j weights[m, j] down_e h[m, j] (+ residual), slots in order; F % 8 == 0."""
    if not isinstance(h, torch.Tensor) or h.dim() != 3 or h.shape[2] % 8:
        raise ValueError(f"h: expected [M, k, F] with F % 8 == 0, got {tuple(getattr(h, 'shape', ()))}")
    idx = _rows(h, idx)
    M, ks, F = h.shape
    if idx.shape[1] != ks or not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (M, ks):
        raise ValueError(f"weights: expected [{M}, {ks}] like idx")
    E, D = codes.shape[0], codes.shape[1] if codes.dim() == 4 else -1
    _check(codes, cb, sc, (E, D, F // 8, 2), (E, 2, 256, 8), (E, D), h.device)
    if residual is not None and (residual.dtype != torch.float16 or tuple(residual.shape) != (M, D)):
        raise ValueError(f"residual: expected float16 [{M}, {D}]")
    y = torch.empty(M, D, dtype=torch.float16, device=h.device) if out is None else out
    bn, bg = _blocks(h.device)
    res = residual.contiguous() if residual is not None else y
    _down_2x8_kernel[(triton.cdiv(D, bn), M)](h, idx, weights.float().contiguous(), codes, cb, sc, res, y, D, F,
                                              KS=ks, HAS_RES=residual is not None, BLOCK_N=bn, BLOCK_G=bg,
                                              num_warps=4)
    return y
