"""Mixture-of-experts GEMVs for DECODE / VERIFY rows (M = 1..16): only the experts each row chose, one launch per
stage, the expert ids read on the device (no host sync: capturable in a CUDA graph).

    expert_gate_up(x [M, K], idx [M, k], W)            -> h [M, k, F]   h[m, j] = act(G_e x[m]) * (U_e x[m]),
                                                                         e = idx[m, j]
    expert_down(h [M, k, F], idx, weights [M, k], W)   -> y [M, D]      y[m] = sum_j weights[m, j] * D_e h[m, j]
                                                                         (+ residual[m]), j = 0, 1, ..., k - 1

Stacked weights (every expert of a layer in one tensor, expert e at offset e * stride(0): an id is an offset):
  "codebook" (per-row scalar codebooks, bits 2 / 4 / 8, canonical packing of kernels/pack.py):
      gate/up  codes uint8 [E, 2 Fp, KB(K)], codebook fp16 [E, 2 Fp, 2**bits], rows interleaved 8 gate / 8 up
               (``codebook_layout.interleave_gate_up`` of each expert, Fp = ceil(F / 8) * 8)
      down     codes uint8 [E, D, KB(F)],     codebook fp16 [E, D, 2**bits]
  "fp16" (dense):
      gate/up  w fp16 [E, 2F, K] (rows [0, F) gate, [F, 2F) up: schemes/dense.DenseGateUp's joint weight)
      down     w fp16 [E, D, F]
idx: int32 or int64 [M, k] (``models/blocks/moe.select_experts``), weights fp32 [M, k]. Ids outside [0, E) are the
caller's error (not checked on the device).

Contracts. fp32 accumulation in a fixed order (K tiles in order; the k slots of a row summed in slot order 0..k-1,
each slot's dot product computed in full before it is scaled by its weight and added): bitwise reproducible. Row
independence: a program computes one (row, slot) of gate/up or one row of down, with tile sizes from K, F and the
device kind only (never from M or the routing), and the row pointers are not specialized (triton_util.ROW_POINTERS):
row m of an M-row call has exactly the bits of a one-row call on row m whatever the other rows hold or chose (the
VERIFY contract; tested). Rows that chose the same expert read its weights separately (from L2 after the first).
Triton only (CUDA, or the CPU under TRITON_INTERPRET=1); ``available(device)`` says whether it can run. float64
references: ``expert_gate_up_reference``, ``expert_down_reference``.
"""
from __future__ import annotations

import threading
import warnings

import torch

from .codebook_gemv import ACTS, _act_ref, dequantize
from .triton_util import HAVE_TRITON, triton_ok

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .codebook_gemv import gated_act, triton_block_k

SCHEMES = ("codebook", "fp16")


def available(device: torch.device) -> bool:
    """True if the expert kernels can run on ``device``."""
    return triton_ok(device)


# ----------------------------------------------------------------------------- float64 references
def _dense_experts(w, cb, bits, k_in):
    """float64 [E, N, k_in] weights of a stack (codebook: dequantized)."""
    if cb is None:
        return w.double()
    return torch.stack([dequantize(w[e], cb[e], bits, k_in) for e in range(w.shape[0])]).double()


def expert_gate_up_reference(x, idx, w, cb, bits, f, act="silu") -> torch.Tensor:
    """float64 h [M, k, f] (module docstring); ``cb`` None for the fp16 stack."""
    W = _dense_experts(w, cb, bits, x.shape[-1])  # [E, N, K]
    if cb is not None:  # interleaved rows: groups of 16 = 8 gate, 8 up
        W = W.view(W.shape[0], -1, 2, 8, W.shape[-1])
        G = W[:, :, 0].reshape(W.shape[0], -1, W.shape[-1])[:, :f]
        U = W[:, :, 1].reshape(W.shape[0], -1, W.shape[-1])[:, :f]
    else:
        G, U = W[:, :f], W[:, f:2 * f]
    xd = x.double()
    e = idx.long()
    g = torch.einsum("mjfk,mk->mjf", G[e], xd)
    u = torch.einsum("mjfk,mk->mjf", U[e], xd)
    return _act_ref(g, act) * u


