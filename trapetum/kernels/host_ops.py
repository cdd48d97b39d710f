"""Host (CPU) ops of a decode step, in C (host/codebook_host.c, host/cpu_step.c; one library with the GEMV of
kernels/host_gemv.py, built the same way): the CPU executor's (models/cpu_ops.py) few calls per layer.

    FusedGemv(parts)      several per-row codebook weights of one input in one call (q/k/v, gate/up; each part's
                          tables in either storage of kernels/host_gemv.py; or, bits ggml_host.BITS, GGUF block
                          weights of any legacy types, kernels/ggml_host.py): their
                          outputs side by side (per-row codebooks concatenate), then per element + bias, and
                          either + residual or act(gate) * up (SiLU, GELU tanh) -> fp32 [M, N] or [M, F];
                          ``norm=(w, eps, offset)``: of rmsnorm(x) instead of x, in the same call
    rmsnorm(x, w, ...)    RMSNorm of fp32 rows (mean of squares in double)
    rope_kv(...)          RoPE of q and k rows, k and v appended to an fp32 cache [Hkv, S, hd] (strided)
    attend(...)           rope_kv, then each row's causal attention over the cache (sliding window, softcap)
    attend_fused(qkv, ..) attend of q, k, v read out of the fused q/k/v rows by offsets (no views)
    GemvPass(calls, t)    several FusedGemv calls back to back in one C call (no Python between them)
    DenseLayer(...)       a whole dense layer in one call: norm + q/k/v, attend_fused, o + residual, norm +
                          gate/up, down + residual (these calls one by one: the same bits)

Contracts (tests/test_host_ops.py): FusedGemv's outputs are bitwise the single-weight GEMV's
(``codebook_gemv_host``) plus the epilogue's fp32 adds, so batch-invariant and the same for every thread count;
with ``norm`` they are bitwise ``rmsnorm`` then the call without it;
RoPE is the reference's elementwise arithmetic (bitwise ``Rotary.apply`` in fp32); the activation and the norm
round differently from torch (within fp32 rounding of the float64 reference: ``reference_*`` below).
Every tensor is fp32 (codes uint8, codebooks fp16) on the CPU with unit stride along its last dim.
"""
from __future__ import annotations

import ctypes
import math

import torch

from . import host_gemv as hg
from . import ggml_host as gh

ACTS = {"silu": 1, "gelu_tanh": 2}


def _lib():
    lib = hg.library()
    if lib is None:
        raise RuntimeError(f"host kernels unavailable: {hg.error()}")
    return lib


