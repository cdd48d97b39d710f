"""Decode and verify attention on the GPU: the production path (RoPE + KV append + split-KV kernel, merge kernel),
its unfused form, the one-launch inline merge (kernels/experimental), and attention_rows of M new tokens.

    python scripts/gpu_attn_fused.py --out DIR [--lengths 128,1024,4096] [--rows 2,4,8,16] [--replays N]
                                     [--t-max 4096] [--inline]

Shapes: Llama-2-7B (MHA 32/32x128: 8 length-adaptive splits by default), Llama-3-8B (GQA 32/8x128), Llama-2-70B
(GQA 64/8x128); the default config (choose_config) throughout; positions as device tensors (as the engine passes
them). A case at length L and M rows puts the new tokens at L - M .. L - 1 of a T_max-position cache.

Correctness, per shape, length and M (FAIL = exit status 1):
  - attention_rows, fused and unfused, bitwise equal to M successive decode_attention_fused calls (outputs and both
    caches: the batch-invariance contract), and within 2e-3 of the float64 reference; a repeat call bitwise equal;
  - M = 1: decode_attention_fused bitwise equal to the unfused path (rope_kv_append + decode_attention), and with
    --inline the inline merge within 1e-3 of it (bitwise reported).
Timing (bench_kernels.graph_time_calls: the median over replays of replay time / calls; each call on another of
several cache copies, >= 256 MB of K/V between two reads of one copy where 64 copies allow it), us per layer's
attention part, PDL on (what the decode step runs) and off (each launch's full cost):
  decode    decode_attention_fused (2 launches)          unfused  rope_kv_append, split, merge (3 launches)
  inline    the inline merge (1 launch; --inline)       rows M   attention_rows of M tokens (2 launches)
The summary gives rows M against decode (the verify's attention against one decode step's) and against M decodes.
Writes DIR/gpu_attn_fused.json and DIR/gpu_attn_fused.md.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trapetum.eval.bench_kernels import graph_time_calls  # noqa: E402
from trapetum.kernels import attention as at  # noqa: E402
from trapetum.kernels import fused as fu  # noqa: E402
from trapetum.kernels import pdl  # noqa: E402
from trapetum.kernels.experimental import attention_inline as inline  # noqa: E402
from trapetum.settings import KernelOptions  # noqa: E402

SHAPES = [("llama-2-7b", 32, 32, 128), ("llama-3-8b", 32, 8, 128), ("llama-2-70b", 64, 8, 128)]
ROTATE_BYTES = 256 * 2**20
MAX_COPIES = 64
PDL = {"pdl-on": KernelOptions(), "pdl-off": KernelOptions(pdl="off")}


def rel_err(y, ref):
    y, ref = y.double().cpu(), ref.double().cpu()
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y - ref).norm() / ref.norm()).item()


class Case:
    """One shape at one length with room for M new rows: un-roped q, k, v rows, cache copies, tables, buffers."""

    def __init__(self, hq, hkv, d, length, m, t_max, n_copies):
        gen = torch.Generator(device="cuda").manual_seed(length * 31 + hkv + m)
        self.hq, self.hkv, self.d, self.m, self.scale = hq, hkv, d, m, d ** -0.5
        self.base = length - m
        qkv = [torch.randn(m, hq + 2 * hkv, d, device="cuda", generator=gen).half() * 2 for _ in range(n_copies)]
        self.q = [x[:, :hq] for x in qkv]
        self.k = [x[:, hq:hq + hkv] for x in qkv]
        self.v = [x[:, hq + hkv:] for x in qkv]
        self.kc = [torch.randn(hkv, t_max, d, device="cuda", generator=gen).half() for _ in range(n_copies)]
        self.vc = [torch.randn(hkv, t_max, d, device="cuda", generator=gen).half() for _ in range(n_copies)]
        self.qr = [q.clone() for q in self.q]  # the unfused path's roped q
        self.out = [torch.empty(m, hq, d, device="cuda", dtype=torch.float16) for _ in range(n_copies)]
        self.cos, self.sin = fu.rope_tables(t_max, d, theta=500000.0, device="cuda")
        self.pos = torch.tensor([self.base], dtype=torch.int32, device="cuda")
        self.len = torch.tensor([self.base + 1], dtype=torch.int32, device="cuda")
        self.ws = at.attention_workspace(hq, d, t_max, "cuda", rows=16)
        self.iws = inline.inline_workspace(hq, d, t_max, "cuda")

    def launch(self, variant, i, kopts):
        kw = dict(scale=self.scale, kopts=kopts)
        if variant == "rows":
            at.attention_rows(self.q[i], self.k[i], self.v[i], self.kc[i], self.vc[i], self.pos, self.cos, self.sin,
                              out=self.out[i], workspace=self.ws, **kw)
        elif variant == "decode":
            at.decode_attention_fused(self.q[i][0], self.k[i][0], self.v[i][0], self.kc[i], self.vc[i], self.pos,
                                      self.cos, self.sin, out=self.out[i][0], workspace=self.ws, **kw)
        elif variant == "unfused":
            fu.rope_kv_append(self.qr[i][0], self.k[i][0], self.v[i][0], self.kc[i], self.vc[i], self.pos, self.cos,
                              self.sin, kopts=kopts)
            at.decode_attention(self.qr[i][0], self.kc[i], self.vc[i], self.len, out=self.out[i][0],
                                workspace=self.ws, **kw)
        else:
            inline.decode_attention_fused_inline(self.q[i][0], self.k[i][0], self.v[i][0], self.kc[i], self.vc[i],
                                                 self.pos, self.cos, self.sin, out=self.out[i][0], workspace=self.iws,
                                                 **kw)

    def calls(self, variant, n_calls, kopts):
        return [(lambda i=j % len(self.kc): self.launch(variant, i, kopts)) for j in range(n_calls)]


def check(c, with_inline):
    """The correctness record of one case (copy 0); 'ok' False on any required failure."""
    kc0, vc0 = c.kc[0].clone(), c.vc[0].clone()
    rec = {}
    if c.m > 1:
        ys, kcs, vcs = [], kc0.clone(), vc0.clone()
        for r in range(c.m):
            ys.append(at.decode_attention_fused(c.q[0][r], c.k[0][r], c.v[0][r], kcs, vcs, c.pos + r, c.cos, c.sin,
                                                scale=c.scale, workspace=c.ws))
        y_seq = torch.stack(ys)
        for fused in (True, False):
            c.kc[0].copy_(kc0), c.vc[0].copy_(vc0)
            y = at.attention_rows(c.q[0].clone(), c.k[0], c.v[0], c.kc[0], c.vc[0], c.pos, c.cos, c.sin,
                                  scale=c.scale, workspace=c.ws, fused=fused)
            rec[f"bitwise_{'fused' if fused else 'unfused'}"] = bool(
                torch.equal(y, y_seq) and torch.equal(c.kc[0], kcs) and torch.equal(c.vc[0], vcs))
        y2 = at.attention_rows(c.q[0], c.k[0], c.v[0], c.kc[0], c.vc[0], c.pos, c.cos, c.sin, scale=c.scale,
                               workspace=c.ws)
        rec["reproducible"] = bool(torch.equal(y2, y_seq))
    else:
        c.qr[0].copy_(c.q[0])
        c.launch("unfused", 0, PDL["pdl-on"])
        y_unf, kc_unf = c.out[0][0].clone(), c.kc[0].clone()
        c.kc[0].copy_(kc0), c.vc[0].copy_(vc0)
        c.launch("decode", 0, PDL["pdl-on"])
        y_seq = c.out[0].clone()
        rec["bitwise_unfused"] = bool(torch.equal(y_seq[0], y_unf) and torch.equal(c.kc[0], kc_unf))
        c.launch("decode", 0, PDL["pdl-off"])
        rec["reproducible"] = bool(torch.equal(c.out[0], y_seq))
        if with_inline:
            c.launch("inline", 0, PDL["pdl-on"])
            rec["inline_rel_err"] = rel_err(c.out[0], y_seq)
            rec["inline_bitwise"] = bool(torch.equal(c.out[0], y_seq))
    # float64: RoPE of the rows at base + r, the rows' k and v appended, row r over base + r + 1 positions
    p = torch.arange(c.base, c.base + c.m)
    cos, sin = c.cos.cpu(), c.sin.cpu()
    qr = fu.rope_reference(c.q[0].cpu(), p, cos, sin)
    kc, vc = kc0.cpu().double(), vc0.cpu().double()
    kc[:, c.base:c.base + c.m] = fu.rope_reference(c.k[0].cpu(), p, cos, sin).transpose(0, 1)
    vc[:, c.base:c.base + c.m] = c.v[0].cpu().double().transpose(0, 1)
    ref = torch.stack([at.decode_attention_reference(qr[r], kc, vc, c.base + r + 1, scale=c.scale)
                       for r in range(c.m)])
    rec["rel_err_ref"] = rel_err(y_seq, ref)
    torch.cuda.synchronize()
    rec["ok"] = (rec["rel_err_ref"] < 2e-3 and all(v for k, v in rec.items() if k.startswith("bitwise") or
                                                    k == "reproducible") and rec.get("inline_rel_err", 0) < 1e-3)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="128,1024,4096")
    ap.add_argument("--rows", default="2,4,8,16", help="verify sizes M (each also timed against M = 1)")
    ap.add_argument("--t-max", type=int, default=4096)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--inline", action="store_true", help="also time the inline merge (M = 1)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_attn_fused: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in a.lengths.split(",")]
    ms = [1] + [int(x) for x in a.rows.split(",") if int(x) > 1]
    t0 = time.time()
    results = []
    for name, hq, hkv, d in SHAPES:
        cfg = at.choose_config(d, hq // hkv, a.t_max, hkv)
        for length in lengths:
            kv_bytes = 2 * hkv * length * d * 2
            n_copies = max(2, min(MAX_COPIES, math.ceil(ROTATE_BYTES / kv_bytes)))
            for m in (m for m in ms if m <= length):
                c = Case(hq, hkv, d, length, m, a.t_max, n_copies)
                rec = {"shape": name, "config": cfg.name, "length": length, "m": m, "copies": n_copies,
                       "check": check(c, a.inline), "us": {}}
                variants = ["rows"] if m > 1 else ["decode", "unfused"] + (["inline"] if a.inline else [])
                for variant in variants:
                    for key, kopts in PDL.items():
                        calls = c.calls(variant, max(20, n_copies), kopts)
                        rec["us"][f"{variant} {key}"] = graph_time_calls(calls, replays=a.replays, warmup=2)
                results.append(rec)
                print(f"{name} @ {length} M={m}: {json.dumps(rec['check'])}\n  "
                      + ", ".join(f"{k} {v:.2f}" for k, v in rec["us"].items()), flush=True)
                del c
                torch.cuda.empty_cache()
    dec = {(r["shape"], r["length"]): r["us"]["decode pdl-on"] for r in results if r["m"] == 1}
    lines = ["| shape (config) | length | M | us (PDL on) | us (PDL off) | / decode | / (M x decode) | ok |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        var = "rows" if r["m"] > 1 else "decode"
        on, off = r["us"][f"{var} pdl-on"], r["us"][f"{var} pdl-off"]
        base = dec[r["shape"], r["length"]]
        lines.append(f"| {r['shape']} ({r['config']}) | {r['length']} | {r['m']} | {on:.2f} | {off:.2f} | "
                     f"{on / base:.2f} | {on / (r['m'] * base):.3f} | {'ok' if r['check']['ok'] else 'FAIL'} |")
    table = "\n".join(lines)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "pdl_in_pdl_on_columns": pdl.enabled(torch.device("cuda"), PDL["pdl-on"]), "t_max": a.t_max,
            "replays": a.replays, "seconds": time.time() - t0}
    (out / "gpu_attn_fused.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "gpu_attn_fused.md").write_text(f"{json.dumps(meta)}\n\n{table}\n")
    print(f"\ntotal {time.time() - t0:.1f} s; PDL {'on' if meta['pdl_in_pdl_on_columns'] else 'OFF (unsupported)'} "
          f"in the pdl-on columns\n{table}")
    return 0 if all(r["check"]["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