def expert_down_reference(h, idx, weights, w, cb, bits, residual=None) -> torch.Tensor:
    """float64 y [M, D] = sum_j weights[m, j] D_{idx[m, j]} h[m, j] (+ residual)."""
    W = _dense_experts(w, cb, bits, h.shape[-1])  # [E, D, F]
    y = torch.einsum("mjdf,mjf,mj->md", W[idx.long()], h.double(), weights.double())
    return y if residual is None else y + residual.double()


# ----------------------------------------------------------------------------- triton kernels
if HAVE_TRITON:

    @triton.jit
    def _rows_dot(x_row, w_base, cb_base, rn, nmask, K, KB, DENSE: tl.constexpr, BITS: tl.constexpr,
                  USE_GATHER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp32 [BLOCK_N]: weight rows rn of one expert (dense: [*, K] fp16; codebook: codes [*, KB], codebook
        [*, 2**BITS]) times the fp16 vector at x_row, K tiles in order."""
        PER: tl.constexpr = 8 // BITS
        NC: tl.constexpr = 1 << BITS
        MASK: tl.constexpr = NC - 1
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if not DENSE:
            if USE_GATHER:
                cbt = tl.load(cb_base + rn[:, None] * NC + tl.arange(0, NC)[None, :], mask=nmask[:, None], other=0.0)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            wmask = nmask[:, None] & kmask[None, :]
            if DENSE:
                w = tl.load(w_base + rn[:, None] * K + rk[None, :], mask=wmask, other=0.0).to(tl.float32)
            else:
                byte = tl.load(w_base + rn[:, None] * KB + rk[None, :] // PER, mask=wmask, other=0)
                q = (byte.to(tl.int32) >> ((rk[None, :] % PER) * BITS)) & MASK
                if USE_GATHER:
                    w = tl.gather(cbt, q, axis=1).to(tl.float32)
                else:
                    w = tl.load(cb_base + rn[:, None] * NC + q, mask=wmask, other=0.0).to(tl.float32)
            xv = tl.load(x_row + rk, mask=kmask, other=0.0).to(tl.float32)
            acc += tl.sum(w * xv[None, :], axis=1)
        return acc

    @triton.jit(do_not_specialize=("x_ptr", "idx_ptr", "y_ptr"))
    def _gate_up_kernel(x_ptr, idx_ptr, w_ptr, cb_ptr, y_ptr, K, KB, F, stride_we, stride_ce, KS,
                        DENSE: tl.constexpr, BITS: tl.constexpr, ACT: tl.constexpr, USE_GATHER: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # program (pid_n, r): slot r = m * KS + j; expert e = idx[r]; y[r, outputs of pid_n] (module docstring)
        pid_n = tl.program_id(0)
        r = tl.program_id(1)
        m = r // KS
        e = tl.load(idx_ptr + r).to(tl.int64)
        w_base = w_ptr + e * stride_we
        cb_base = cb_ptr + e * stride_ce
        x_row = x_ptr + m * K
        if DENSE:
            ro = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            omask = ro < F
            g = _rows_dot(x_row, w_base, cb_base, ro, omask, K, KB, True, BITS, False, BLOCK_N, BLOCK_K)
            u = _rows_dot(x_row, w_base, cb_base, F + ro, omask, K, KB, True, BITS, False, BLOCK_N, BLOCK_K)
            hv = gated_act(g, u, ACT)
        else:  # BLOCK_N == 16: one interleaved tile, 8 gate rows then the same 8 up rows
            rn = pid_n * 16 + tl.arange(0, 16)
            acc = _rows_dot(x_row, w_base, cb_base, rn, rn >= 0, K, KB, False, BITS, USE_GATHER, 16, BLOCK_K)
            g, u = tl.split(tl.permute(tl.reshape(acc, [2, 8]), [1, 0]))
            hv = gated_act(g, u, ACT)
            ro = pid_n * 8 + tl.arange(0, 8)
            omask = ro < F
        tl.store(y_ptr + r * F + ro, hv.to(tl.float16), mask=omask)

    @triton.jit(do_not_specialize=("x_ptr", "idx_ptr", "rw_ptr", "res_ptr", "y_ptr"))
    def _down_kernel(x_ptr, idx_ptr, rw_ptr, w_ptr, cb_ptr, res_ptr, y_ptr, N, F, KB, stride_we, stride_ce,
                     KS: tl.constexpr, DENSE: tl.constexpr, BITS: tl.constexpr, HAS_RES: tl.constexpr,
                     USE_GATHER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # program (pid_n, m): y[m, rows of pid_n] = sum over slots j in order of rw[m, j] * (D_e h[m, j])
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        y = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in range(KS):  # slots in order; a loop, not unrolled (unrolled, the fp16 form took 229 registers)
            e = tl.load(idx_ptr + m * KS + j).to(tl.int64)
            c = tl.load(rw_ptr + m * KS + j)
            d = _rows_dot(x_ptr + (m * KS + j) * F, w_ptr + e * stride_we, cb_ptr + e * stride_ce, rn, nmask, F,
                          KB, DENSE, BITS, USE_GATHER, BLOCK_N, BLOCK_K)
            y += c * d
        if HAS_RES:
            y += tl.load(res_ptr + m * N + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * N + rn, y.to(tl.float16), mask=nmask)


_GATHER_LOCK = threading.Lock()
_GATHER_OK: dict[tuple, bool] = {}


def _launch(kernel, grid, args, kw, device, gather: bool):
    """Launch with tl.gather where this Triton compiles it for the configuration (decided at the first launch of a
    configuration and fixed for the process; both forms load the same centroids: the same bits)."""
    if not (gather and hasattr(tl, "gather")):
        kernel[grid](*args, USE_GATHER=False, **kw)
        return
    key = (kernel.fn.__name__, device.type, tuple(sorted(kw.items())))
    with _GATHER_LOCK:
        known = _GATHER_OK.get(key)
        if known is None:
            try:
                kernel[grid](*args, USE_GATHER=True, **kw)
                _GATHER_OK[key] = True
                return
            except Exception as e:
                _GATHER_OK[key] = known = False
                warnings.warn(f"trapetum: Triton tl.gather does not compile for the expert GEMV {dict(kw)} here "
                              f"({type(e).__name__}); centroids are loaded from memory")
    kernel[grid](*args, USE_GATHER=known, **kw)


def _stack(w, cb, bits, k_in, name):
    """Checks a stack; returns (dense, KB, stride of an expert in w, in cb)."""
    if cb is None:
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype != torch.float16 or w.shape[2] != k_in \
                or not w.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous float16 [E, N, {k_in}] stack, got "
                             f"{getattr(w, 'dtype', None)} {tuple(getattr(w, 'shape', ()))}")
        return True, k_in, w.stride(0), 0
    if bits not in (2, 4, 8):
        raise ValueError(f"bits: must be 2, 4 or 8, got {bits!r}")
    kb = -(-k_in * bits // 8)
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype != torch.uint8 or w.shape[2] != kb \
            or not w.is_contiguous():
        raise ValueError(f"{name}: expected contiguous uint8 codes [E, N, {kb}], got "
                         f"{getattr(w, 'dtype', None)} {tuple(getattr(w, 'shape', ()))}")
    if not isinstance(cb, torch.Tensor) or cb.dtype != torch.float16 or tuple(cb.shape) != (*w.shape[:2], 1 << bits) \
            or not cb.is_contiguous():
        raise ValueError(f"{name}: codebook must be contiguous float16 {(*w.shape[:2], 1 << bits)}, got "
                         f"{getattr(cb, 'dtype', None)} {tuple(getattr(cb, 'shape', ()))}")
    return False, kb, w.stride(0), cb.stride(0)


def _check_rows(x, idx, device):
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float16 or not x.is_contiguous() or x.device != device:
        raise ValueError(f"x: expected a contiguous float16 tensor on {device}")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != x.shape[0] or idx.device != device \
            or idx.dtype not in (torch.int32, torch.int64) or idx.shape[1] < 1:
        raise ValueError(f"idx: expected int32/int64 [{x.shape[0]}, k] on {device}, got "
                         f"{getattr(idx, 'dtype', None)} {tuple(getattr(idx, 'shape', ()))}")
    if not triton_ok(device):
        raise ValueError("device: the expert GEMVs need a CUDA device or TRITON_INTERPRET=1")
    return idx.contiguous()


def _block_n(dense, device):
    return 32 if device.type == "cpu" else (16 if dense else 8)


def expert_gate_up(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, cb: torch.Tensor | None, bits: int, f: int,
                   act: str = "silu", *, out: torch.Tensor | None = None, gather: bool = True) -> torch.Tensor:
    """h [M, k, f] fp16 = act(gate_e x[m]) * up_e x[m] for e = idx[m, j] (module docstring); x fp16 [M, K]."""
    if act not in ACTS:
        raise ValueError(f"act: must be one of {sorted(ACTS)}, got {act!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: expected [M, K], got {tuple(getattr(x, 'shape', ()))}")
    idx = _check_rows(x, idx, x.device)
    M, K = x.shape
    ks = idx.shape[1]
    dense, kb, swe, sce = _stack(w, cb, bits, K, "w")
    rows = w.shape[1]
    if dense and not (isinstance(f, int) and 0 < f and 2 * f <= rows):
        raise ValueError(f"f: {f} does not fit a [gate; up] stack of {rows} rows")
    if not dense and not (isinstance(f, int) and rows % 16 == 0 and rows // 2 - 8 < f <= rows // 2):
        raise ValueError(f"f: {f} does not match an interleaved gate/up stack of {rows} rows")
    if w.device != x.device or (cb is not None and cb.device != x.device):
        raise ValueError("w: the stack must be on x's device")
    y = torch.empty(M, ks, f, dtype=torch.float16, device=x.device) if out is None else out
    if y.dtype != torch.float16 or tuple(y.shape) != (M, ks, f) or not y.is_contiguous():
        raise ValueError(f"out: expected a contiguous float16 [{M}, {ks}, {f}] tensor")
    bn = _block_n(dense, x.device)
    grid = (triton.cdiv(f, bn) if dense else rows // 16, M * ks)
    args = (x, idx, w, cb if cb is not None else w, y, K, kb, f, swe, sce, ks)
    kw = {"DENSE": dense, "BITS": bits if not dense else 4, "ACT": ACTS[act], "BLOCK_N": bn if dense else 16,
          "BLOCK_K": triton_block_k(K, x.device), "num_warps": 4}
    _launch(_gate_up_kernel, grid, args, kw, x.device, gather and not dense)
    return y


def expert_down(h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w: torch.Tensor, cb: torch.Tensor | None,
                bits: int, residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                gather: bool = True) -> torch.Tensor:
    """y [M, D] fp16 = sum_j weights[m, j] down_e h[m, j] (+ residual [M, D]) for e = idx[m, j], slots in order."""
    if not isinstance(h, torch.Tensor) or h.dim() != 3:
        raise ValueError(f"h: expected [M, k, F], got {tuple(getattr(h, 'shape', ()))}")
    idx = _check_rows(h, idx, h.device)
    M, ks, F = h.shape
    if idx.shape[1] != ks:
        raise ValueError(f"idx: {idx.shape[1]} slots for h's {ks}")
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (M, ks) or weights.device != h.device:
        raise ValueError(f"weights: expected [{M}, {ks}] on {h.device}")
    weights = weights.float().contiguous()
    dense, kb, swe, sce = _stack(w, cb, bits, F, "w")
    if w.device != h.device or (cb is not None and cb.device != h.device):
        raise ValueError("w: the stack must be on h's device")
    N = w.shape[1]
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.dtype != torch.float16 or \
                tuple(residual.shape) != (M, N) or residual.device != h.device:
            raise ValueError(f"residual: expected float16 [{M}, {N}] on {h.device}")
        residual = residual.contiguous()
    y = torch.empty(M, N, dtype=torch.float16, device=h.device) if out is None else out
    if y.dtype != torch.float16 or tuple(y.shape) != (M, N) or not y.is_contiguous():
        raise ValueError(f"out: expected a contiguous float16 [{M}, {N}] tensor")
    bn = _block_n(dense, h.device)
    args = (h, idx, weights, w, cb if cb is not None else w, residual if residual is not None else y, y, N, F, kb,
            swe, sce)
    kw = {"KS": ks, "DENSE": dense, "BITS": bits if not dense else 4, "HAS_RES": residual is not None,
          "BLOCK_N": bn, "BLOCK_K": triton_block_k(F, h.device), "num_warps": 4}
    _launch(_down_kernel, (triton.cdiv(N, bn), M), args, kw, h.device, gather and not dense)
    return y