def _check_rows(name: str, t: torch.Tensor, cols: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or t.shape[1] != cols or t.stride(1) != 1:
        raise ValueError(f"host ops: {name} must be fp32 [M, {cols}] on the CPU with unit column stride, "
                         f"got {t.dtype} {tuple(t.shape)}")


class FusedGemv:
    """y = x [W_0; W_1; ...]^T in one call. ``parts``: (codes uint8 [N_i, packed], tables (fp16 [N_i, 2**bits],
    ``hg.SharedTables``, or for the int8 numerics ``hg.Int8Tables`` / 8-bit ``hg.Int8Weights``: every part or none), bias fp32 [N_i] or
    None) of one bit width and ``in_features``; referenced, not copied
    (the codes stay where they were loaded). ``act``: None, or "silu" / "gelu_tanh" over two parts of equal N (gate, up)."""

    def __init__(self, parts, bits: int, in_features: int, act: str | None = None):
        self._lib = _lib()
        if not 1 <= len(parts) <= 4:
            raise ValueError(f"host ops: a fused GEMV takes 1 to 4 weights, got {len(parts)}")
        blocks = bits == gh.BITS  # GGUF block weights (kernels/ggml_host.py): parts (blocks, GgmlWeight, bias)
        if bits not in hg.HOST_BITS and not blocks:
            raise ValueError(f"host ops: {bits}-bit codes are not supported (supported: {hg.HOST_BITS})")
        K = int(in_features)
        for codes, cb, _ in parts:  # the single-weight checks (shapes, dtypes, strides)
            if blocks:
                if not isinstance(cb, gh.GgmlWeight) or cb.in_features != K or cb.blocks is not codes:
                    raise ValueError(f"host ops: GGUF block parts are (blocks, GgmlWeight of K = {K}, bias)")
                gh.check_weight(cb)
            else:
                hg.check_weight(codes, cb, bits, K)
        self.act = 0 if act is None else ACTS[act]
        if self.act and (len(parts) != 2 or parts[0][0].shape[0] != parts[1][0].shape[0]):
            raise ValueError("host ops: an activation takes two weights (gate, up) of equal rows")
        self.parts, self.bits, self.in_features = list(parts), int(bits), K
        self.n = sum(int(c.shape[0]) for c, _, _ in parts)
        self.out_features = self.n // 2 if self.act else self.n
        int8 = [isinstance(cb, (hg.Int8Tables, hg.Int8Weights)) for _, cb, _ in parts]
        if any(int8) and not all(int8):
            raise ValueError("host ops: a fused GEMV's weights take one numerics (all int8 tables or none)")
        self.int8 = all(int8)
        flat = []
        for codes, cb, _ in parts:  # tp_gemv_multi's segments (8 longs each)
            flat += gh.segment(cb) if blocks else hg.segment(codes, cb)
        self._segs = (ctypes.c_long * len(flat))(*flat)
        if any(b is not None for _, _, b in parts):
            self.bias = torch.cat([(b if b is not None else torch.zeros(c.shape[0])).to(torch.float32)
                                   for c, _, b in parts]).contiguous()
        else:
            self.bias = None
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()
        self._fn, self._fn_norm = self._lib.tp_gemv_multi, self._lib.tp_gemv_multi_norm

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 threads: int | None = None, norm: tuple | None = None) -> torch.Tensor:
        """x fp32 [M, K] -> out fp32 [M, out_features] (+ residual [M, out_features] where given; not with an
        activation). ``norm``: (weight fp32 [K] contiguous, eps, offset): the GEMV reads rmsnorm(x)."""
        _check_rows("x", x, self.in_features)
        if norm is not None and (norm[0].dtype != torch.float32 or not norm[0].is_contiguous()
                                 or tuple(norm[0].shape) != (self.in_features,)):
            raise ValueError(f"host ops: the norm weight must be contiguous fp32 [{self.in_features}]")
        M = x.shape[0]
        if out is None:
            out = torch.empty(M, self.out_features, dtype=torch.float32)
        _check_rows("out", out, self.out_features)
        if out.shape[0] != M:
            raise ValueError(f"host ops: out must have {M} rows, got {out.shape[0]}")
        if residual is not None:
            if self.act:
                raise ValueError("host ops: a residual does not combine with an activation")
            _check_rows("residual", residual, self.out_features)
            if residual.shape[0] != M:
                raise ValueError(f"host ops: residual must have {M} rows, got {residual.shape[0]}")
        t = torch.get_num_threads() if threads is None else int(threads)
        if t < 1:
            raise ValueError(f"host ops: threads must be at least 1, got {t}")
        return self.run(x, out, residual, t, None if norm is None else (norm[0].data_ptr(), norm[1], norm[2]))

    def run(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None, threads: int,
            norm: tuple | None = None) -> torch.Tensor:
        """``__call__`` without the argument checks (the CPU executor's own buffers); ``norm``: (weight pointer,
        eps, offset) or None."""
        res, ldr = (None, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
        if norm is None:
            rc = self._fn(x.data_ptr(), x.stride(0), x.shape[0], self.in_features, len(self.parts), self._segs,
                          self.bits, out.data_ptr(), out.stride(0), self._bias_ptr, res, ldr, self.act, threads, -1)
        else:
            rc = self._fn_norm(x.data_ptr(), x.stride(0), x.shape[0], self.in_features, norm[0], float(norm[2]),
                               float(norm[1]), len(self.parts), self._segs, self.bits, out.data_ptr(), out.stride(0),
                               self._bias_ptr, res, ldr, self.act, threads, -1)
        if rc != 0:
            raise RuntimeError(f"host fused GEMV failed (code {rc})")
        return out


class _MultiCall(ctypes.Structure):  # host/codebook_host.c's tp_multi_call_t
    _fields_ = [("x", ctypes.c_void_p)] + [(n, ctypes.c_long) for n in ("ldx", "M", "K", "nseg")] + [
        ("segs", ctypes.c_void_p), ("bits", ctypes.c_long), ("y", ctypes.c_void_p), ("ldy", ctypes.c_long),
        ("bias", ctypes.c_void_p), ("res", ctypes.c_void_p)] + [
        (n, ctypes.c_long) for n in ("ldr", "act", "threads", "path")]


class GemvPass:
    """Several FusedGemv calls run back to back by one C call (``tp_gemv_multi_list``), as the CPU step's C code
    calls them: ``calls`` (FusedGemv, x fp32 [M, K], out fp32 [M, out_features]) with no residual or norm, checked
    here once; ``run()`` then has no Python between the GEMVs (bench_cpu's step GEMV pass). The tensors are
    referenced, not copied: keep them alive and in place."""

    def __init__(self, calls, threads: int):
        if int(threads) < 1:
            raise ValueError(f"host ops: threads must be at least 1, got {threads}")
        self._lib, self._keep = _lib(), list(calls)
        rows = []
        for f, x, out in self._keep:
            _check_rows("x", x, f.in_features)
            _check_rows("out", out, f.out_features)
            if out.shape[0] != x.shape[0]:
                raise ValueError(f"host ops: out must have {x.shape[0]} rows, got {out.shape[0]}")
            rows.append(_MultiCall(x.data_ptr(), x.stride(0), x.shape[0], f.in_features, len(f.parts),
                                   ctypes.addressof(f._segs), f.bits, out.data_ptr(), out.stride(0), f._bias_ptr,
                                   None, 0, f.act, int(threads), -1))
        self._calls = (_MultiCall * len(rows))(*rows)

    def run(self) -> None:
        rc = self._lib.tp_gemv_multi_list(self._calls, len(self._keep))
        if rc != 0:
            raise RuntimeError(f"host fused GEMV pass failed (code {rc})")


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 0.0,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """x fp32 [R, D] -> fp32 [R, D] (out may be x)."""
    D = w.shape[0]
    _check_rows("x", x, D)
    if w.dtype != torch.float32 or not w.is_contiguous():
        raise ValueError("host ops: the norm weight must be contiguous fp32")
    out = torch.empty_like(x) if out is None else out
    _check_rows("out", out, D)
    if _lib().tp_rmsnorm(x.data_ptr(), x.stride(0), x.shape[0], D, w.data_ptr(), float(offset), float(eps),
                         out.data_ptr(), out.stride(0)) != 0:
        raise RuntimeError("host rmsnorm failed")
    return out


def _check_rope(q, k, v, cos, sin, kc, vc, start, qo):
    M, Hq, hd = q.shape
    Hkv = k.shape[1]
    for name, t, h in (("q", q, Hq), ("k", k, Hkv), ("v", v, Hkv)):
        if t.dtype != torch.float32 or tuple(t.shape) != (M, h, hd) or t.stride(2) != 1 or t.stride(1) != hd:
            raise ValueError(f"host ops: {name} must be fp32 [{M}, {h}, {hd}] with contiguous heads")
    rd = cos.shape[-1]
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or tuple(t.shape) != (M, rd) or not t.is_contiguous():
            raise ValueError(f"host ops: {name} must be contiguous fp32 [{M}, {rd}]")
    for name, t in (("kc", kc), ("vc", vc)):
        if t.dtype != torch.float32 or t.dim() != 3 or t.shape[0] != Hkv or t.shape[2] != hd or t.stride(2) != 1:
            raise ValueError(f"host ops: {name} must be fp32 [{Hkv}, S, {hd}] with unit stride along hd")
    if kc.stride() != vc.stride() or not 0 <= start <= kc.shape[1] - M:
        raise ValueError(f"host ops: positions {start}..{start + M - 1} outside the cache of {kc.shape[1]}")
    qo = torch.empty(M, Hq, hd, dtype=torch.float32) if qo is None else qo
    if qo.dtype != torch.float32 or tuple(qo.shape) != (M, Hq, hd) or not qo.is_contiguous():
        raise ValueError(f"host ops: qo must be contiguous fp32 [{M}, {Hq}, {hd}]")
    return qo


def rope_kv(q, k, v, cos, sin, kc, vc, start: int, interleave: bool = False, qo=None):
    """q [M, Hq, hd], k / v [M, Hkv, hd] (rows of any stride, heads contiguous), cos / sin fp32 [M, rd] (row m:
    position start + m); kc / vc fp32 [Hkv, S, hd] (unit stride along hd). Writes RoPE(k) and v at start .. start
    + M - 1 of the cache; returns RoPE(q) fp32 [M, Hq, hd] (into ``qo`` where given)."""
    qo = _check_rope(q, k, v, cos, sin, kc, vc, start, qo)
    M, Hq, hd = q.shape
    Hkv, rd = k.shape[1], cos.shape[-1]
    rc = _lib().tp_rope_kv(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), M, Hq,
                           Hkv, hd, rd, int(bool(interleave)), cos.data_ptr(), sin.data_ptr(), kc.data_ptr(),
                           vc.data_ptr(), kc.stride(0), kc.stride(1), int(start), qo.data_ptr())
    if rc != 0:
        raise RuntimeError("host rope failed")
    return qo


