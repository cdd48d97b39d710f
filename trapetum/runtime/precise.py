"""Precise prefill: the engine's prompt pass at fp32-reference accuracy, for evaluation runs.

Opt-in (``TRAPETUM_PREFILL=precise``, ``GpuEngine(..., precise_prefill=True)``,
``trapetum.load(..., device="cuda", precise_prefill=True)``, ``--precise-prefill`` on ``trapetum ppl``
and ``trapetum generate``); the default prefill and the decode step are unchanged.

What differs from the default prefill (runtime/engine.py), step by step:
  GEMM inputs   fp32 activations split per row into two fp16 terms: x = 2^e (hi + lo / 2^12) with
                hi = fp16(x / 2^e), lo = fp16((x / 2^e - hi) * 2^12), |x / 2^e| < 1 (e from the row's
                largest entry, so neither term meets fp16's range limits); [hi; lo] @ W^T is one
                fp16 tensor-core GEMM of 2T rows with fp32 output (torch.mm(..., out_dtype=fp32)).
                Error ~2^-23 of the row's scale, as an fp32 GEMM; cost 2x the default GEMM.
  weights       the engine's fp16 copy W16 (exact for codebook / .cbk weights). Where the decoder it
                was built from holds weights that are not fp16 numbers (a GGUF source dequantized to
                fp32; trapetum.load(..., precise_prefill=True) keeps the decoder in fp32 for this), a
                residual Wlo = fp16((W - W16) * 2^12) is stored at build time and hi @ Wlo^T added
                (a third GEMM of T rows). Same for the embedding rows and biases.
  GEMM outputs  fp32 (default: fp16).
  RMSNorm       fp32 output (default: fp16).
  RoPE, attn    fp32 q/k/v, fp32 scores, softmax and P@V, fp32 output (default: fp16 q/k/v, flash
                attention with fp16 P). The KV cache still receives fp16 K/V for the decode steps.
  activation    act(gate) * up in fp32 (default: fp16 output).
  residual      fp32, as the default.
TF32 is switched off for the duration of a precise prefill. Additive (AQLM) projections are not
supported yet (their prefill GEMM has no fp32-output hook): the engine refuses to build.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

from ..errors import ConfigError, UnsupportedError

ENV = "TRAPETUM_PREFILL"
MODES = ("default", "precise")
LO_SCALE = 4096.0  # 2^12: the lo term (< half an fp16 ulp of hi) scaled back into fp16's normal range


def precise_enabled(arg: bool | None = None) -> bool:
    """The prefill mode: ``arg`` when given, else TRAPETUM_PREFILL (unset/''/'default' or 'precise')."""
    if arg is not None:
        return bool(arg)
    v = os.environ.get(ENV, "").strip().lower()
    if v in ("", "default"):
        return False
    if v == "precise":
        return True
    raise ConfigError(f"{ENV} must be one of {', '.join(MODES)} (or unset), got {os.environ[ENV]!r}")


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


def residual16(exact: torch.Tensor, hi: torch.Tensor) -> torch.Tensor | None:
    """fp16((exact - hi) * 2^12), or None when ``exact`` is ``hi`` in fp16 (nothing to add)."""
    if exact.dtype == torch.float16:
        return None
    d = exact.to(device=hi.device, dtype=torch.float32) - hi.float()
    if not bool(d.any()):
        return None
    return (d * LO_SCALE).to(torch.float16)


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


# ----------------------------------------------------------------------------- the prefill
class PrecisePrefill:
    """Residuals of the engine's fp16 weights against the decoder's (built once), and the prefill."""

    def __init__(self, engine, decoder):
        self.res: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(fp16 tensor) -> (it, residual)
        self._shared: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        m = decoder.model
        for L, blk in zip(engine.layers, m.layers):
            a, mlp = blk.self_attn, blk.mlp
            groups = [[a.q_proj, a.k_proj, a.v_proj]] if len(L.qkv) == 1 else [[a.q_proj], [a.k_proj], [a.v_proj]]
            for p, mods in zip(L.qkv, groups):
                self._attach(p, mods)
            self._attach(L.o, [a.o_proj])
            gu = L.gate_up
            if gu.interleaved is not None:
                self._attach(gu.interleaved, [mlp.gate_proj, mlp.up_proj])
            elif gu.separate is not None:
                self._attach(gu.separate[0], [mlp.gate_proj])
                self._attach(gu.separate[1], [mlp.up_proj])
            else:
                self._attach(gu.joint, [mlp.gate_proj, mlp.up_proj])
            self._attach(L.down, [mlp.down_proj])
        self._attach(engine.head, [decoder.lm_head])
        self.embed_lo = self._residual(m.embed_tokens.dequantize(), engine.embed)
        self._shared.clear()

    def _residual(self, exact: torch.Tensor, hi: torch.Tensor) -> torch.Tensor | None:
        """residual16, computed once per source tensor (a tied head and embedding share one)."""
        key = (exact.data_ptr(), tuple(exact.shape), exact.dtype)
        got = self._shared.get(key)
        if got is not None:
            return got[1]
        lo = residual16(exact, hi)
        self._shared[key] = (exact, lo)  # holds `exact` while building, so that its address stays its own
        return lo

    def _attach(self, p, mods) -> None:
        kind = getattr(p, "kind", None)
        if kind == "additive":
            raise UnsupportedError("precise prefill: additive (AQLM) projections are not supported yet; "
                                   f"unset {ENV} / precise_prefill")
        if kind == "fp16":  # codebook projections: their dequantized fp16 weights are the exact ones
            exact = mods[0].dequantize() if len(mods) == 1 else torch.cat([x.dequantize() for x in mods])
            lo = self._residual(exact, p.w) if len(mods) == 1 else residual16(exact, p.w)
            if lo is not None:
                self.res[id(p.w)] = (p.w, lo)
        if p.bias is not None:
            b = torch.cat([x.bias.data if getattr(x, "bias", None) is not None
                           else torch.zeros(x.out_features, device=p.bias.device) for x in mods])
            blo = residual16(b, p.bias)
            if blo is not None:
                self.res[id(p.bias)] = (p.bias, blo)

    def _lo(self, t: torch.Tensor | None) -> torch.Tensor | None:
        got = self.res.get(id(t)) if t is not None else None
        return got[1] if got is not None and got[0] is t else None

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T + b in fp32 from fp32 x [T, K] and the engine's fp16 W [N, K] (+ its residual)."""
        T = x.shape[0]
        hilo, e = split16(x)
        y = mm32(hilo, w.t())
        y = y[:T] + y[T:] * (1.0 / LO_SCALE)
        wlo = self._lo(w)
        if wlo is not None:
            y = y + mm32(hilo[:T], wlo.t()) * (1.0 / LO_SCALE)
        y = torch.ldexp(y, e)
        if bias is not None:
            y = y + bias.float()
            blo = self._lo(bias)
            if blo is not None:
                y = y + blo.float() * (1.0 / LO_SCALE)
        return y

    @torch.inference_mode()
    def prefill(self, eng, tokens: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """GpuEngine.prefill's data path in fp32 activations (see the module docstring)."""
        with no_tf32():
            return self._prefill(eng, tokens, all_logits)

    def _prefill(self, eng, tokens, all_logits):
        cfg = eng.cfg
        T = tokens.numel()
        Hq, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        mm = self.linear
        x = eng.embed[tokens].float()
        if self.embed_lo is not None:
            x = x + self.embed_lo[tokens].float() * (1.0 / LO_SCALE)
        if cfg.embed_scale is not None:
            x = x * cfg.embed_scale
        qd, kd = Hq * hd, Hkv * hd
        for li, L in enumerate(eng.layers):
            h = rmsnorm32(x, L.in_norm, eps, off)
            qkv = torch.cat([p.matmul(h, mm=mm) for p in L.qkv], dim=1) if len(L.qkv) > 1 else L.qkv[0].matmul(h, mm=mm)
            q = qkv[:, :qd].reshape(T, Hq, hd)
            k = qkv[:, qd:qd + kd].reshape(T, Hkv, hd)
            v = qkv[:, qd + kd:].reshape(T, Hkv, hd)
            if L.q_norm is not None:
                q = rmsnorm32(q, L.q_norm, eps, off)
                k = rmsnorm32(k, L.k_norm, eps, off)
            cos, sin = eng.rope_local if L.sliding else eng.rope
            q, k = rope32(q, cos[:T], sin[:T]), rope32(k, cos[:T], sin[:T])
            eng.k_cache[li, :, :T].copy_(k.transpose(0, 1))  # fp16 K/V for the decode steps
            eng.v_cache[li, :, :T].copy_(v.transpose(0, 1))
            a = attention32(q, k, v, cfg.scale, cfg.sliding_window if L.sliding else None, cfg.attn_softcap)
            o = L.o.matmul(a, mm=mm)
            if L.post_attn is not None:
                o = rmsnorm32(o, L.post_attn, eps, off)
            x = x + o
            h = rmsnorm32(x, L.ffn_norm, eps, off)
            d = L.down.matmul(L.gate_up.matmul(h, mm=mm), mm=mm)
            if L.post_ffn is not None:
                d = rmsnorm32(d, L.post_ffn, eps, off)
            x = x + d
        h = rmsnorm32(x if all_logits else x[-1:], eng.final_norm, eps, off)
        logits = eng.head.matmul(h, mm=mm)
        logits = logits if all_logits else logits[0]
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits
