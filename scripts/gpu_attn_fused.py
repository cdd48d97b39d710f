"""The fused decode attention (RoPE + KV append + split-KV attention + inline merge, one launch) on the GPU.

    python scripts/gpu_attn_fused.py --out DIR [--lengths 1,64,65,128,4096] [--replays N] [--t-max 4096]

Shapes: Llama-2-7B (MHA 32/32x128), Llama-3-8B (GQA 32/8x128), Llama-2-70B (GQA 64/8x128); the new token at
position length - 1 of a T_max-position cache (pos a device tensor, as the engine passes it).

Correctness, per shape and length (FAIL = exit status 1):
  - the caches after attention.decode_attention_fused hold exactly the bits rope_kv_append writes;
  - its output against the float64 reference (rel. error < 2e-3) and against the unfused path
    (rope_kv_append + decode_attention: split kernel + merge kernel; rel. error < 1e-3);
  - five more calls give the same bits; the workspace counters are back at 0;
  - the two half-way variants (RoPE fused with the merge kernel; inline merge over a roped q) too.
  Reported, not required: whether fused and unfused outputs are bitwise equal.
Timing: one layer's attention part captured in a CUDA graph (bench_kernels.graph_time_calls: the median
over replays of replay time / calls; each call on another of several cache copies, >= 256 MB of K/V
between two reads of one copy where 64 copies allow it), four variants:
  unfused      rope_kv_append, split kernel, merge kernel   (3 launches, the path before)
  rope+split   decode_attention_fused(inline_merge=False)   (2 launches)
  split+merge  rope_kv_append, decode_attention(inline_merge=True)   (2 launches)
  fused        decode_attention_fused                        (1 launch, the engine's default)
each with programmatic dependent launch off (graph_time_calls' default: each launch's full cost) and on
(what the decode step runs: a launch may start while the previous one finishes); and the fused kernel
with attention.MERGE_REGS = 16 / 32 / 64 (columns the last program merges per step; PDL on).
Writes DIR/gpu_attn_fused.json and DIR/gpu_attn_fused.md; prints a short table last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trapetum.eval.bench_e2e import with_env  # noqa: E402
from trapetum.eval.bench_kernels import graph_time_calls  # noqa: E402
from trapetum.kernels import attention as at  # noqa: E402
from trapetum.kernels import fused as fu  # noqa: E402
from trapetum.kernels import pdl  # noqa: E402

SHAPES = [("llama-2-7b", 32, 32, 128), ("llama-3-8b", 32, 8, 128), ("llama-2-70b", 64, 8, 128)]
ROTATE_BYTES = 256 * 2**20
MAX_COPIES = 64
VARIANTS = ("unfused", "rope+split", "split+merge", "fused")
MERGE_REGS = (16, 32, 64)


def rel_err(y, ref):
    y, ref = y.double().cpu(), ref.double().cpu()
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y - ref).norm() / ref.norm()).item()


class Case:
    """One shape at one length: the new token (un-roped q, k, v), cache copies, tables, buffers."""

    def __init__(self, hq, hkv, d, length, t_max, n_copies):
        gen = torch.Generator(device="cuda").manual_seed(length * 31 + hkv)
        self.hq, self.hkv, self.d, self.length = hq, hkv, d, length
        self.scale = d ** -0.5
        self.q = [torch.randn(hq, d, device="cuda", generator=gen).half() * 2 for _ in range(n_copies)]
        self.k = [torch.randn(hkv, d, device="cuda", generator=gen).half() for _ in range(n_copies)]
        self.v = [torch.randn(hkv, d, device="cuda", generator=gen).half() for _ in range(n_copies)]
        self.kc = [torch.randn(hkv, t_max, d, device="cuda", generator=gen).half() for _ in range(n_copies)]
        self.vc = [torch.randn(hkv, t_max, d, device="cuda", generator=gen).half() for _ in range(n_copies)]
        self.qr = [q.clone() for q in self.q]  # the roped q of the unfused paths
        self.out = [torch.empty(hq, d, device="cuda", dtype=torch.float16) for _ in range(n_copies)]
        self.cos, self.sin = fu.rope_tables(t_max, d, theta=500000.0, device="cuda")
        self.pos = torch.tensor([length - 1], dtype=torch.int32, device="cuda")
        self.len = torch.tensor([length], dtype=torch.int32, device="cuda")
        self.ws = at.attention_workspace(hq, d, t_max, "cuda")

    def launch(self, variant, i):
        """Launch `variant` on copy i (the unfused ones rotate qr[i] in place)."""
        kw = dict(scale=self.scale, out=self.out[i], workspace=self.ws)
        if variant in ("unfused", "split+merge"):
            fu.rope_kv_append(self.qr[i], self.k[i], self.v[i], self.kc[i], self.vc[i], self.pos, self.cos, self.sin)
            at.decode_attention(self.qr[i], self.kc[i], self.vc[i], self.len, split=True,
                                inline_merge=variant == "split+merge", **kw)
        else:
            at.decode_attention_fused(self.q[i], self.k[i], self.v[i], self.kc[i], self.vc[i], self.pos,
                                      self.cos, self.sin, inline_merge=variant == "fused", **kw)

    def call(self, variant, i):
        """`variant` on copy i from the un-roped q; returns its output buffer."""
        self.qr[i].copy_(self.q[i])
        self.launch(variant, i)
        return self.out[i]

    def calls(self, variant, n_calls):
        """Zero-argument launches for a graph, rotating over the copies. The unfused variants rotate their
        roped q again at each replay: the same launches and bytes, other values (timing only)."""
        return [(lambda i=j % len(self.kc): self.launch(variant, i)) for j in range(n_calls)]


def reference(c):
    """float64: RoPE of copy 0's q and k at length - 1, k and v appended, attention over `length` positions."""
    p = torch.tensor([c.length - 1])
    cos, sin = c.cos.cpu(), c.sin.cpu()
    qr = fu.rope_reference(c.q[0].cpu()[None], p, cos, sin)[0]
    kc, vc = c.kc[0].cpu().double(), c.vc[0].cpu().double()
    kc[:, c.length - 1] = fu.rope_reference(c.k[0].cpu()[None], p, cos, sin)[0]
    vc[:, c.length - 1] = c.v[0].cpu().double()
    return at.decode_attention_reference(qr, kc, vc, c.length, scale=c.scale)


def check(c):
    """The correctness record of one case (copy 0); 'ok' False on any required failure."""
    ref = reference(c)
    kc0, vc0 = c.kc[0].clone(), c.vc[0].clone()
    y_unf = c.call("unfused", 0).clone()
    kc_unf, vc_unf = c.kc[0].clone(), c.vc[0].clone()
    c.kc[0].copy_(kc0)
    c.vc[0].copy_(vc0)
    y = c.call("fused", 0).clone()
    rec = {"cache_bitwise": torch.equal(c.kc[0], kc_unf) and torch.equal(c.vc[0], vc_unf),
           "rel_err_ref": rel_err(y, ref), "rel_err_unfused": rel_err(y, y_unf),
           "unfused_rel_err_ref": rel_err(y_unf, ref), "bitwise_vs_unfused": torch.equal(y, y_unf)}
    rec["reproducible"] = all(torch.equal(c.call("fused", 0), y) for _ in range(5))
    rec["counters_zero"] = not c.ws.counters.any()
    for v in ("rope+split", "split+merge"):
        rec[f"rel_err_{v}"] = rel_err(c.call(v, 0), ref)
    torch.cuda.synchronize()
    rec["ok"] = (rec["cache_bitwise"] and rec["rel_err_ref"] < 2e-3 and rec["rel_err_unfused"] < 1e-3
                 and rec["reproducible"] and rec["counters_zero"]
                 and all(rec[f"rel_err_{v}"] < 2e-3 for v in ("rope+split", "split+merge")))
    return rec


def with_pdl(f):
    """f launched with TRAPETUM_PDL=1 (graph_time_calls captures with PDL off)."""
    def call():
        with with_env("TRAPETUM_PDL", "1"):
            f()
    return call


def pdl_available() -> bool:
    """Whether the pdl-on columns really launch with PDL (sm_90+, a Triton with launch_pdl)."""
    seen = []
    with_pdl(lambda: seen.append(pdl.enabled(torch.device("cuda"))))()
    return seen[0]


def timings(c, n_calls, replays):
    t = {}
    for variant in VARIANTS:
        calls = c.calls(variant, n_calls)
        t[f"{variant} pdl-off"] = graph_time_calls(calls, replays=replays, warmup=2)
        t[f"{variant} pdl-on"] = graph_time_calls([with_pdl(f) for f in calls], replays=replays, warmup=2)
    default = at.MERGE_REGS
    try:
        for regs in MERGE_REGS:
            at.MERGE_REGS = regs
            calls = [with_pdl(f) for f in c.calls("fused", n_calls)]
            t[f"fused regs{regs} pdl-on"] = graph_time_calls(calls, replays=replays, warmup=2)
    finally:
        at.MERGE_REGS = default
    return t


def short_table(results):
    lines = ["| shape | length | unfused us | fused us | saved us | saved (PDL off) | rel err | bitwise = unfused "
             "| ok |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t = r["us"]
        ck = r["check"]
        lines.append(f"| {r['shape']} | {r['length']} | {t['unfused pdl-on']:.2f} | {t['fused pdl-on']:.2f} | "
                     f"{t['unfused pdl-on'] - t['fused pdl-on']:.2f} | "
                     f"{t['unfused pdl-off'] - t['fused pdl-off']:.2f} | {ck['rel_err_ref']:.1e} | "
                     f"{'yes' if ck['bitwise_vs_unfused'] else 'no'} | {'ok' if ck['ok'] else 'FAIL'} |")
    return "\n".join(lines)


def full_table(results):
    cols = [f"{v} {p}" for v in VARIANTS for p in ("pdl-off", "pdl-on")] + [f"fused regs{r} pdl-on" for r in MERGE_REGS]
    lines = ["| shape | length | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for r in results:
        lines.append(f"| {r['shape']} | {r['length']} | " + " | ".join(f"{r['us'][k]:.2f}" for k in cols) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="1,64,65,128,4096")
    ap.add_argument("--t-max", type=int, default=4096)
    ap.add_argument("--replays", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_attn_fused: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in a.lengths.split(",")]
    t0 = time.time()
    results = []
    for name, hq, hkv, d in SHAPES:
        for length in lengths:
            kv_bytes = 2 * hkv * length * d * 2
            n_copies = max(2, min(MAX_COPIES, math.ceil(ROTATE_BYTES / kv_bytes)))
            c = Case(hq, hkv, d, length, a.t_max, n_copies)
            rec = {"shape": name, "hq": hq, "hkv": hkv, "d": d, "length": length, "copies": n_copies,
                   "check": check(c), "us": timings(c, max(20, n_copies), a.replays)}
            results.append(rec)
            print(f"{name} @ {length}: {json.dumps(rec['check'])}", flush=True)
            print("  " + ", ".join(f"{k} {v:.2f}" for k, v in rec["us"].items()), flush=True)
            del c
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "pdl_in_pdl_on_columns": pdl_available(),
            "merge_regs_default": at.MERGE_REGS, "t_max": a.t_max, "replays": a.replays,
            "seconds": time.time() - t0}
    (out / "gpu_attn_fused.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    short = short_table(results)
    (out / "gpu_attn_fused.md").write_text(f"{json.dumps(meta)}\n\n## all timings (us per layer's attention)\n\n"
                                           f"{full_table(results)}\n\n## summary\n\n{short}\n")
    print(f"\nall timings (us per layer's attention part):\n{full_table(results)}\n")
    print(f"total {time.time() - t0:.1f} s; PDL {'on' if meta['pdl_in_pdl_on_columns'] else 'OFF (unsupported)'} "
          f"in the pdl-on columns; inline merge MERGE_REGS {at.MERGE_REGS}")
    print(short)
    return 0 if all(r["check"]["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