def attend(q, k, v, cos, sin, kc, vc, start: int, scale: float, interleave: bool = False, window: int | None = None,
           softcap: float | None = None, qo=None, out=None, checked: bool = True):
    """``rope_kv``, then row m's attention over cache positions up to start + m (the last ``window`` of them where
    given; scores times ``scale``, softcapped where given) -> fp32 [M, Hq * hd] (into ``out``). ``checked``
    False: no argument checks (the CPU executor's own buffers)."""
    M, Hq, hd = q.shape
    Hkv, rd = k.shape[1], cos.shape[-1]
    if checked:
        qo = _check_rope(q, k, v, cos, sin, kc, vc, start, qo)
        if Hq % Hkv:
            raise ValueError(f"host ops: {Hq} query heads over {Hkv} kv heads")
        if out is not None:
            _check_rows("out", out, Hq * hd)
    elif qo is None:
        qo = torch.empty(M, Hq, hd, dtype=torch.float32)
    out = torch.empty(M, Hq * hd, dtype=torch.float32) if out is None else out
    rc = _lib().tp_attend(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), M, Hq,
                          Hkv, hd, rd, int(bool(interleave)), cos.data_ptr(), sin.data_ptr(), kc.data_ptr(),
                          vc.data_ptr(), kc.stride(0), kc.stride(1), int(start), int(window or 0), float(scale),
                          float(softcap or 0.0), qo.data_ptr(), out.data_ptr(), out.stride(0), -1)
    if rc != 0:
        raise RuntimeError(f"host attention failed (code {rc})")
    return out


