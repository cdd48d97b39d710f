"""CPU emulation of the GPU engine's prefill arithmetic, to choose a precise-prefill scheme.

    python scripts/sessions/precise_prefill_emulation.py MODEL [MODEL ...]

For each model (GGUF / .cbk / HF directory) and each prompt of scripts/gpu_agreement.py: the relative
error ||emulated - cpu||/||cpu|| of the prompt logits (every position) against the CPU fp32 reference
(trapetum.load(MODEL).logits), for the default engine arithmetic and for candidate precise schemes.

What is emulated (GpuEngine.prefill on the H200; every product is computed in float64 here, so only the
roundings listed remain):
  default  weights fp16 (the engine's copy); residual stream fp32; RMSNorm fp32 math -> fp16;
           GEMMs (cuBLAS, tensor cores) fp16 x fp16 -> fp32 accumulation -> fp16 output (+ fp16 bias);
           RoPE fp32 math -> fp16 q, fp16 K/V cache; SDPA (flash attention): S in fp32 from fp16 q/k,
           P = exp(S - max) rounded to fp16 for P@V, row sums in fp32, output fp16; act(gate)*up fp32
           math -> fp16; head GEMM output fp16.
  knobs    gemm_in  fp16 | split (hi = fp16(x), lo = fp16(x - hi), y = W hi + W lo) | fp32
           gemm_out fp16 | fp32
           attn     fa16 (as above) | fp32 (fp32 q/k/v/P, fp32 output)
           act      fp16 | fp32 (act(gate)*up output)
           weights  fp16 | exact (the reference's fp32 weights; differs from fp16 only for sources whose
                    dequantized weights are not fp16 numbers, e.g. GGUF Q4_1 / Q8_0)
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # scripts/, repo
from gpu_agreement import PROMPTS  # noqa: E402

os.environ["TRITON_INTERPRET"] = "0"  # the engine's kernels run their torch fallbacks on the CPU
import trapetum  # noqa: E402
from trapetum.runtime.engine import GpuEngine  # noqa: E402

F64 = torch.float64


def rnd(x: torch.Tensor, how: str) -> torch.Tensor:
    """Round a float64 tensor to fp16 / fp32 (kept as float64 values)."""
    return x.to(torch.float16 if how in ("fp16", "fa16") else torch.float32).to(F64)


class Emu:
    def __init__(self, model):
        d = self.dec = model.decoder
        self.cfg = d.config
        m = d.model
        self.embed = m.embed_tokens.dequantize().to(F64)
        self.layers = []
        for blk in m.layers:
            a, mlp = blk.self_attn, blk.mlp
            sw = self.cfg.sandwich_norms
            self.layers.append(dict(
                in_norm=blk.input_layernorm.weight.to(F64),
                ffn_norm=(blk.pre_feedforward_layernorm if sw else blk.post_attention_layernorm).weight.to(F64),
                post_attn=blk.post_attention_layernorm.weight.to(F64) if sw else None,
                post_ffn=blk.post_feedforward_layernorm.weight.to(F64) if sw else None,
                q_norm=a.q_norm.weight.to(F64) if a.q_norm is not None else None,
                k_norm=a.k_norm.weight.to(F64) if a.k_norm is not None else None,
                qkv=[self._w(p) for p in (a.q_proj, a.k_proj, a.v_proj)], o=self._w(a.o_proj),
                gate=self._w(mlp.gate_proj), up=self._w(mlp.up_proj), down=self._w(mlp.down_proj)))
        self.norm = m.norm.weight.to(F64)
        self.head = self._w(d.lm_head)

    @staticmethod
    def _w(mod):
        w = mod.dequantize().to(F64)
        b = getattr(mod, "bias", None)
        return w, (None if b is None else b.data.to(F64))

    def rmsnorm(self, x, w):
        c = self.cfg
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * (w + c.norm_offset)

    def gemm(self, x, wb, s):
        """x float64 values (already rounded by its producer), W [N, K]."""
        w, b = wb
        if s["weights"] == "fp16":
            w = rnd(w, "fp16")
        if s["gemm_in"] == "fp16":
            y = rnd(x, "fp16") @ w.T
        elif s["gemm_in"] == "split":
            hi = rnd(x, "fp16")
            lo = rnd(x - hi, "fp16")
            y = hi @ w.T + lo @ w.T
        else:
            y = rnd(x, "fp32") @ w.T
        if b is not None:
            y = y + (rnd(b, "fp16") if s["weights"] == "fp16" else b)
        return rnd(y, s["gemm_out"])

    def rope(self, x, pos, theta_inv):
        half = theta_inv.numel()
        f = torch.outer(pos.to(F64), theta_inv.to(F64))
        c, sn = f.cos().float().to(F64)[:, None, :], f.sin().float().to(F64)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:2 * half]
        out = x.clone()
        out[..., :half] = x1 * c - x2 * sn
        out[..., half:2 * half] = x2 * c + x1 * sn
        return out

    def attention(self, q, k, v, sliding, s):
        """q [T, Hq, hd], k/v [T, Hkv, hd] -> [T, Hq*hd]."""
        c = self.cfg
        T, Hq, hd = q.shape
        rep = Hq // c.num_kv_heads
        kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        sc = torch.einsum("thd,shd->hts", q, kk) * c.scale
        if c.attn_softcap is not None:
            sc = torch.tanh(sc / c.attn_softcap) * c.attn_softcap
        i = torch.arange(T)
        mask = i[None, :] <= i[:, None]
        if sliding:
            mask = mask & (i[:, None] - i[None, :] < c.sliding_window)
        sc = sc.masked_fill(~mask, float("-inf"))
        p = (sc - sc.amax(-1, keepdim=True)).exp()
        l_ = p.sum(-1, keepdim=True)
        if s["attn"] == "fa16" and c.attn_softcap is None:
            p = rnd(p, "fp16")  # flash attention's P operand of P@V
        o = torch.einsum("hts,shd->thd", p, vv) / l_.transpose(0, 1)
        return rnd(o.reshape(T, Hq * hd), "fp16" if s["attn"] == "fa16" else "fp32")

    def logits(self, ids, s):
        c = self.cfg
        toks = torch.as_tensor(ids)
        T = toks.numel()
        x = self.embed[toks]
        x = rnd(x, "fp16") if s["weights"] == "fp16" else x
        x = rnd(x, "fp32")
        if c.embed_scale is not None:
            x = x * rnd(torch.tensor(c.embed_scale, dtype=F64), "fp16")
        Hq, Hkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        qd, kd = Hq * hd, Hkv * hd
        pos = torch.arange(T)
        act = (lambda g: g * torch.sigmoid(g)) if c.hidden_act == "silu" else \
            (lambda g: torch.nn.functional.gelu(g, approximate="tanh"))
        kv16 = s["attn"] == "fa16"
        for li, L in enumerate(self.layers):
            h = self.rmsnorm(x, L["in_norm"])
            qkv = torch.cat([self.gemm(h, w, s) for w in L["qkv"]], dim=1)
            q = qkv[:, :qd].reshape(T, Hq, hd)
            k = qkv[:, qd:qd + kd].reshape(T, Hkv, hd)
            v = qkv[:, qd + kd:].reshape(T, Hkv, hd)
            if kv16:  # q, k, v enter RoPE / the cache as fp16
                q, k, v = rnd(q, "fp16"), rnd(k, "fp16"), rnd(v, "fp16")
            if L["q_norm"] is not None:
                q = rnd(self.rmsnorm(q, L["q_norm"]), "fp16" if kv16 else "fp32")
                k = rnd(self.rmsnorm(k, L["k_norm"]), "fp16" if kv16 else "fp32")
            sliding = c.layer_types[li] == "sliding"
            rope = self.dec.rope_local if (sliding and self.dec.rope_local is not None) else self.dec.rope_global
            q = rnd(self.rope(q, pos, rope.inv_freq), "fp16" if kv16 else "fp32")
            k = rnd(self.rope(k, pos, rope.inv_freq), "fp16" if kv16 else "fp32")
            a = self.attention(q, k, v, sliding, s)
            o = self.gemm(a, L["o"], s)
            if L["post_attn"] is not None:
                o = rnd(self.rmsnorm(o, L["post_attn"]), s["gemm_out"])
            x = rnd(x + o, "fp32")
            h = self.rmsnorm(x, L["ffn_norm"])
            g, u = self.gemm(h, L["gate"], s), self.gemm(h, L["up"], s)
            d = self.gemm(rnd(act(g) * u, s["act"]), L["down"], s)
            if L["post_ffn"] is not None:
                d = rnd(self.rmsnorm(d, L["post_ffn"]), s["gemm_out"])
            x = rnd(x + d, "fp32")
        y = self.gemm(self.rmsnorm(x, self.norm), self.head, s)
        if c.final_softcap is not None:
            y = torch.tanh(y / c.final_softcap) * c.final_softcap
        return y


DEFAULT = dict(weights="fp16", gemm_in="fp16", gemm_out="fp16", attn="fa16", act="fp16")
SCHEMES = {
    "default (engine today)": DEFAULT,
    "fp16 weights only": dict(weights="fp16", gemm_in="fp32", gemm_out="fp32", attn="fp32", act="fp32"),
    "  default + fp32 GEMM outputs": dict(DEFAULT, gemm_out="fp32"),
    "  default + fp32 attention": dict(DEFAULT, attn="fp32"),
    "  default + split inputs": dict(DEFAULT, gemm_in="split"),
    "  split + fp32 out (fa16, act16)": dict(DEFAULT, gemm_in="split", gemm_out="fp32"),
    "  split + fp32 out + fp32 act (fa16)": dict(DEFAULT, gemm_in="split", gemm_out="fp32", act="fp32"),
    "(a) split, fp32 out/attn/act": dict(weights="fp16", gemm_in="split", gemm_out="fp32", attn="fp32", act="fp32"),
    "(b) fp32 GEMM, fp32 attn/act": dict(weights="fp16", gemm_in="fp32", gemm_out="fp32", attn="fp32", act="fp32"),
    "(a) + exact weights": dict(weights="exact", gemm_in="split", gemm_out="fp32", attn="fp32", act="fp32"),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    for path in a.models:
        m = trapetum.load(path)
        emu = Emu(m)
        refs = [m.logits(m.encode(p)).double() for p in PROMPTS]
        print(f"\n{Path(path).name}: relative prompt-logit error vs the CPU fp32 reference, per prompt")
        for name, s in SCHEMES.items():
            errs = []
            for p, ref in zip(PROMPTS, refs):
                y = emu.logits(m.encode(p), s)
                errs.append(float((y - ref).norm() / ref.norm()))
            print(f"  {name:40s} " + "  ".join(f"{e:.2e}" for e in errs) + f"   max {max(errs):.2e}")
            assert all(math.isfinite(e) for e in errs)
        # the implementation itself (GpuEngine on the CPU: the kernels' torch fallbacks, CPU SDPA)
        for name, precise in (("GpuEngine on the CPU, default", False), ("GpuEngine on the CPU, precise", True)):
            eng = GpuEngine(m.decoder, 64, precise_prefill=precise)
            errs = [float((eng.prefill(m.encode(p), all_logits=True).double() - ref).norm() / ref.norm())
                    for p, ref in zip(PROMPTS, refs)]
            print(f"  {name:40s} " + "  ".join(f"{e:.2e}" for e in errs) + f"   max {max(errs):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
