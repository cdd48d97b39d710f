"""Precise prefill: the engine's prompt pass at fp32-reference accuracy, for evaluation runs.

Opt-in (``Options.prefill = "precise"``: TRAPETUM_PREFILL=precise, ``trapetum.load(..., device="cuda",
precise_prefill=True)``, ``--precise-prefill`` on ``trapetum ppl`` and ``trapetum generate``); the default prefill
and the decode step are unchanged. ``PreciseOps`` is the engine's executor of the model's blocks in this mode
(models/blocks: the same data path as every other executor, with fp32 arithmetic).

What differs from the default prefill (runtime/engine.py), step by step:
  GEMM inputs   fp32 activations split per row into two fp16 terms: x = 2^e (hi + lo / 2^12) with
                hi = fp16(x / 2^e), lo = fp16((x / 2^e - hi) * 2^12), |x / 2^e| < 1 (e from the row's
                largest entry, so neither term meets fp16's range limits); [hi; lo] @ W^T is one
                fp16 tensor-core GEMM of 2T rows with fp32 output (torch.mm(..., out_dtype=fp32)).
                Error ~2^-23 of the row's scale, as an fp32 GEMM; cost 2x the default GEMM.
  weights       the engine's fp16 copy W16 (exact for codebook / .cbk weights). Where the checkpoint holds
                weights that are not fp16 numbers (fp32 / bf16 sources, a GGUF dequantized to fp32), the
                schemes keep a residual Wlo = fp16((W - W16) * 2^12) (``Projection.lo``, built with the engine)
                and hi @ Wlo^T is added (a third GEMM of T rows). Same for the embedding rows and biases.
  GEMM outputs  fp32 (default: fp16).
  RMSNorm       fp32 output (default: fp16).
  RoPE, attn    fp32 q/k/v, fp32 scores, softmax and P@V, fp32 output (default: fp16 q/k/v, flash
                attention with fp16 P). The KV cache still receives fp16 K/V for the decode steps.
  activation    act(gate) * up in fp32 (default: fp16 output).
  residual      fp32, as the default.
TF32 is switched off for the duration of a precise prefill. Additive (AQLM) projections are not
supported yet (their fp16 dequantization is not exact): the engine refuses to build.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..models.batch import ForwardBatch, Mode
from ..schemes.base import LO_SCALE
from .engine_ops import EngineOps


# ----------------------------------------------------------------------------- arithmetic
_OUT_DTYPE_MM: bool | None = None  # torch.mm(..., out_dtype=float32) works on CUDA (torch >= 2.8)


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp16 [M, K] @ fp16 [K, N] -> fp32 [M, N], exact products accumulated in fp32.

    CUDA: cuBLAS with fp32 output (no fp16 rounding of the result or of split-K partial sums). Elsewhere
    (or on a torch without ``out_dtype``): the same products in an fp32 GEMM (fp16 x fp16 is exact in fp32)."""
    global _OUT_DTYPE_MM
    if a.is_cuda and _OUT_DTYPE_MM is not False:
        try:
            y = torch.mm(a, b, out_dtype=torch.float32)
            _OUT_DTYPE_MM = True
            return y
        except (TypeError, RuntimeError):
            if _OUT_DTYPE_MM:
                raise
            _OUT_DTYPE_MM = False
    return torch.mm(a.float(), b.float())


def split16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 [T, K] -> (hilo fp16 [2T, K] = [hi; lo], e int32 [T, 1]) with x = 2^e (hi + lo / 2^12)."""
    x = x.float()
    _, e = torch.frexp(x.abs().amax(-1, keepdim=True))
    e = e.clamp(-100, 100)  # keep 2^-e finite in fp32 (rows of all-tiny / all-huge entries)
    xs = torch.ldexp(x, -e)  # |xs| < 1
    hi = xs.to(torch.float16)
    lo = ((xs - hi.float()) * LO_SCALE).to(torch.float16)  # xs - hi is exact in fp32
    return torch.cat([hi, lo]), e


def rmsnorm32(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.float() + offset)


def act_mul_fp32(g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up in fp32 (the precise prefill's form of kernels.fused.act_mul)."""
    g = g.float()
    if act == "silu":
        a = g * torch.sigmoid(g)
    elif act == "gelu_tanh":
        a = F.gelu(g, approximate="tanh")
    else:
        raise ValueError(f"act: must be 'silu' or 'gelu_tanh', got {act!r}")
    return a * u.float()