def attend_fused(qkv, Hq: int, Hkv: int, hd: int, cos, sin, kc, vc, start: int, scale: float, interleave: bool,
                 window: int | None, softcap: float | None, qo) -> torch.Tensor:
    """``attend`` of q, k, v read out of fused q/k/v rows fp32 [M, (Hq + 2 Hkv) hd] (unit column stride), q at
    column 0, k at Hq hd, v at (Hq + Hkv) hd; ``qo`` the scratch fp32 [M, Hq, hd]; no argument checks (the CPU
    executor's own buffers, its cache checked when the pass starts)."""
    M, ld = qkv.shape[0], qkv.stride(0)
    base = qkv.data_ptr()
    out = torch.empty(M, Hq * hd)
    rc = _lib().tp_attend(base, ld, base + 4 * Hq * hd, ld, base + 4 * (Hq + Hkv) * hd, ld, M, Hq, Hkv, hd,
                          cos.shape[-1], int(bool(interleave)), cos.data_ptr(), sin.data_ptr(), kc.data_ptr(),
                          vc.data_ptr(), kc.stride(0), kc.stride(1), int(start), int(window or 0), float(scale),
                          float(softcap or 0.0), qo.data_ptr(), out.data_ptr(), out.stride(0), -1)
    if rc != 0:
        raise RuntimeError(f"host attention failed (code {rc})")
    return out


class _LayerArgs(ctypes.Structure):  # host/cpu_step.c's tp_layer_t
    _fields_ = [(n, ctypes.c_long) for n in ("D", "Hq", "Hkv", "hd", "F", "window")] + [
        ("n1w", ctypes.c_void_p), ("n2w", ctypes.c_void_p)] + [
        (n, ctypes.c_float) for n in ("n1off", "n1eps", "n2off", "n2eps", "scale", "softcap")] + [
        ("act", ctypes.c_int), ("bits", ctypes.c_int * 4), ("nseg", ctypes.c_int * 4),
        ("segs", ctypes.c_void_p * 4), ("bias", ctypes.c_void_p * 4)]


class DenseLayer:
    """x + MLP(x + Attn(x)) of one dense layer in one C call. ``qkv, o, gate_up, down``: FusedGemv (gate_up with
    its activation, o and down without); ``norm1`` / ``norm2``: (weight fp32 [D] contiguous, eps, offset);
    Hq, Hkv, hd the heads; ``window`` (None: none), ``scale``, ``softcap`` (None: none) as ``attend``'s.
    ``__call__(x, cos, sin, interleave, kc, vc, start, threads)``: x fp32 [M, D] (unit column stride), the rest
    as ``attend``'s (kc / vc [Hkv, S, hd]) -> fp32 [M, D]; no argument checks (the CPU executor's buffers)."""

    def __init__(self, qkv: FusedGemv, o: FusedGemv, gate_up: FusedGemv, down: FusedGemv, norm1, norm2, Hq: int,
                 Hkv: int, hd: int, window, scale: float, softcap):
        D = qkv.in_features
        if (qkv.act or o.act or down.act or not gate_up.act or qkv.out_features != (Hq + 2 * Hkv) * hd
                or o.in_features != Hq * hd or o.out_features != D or gate_up.in_features != D
                or down.in_features != gate_up.out_features or down.out_features != D):
            raise ValueError("host ops: the layer's GEMVs do not chain (q/k/v, o, gate/up, down)")
        for w, _, _ in (norm1, norm2):
            if w.dtype != torch.float32 or not w.is_contiguous() or tuple(w.shape) != (D,):
                raise ValueError(f"host ops: the norm weights must be contiguous fp32 [{D}]")
        self._keep = (qkv, o, gate_up, down, norm1, norm2)
        a = self.args = _LayerArgs(D=D, Hq=Hq, Hkv=Hkv, hd=hd, F=gate_up.out_features, window=int(window or 0),
                                   n1w=norm1[0].data_ptr(), n2w=norm2[0].data_ptr(), n1off=float(norm1[2]),
                                   n1eps=float(norm1[1]), n2off=float(norm2[2]), n2eps=float(norm2[1]),
                                   scale=float(scale), softcap=float(softcap or 0.0), act=gate_up.act)
        for i, f in enumerate((qkv, o, gate_up, down)):
            a.bits[i], a.nseg[i] = f.bits, len(f.parts)
            a.segs[i] = ctypes.cast(f._segs, ctypes.c_void_p).value
            a.bias[i] = f._bias_ptr
        self.D, self._ref, self._fn = D, ctypes.addressof(a), _lib().tp_dense_layer

    def __call__(self, x, cos, sin, interleave: bool, kc, vc, start: int, threads: int) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.D)
        rc = self._fn(self._ref, x.data_ptr(), x.stride(0), x.shape[0], out.data_ptr(), out.stride(0), cos.shape[-1],
                      int(interleave), cos.data_ptr(), sin.data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.stride(-3),
                      kc.stride(-2), int(start), int(threads))
        if rc != 0:
            raise RuntimeError(f"host layer failed (code {rc})")
        return out


def reference_attend(q, kc, vc, start: int, scale: float, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """float64 attention of already rotated q [M, Hq, hd] over a filled cache [Hkv, S, hd]: row m over positions
    up to start + m (its window) -> [M, Hq * hd]."""
    M, Hq, hd = q.shape
    Hkv = kc.shape[0]
    rows = []
    for m in range(M):
        S = start + m + 1
        lo = max(0, S - window) if window else 0
        kk = kc[:, lo:S].double().repeat_interleave(Hq // Hkv, 0)
        vv = vc[:, lo:S].double().repeat_interleave(Hq // Hkv, 0)
        s = (kk @ q[m].double()[:, :, None])[..., 0] * scale  # [Hq, L]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        rows.append((torch.softmax(s, -1)[:, None, :] @ vv)[:, 0].reshape(-1))
    return torch.stack(rows)


def reference_act(g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
    """float64 act(g) * u."""
    g, u = g.double(), u.double()
    if act == "silu":
        return g / (1 + torch.exp(-g)) * u
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * u


def reference_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """float64 RMSNorm."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + offset)