def rope32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x fp32 [T, H, D] with cos/sin [T, rot/2] (the first rot features; rest pass)."""
    half = cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]], dim=-1)


def attention32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
                softcap: float | None, budget: int = 1 << 26) -> torch.Tensor:
    """Causal attention in fp32 over one prompt: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq*D].
    Queries in chunks so that a chunk's scores hold at most ``budget`` floats."""
    T, Hq, D = q.shape
    rep = Hq // k.shape[1]
    qh = q.transpose(0, 1)  # [Hq, T, D]
    kh = k.transpose(0, 1).repeat_interleave(rep, 0)
    vh = v.transpose(0, 1).repeat_interleave(rep, 0)
    out = torch.empty(Hq, T, D, dtype=torch.float32, device=q.device)
    step = max(1, budget // max(1, Hq * T))
    pos = torch.arange(T, device=q.device)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        s = torch.matmul(qh[:, t0:t1], kh[:, :t1].transpose(-1, -2)) * scale  # [Hq, c, t1]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        qi, kj = pos[t0:t1, None], pos[None, :t1]
        mask = kj <= qi
        if window is not None:
            mask = mask & (qi - kj < window)
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        out[:, t0:t1] = torch.matmul(p, vh[:, :t1])
    return out.transpose(0, 1).reshape(T, Hq * D)


@contextlib.contextmanager
def no_tf32():
    """fp32 matmuls in IEEE fp32 (TF32 would round their inputs to 10-bit mantissas)."""
    m = torch.backends.cuda.matmul
    saved = m.allow_tf32
    m.allow_tf32 = False
    try:
        yield
    finally:
        m.allow_tf32 = saved


# ----------------------------------------------------------------------------- the executor
def precise_linear(x: torch.Tensor, w: torch.Tensor, bias=None, lo=None, bias_lo=None) -> torch.Tensor:
    """y = x W^T + b in fp32 from fp32 x [T, K] and the engine's fp16 W [N, K] (+ its residuals lo, bias_lo)."""
    T = x.shape[0]
    hilo, e = split16(x)
    y = mm32(hilo, w.t())
    y = y[:T] + y[T:] * (1.0 / LO_SCALE)
    if lo is not None:
        y = y + mm32(hilo[:T], lo.t()) * (1.0 / LO_SCALE)
    y = torch.ldexp(y, e)
    if bias is not None:
        y = y + bias.float()
        if bias_lo is not None:
            y = y + bias_lo.float() * (1.0 / LO_SCALE)
    return y


class PreciseOps(EngineOps):
    """The engine's prompt pass in fp32 activations (module docstring); the KV cache still gets fp16 K/V."""

    def __init__(self, eng):
        super().__init__(eng, Mode.PREFILL)

    def norm(self, x, w, eps=None, feeds=None):
        return rmsnorm32(x, w, self.cfg.rms_norm_eps if eps is None else eps, self.cfg.norm_offset)

    def project(self, w, x, residual=None):
        y = w.matmul(x, precise_linear)
        return y if residual is None else residual + y

    def gate_up(self, w, x, feeds=None):
        return w.matmul(x, precise_linear, act_mul_fp32)

    def embed(self, table, batch: ForwardBatch):
        x = table[batch.tokens].float()
        lo = self.eng.model.embed_lo
        if lo is not None:
            x = x + lo[batch.tokens].float() * (1.0 / LO_SCALE)
        return x * self.cfg.embed_scale if self.cfg.embed_scale is not None else x

    def logits(self, head, h):
        logits = head.matmul(h, precise_linear)
        cap = self.cfg.final_softcap
        return torch.tanh(logits / cap) * cap if cap is not None else logits

    def attend(self, q, k, v, batch: ForwardBatch, p, feeds=None):
        eng, cfg = self.eng, self.cfg
        T = q.shape[0]
        start = int(batch.start)
        if start:
            raise ValueError("precise prefill: the prompt starts at position 0")
        cos, sin = eng.pass_rope(p.sliding, start, T)
        c, s = cos[start:start + T], sin[start:start + T]
        q, k = rope32(q.float(), c, s), rope32(k.float(), c, s)
        eng.kv.k[p.layer, :, start:start + T].copy_(k.transpose(0, 1))  # fp16 K/V for the decode steps
        eng.kv.v[p.layer, :, start:start + T].copy_(v.transpose(0, 1))
        return attention32(q, k, v.float(), cfg.scale, cfg.sliding_window if p.sliding else None, cfg.attn_softcap)
