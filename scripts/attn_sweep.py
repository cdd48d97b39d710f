"""Sweep the split-KV decode-attention configs (trapetum.kernels.attn_configs.CANDIDATE_CONFIGS) on CUDA.

    python scripts/attn_sweep.py --out DIR [--configs NAME,...] [--shapes SHAPE,...] [--replays N] [--jobs N]
                                 [--rows M]

Shapes (cache T_max = 4096, length as a device tensor, as the engine runs it): MHA 32/32x128 and
GQA 32/8x128 at 1024 and 4096 positions, 8/4x256 (Gemma-2-2B), 4/1x256 and 9/3x64 (SmolLM2) at 4096.
--shapes takes names or substrings of those, or any LABEL-HQ/HKVxD@LENGTH (e.g. mha-32/32x128@128: the same
heads at another length, LENGTH <= 4096), in the order given.
Two figures per config: "us" is decode_attention (split kernel + merge kernel over a roped q, as before
the fused kernel), "fused us" is decode_attention_fused, what the engine's decode step runs (RoPE of the
new token and its KV append inside the split kernel, then the merge kernel: two launches). The caches hold
the new token's roped k/v
before timing (rope_kv_append), so both read the same K/V and the fused calls rewrite the same bits. With --rows M
a third figure, "rows us": attention_rows of M new tokens at length - M .. length - 1 (a speculative verify's
attention: one launch pair for the M rows; checked bitwise against M decode calls before timing).
Per shape and config: each output is checked against the float64 reference (rel. error < 2e-3, and a
second call bitwise equal) before timing; configs that break
the static rule (config_fits) are skipped. Timing: >= 20 calls captured in one CUDA graph, each call on another of several cache
copies (2-64 copies, >= 256 MB of K/V read between two reads of one copy where 64 copies allow it:
5x the H200's 50 MB L2, so K/V come from HBM); median over
timed replays of replay time / calls (PDL off, kopts: each launch's full cost; off for the checks too, so that each
kernel variant compiles once). GB/s = K+V bytes of `length` positions / time (of "us"). The row "seq" is the
sequential kernel (kernels/experimental/attention_seq.py) for reference; "*" marks what choose_config picks.
Compiling is most of the run (per config: the split kernel plain and fused for each group size, and two merge
kernels): --jobs N (default 8 on CUDA) first compiles the configs in N worker processes into Triton's on-disk
cache (--compile-only runs one such worker), then the run loads them from there.
Prints a table per shape (one row per config) and a summary; writes DIR/attn_sweep.json and DIR/attn_sweep.md
with --out.
Exit status 1 if any config gave a wrong result or failed to compile.
--cpu-smoke runs this script's checks on the CPU under the Triton interpreter (small cache, a few
configs, no timing): a test of the script, not of the kernels' speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--cpu-smoke" in sys.argv:  # Triton picks the interpreter when the kernels are decorated (import)
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from trapetum.eval.bench_kernels import graph_time_calls  # noqa: E402
from trapetum.kernels import attention as at  # noqa: E402
from trapetum.kernels import attn_configs as ac  # noqa: E402
from trapetum.kernels import fused as fu  # noqa: E402
from trapetum.kernels.experimental import attention_seq as seq  # noqa: E402
from trapetum.settings import KernelOptions  # noqa: E402

PDL_OFF = KernelOptions(pdl="off")  # as graph_time_calls times: the checks compile the timed kernels

T_MAX = 4096
ROTATE_BYTES = 256 * 2**20
MAX_COPIES = 64
TOL = 2e-3
# name, Hq, Hkv, D, length
SHAPES = [("mha-32/32x128@1024", 32, 32, 128, 1024), ("mha-32/32x128@4096", 32, 32, 128, 4096),
          ("gqa-32/8x128@1024", 32, 8, 128, 1024), ("gqa-32/8x128@4096", 32, 8, 128, 4096),
          ("gemma-8/4x256@4096", 8, 4, 256, 4096), ("mqa-4/1x256@4096", 4, 1, 256, 4096),
          ("smollm-9/3x64@4096", 9, 3, 64, 4096)]
SMOKE_SHAPES = [("smoke-2/2x128@600", 2, 2, 128, 600), ("smoke-4/1x256@623", 4, 1, 256, 623),
                ("smoke-3/1x64@100", 3, 1, 64, 100)]


def parse_shapes(spec, known):
    """The shapes a --shapes value names: per comma-separated token an exact name of `known`, a spec
    LABEL-HQ/HKVxD@LENGTH, or else every known shape whose name contains it; in the order given, once each."""
    out = []
    for tok in spec.split(","):
        m = re.fullmatch(r"([\w.]+)-(\d+)/(\d+)x(\d+)@(\d+)", tok)
        if any(tok == s[0] for s in known):
            hits = [s for s in known if s[0] == tok]
        elif m:
            hits = [(tok, *map(int, m.groups()[1:]))]
        else:
            hits = [s for s in known if tok in s[0]]
        out += [h for h in hits if h not in out]
    return out


def rel_err(y, ref):
    y, ref = y.double(), ref.double()
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y - ref).norm() / ref.norm()).item()


def _check(y, y2, ref):
    """'ok', or why the output (y, and y2 from a second call) is not accepted."""
    err = rel_err(y, ref)
    if not err < TOL:
        return "WRONG", err
    return ("ok" if torch.equal(y, y2) else "NOT REPRODUCIBLE"), err


def _time_fused(row, cfg, fused_seen, inputs, n_calls, replays, dev):
    """Check and time (replays > 0) decode_attention_fused with cfg into row["fused_*"] (once per distinct config)."""
    key = dataclasses.astuple(cfg)
    if key in fused_seen:
        row.update(fused_seen[key])
        return
    qn, kn, vn, ks, vs, outs, pos, cos, sin, ref, ws = inputs
    n_copies = len(ks)
    res = {}
    kw = dict(scale=qn[0].shape[1] ** -0.5, workspace=ws, config=cfg, kopts=PDL_OFF)
    try:
        y = at.decode_attention_fused(qn[0], kn[0], vn[0], ks[0], vs[0], pos, cos, sin, out=outs[0], **kw).clone()
        y2 = at.decode_attention_fused(qn[0], kn[0], vn[0], ks[0], vs[0], pos, cos, sin, out=outs[0], **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        res["fused_status"], res["fused_rel_err"] = _check(y, y2, ref)
    except Exception as e:  # a compile / launch failure is a result too
        res["fused_status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if res["fused_status"] == "ok" and not replays:
        res["fused_status"] = "ok (not timed)"
    elif res["fused_status"] == "ok":
        calls = [(lambda i=i % n_copies: at.decode_attention_fused(qn[i], kn[i], vn[i], ks[i], vs[i], pos, cos, sin,
                                                                   out=outs[i], **kw)) for i in range(n_calls)]
        res["fused_us"] = graph_time_calls(calls, replays=replays, warmup=2)
    fused_seen[key] = res
    row.update(res)


def _time_rows(row, cfg, inputs, rows, n_calls, replays, dev):
    """Check (bitwise against `rows` decode calls) and time attention_rows of `rows` tokens into row["rows_*"]."""
    qn, kn, vn, ks, vs, outs, pos, cos, sin, ref, ws = inputs
    hq, d = qn[0].shape
    gen = torch.Generator(device=dev).manual_seed(rows)
    qkv = [torch.randn(rows, hq + 2 * kn[0].shape[0], d, device=dev, generator=gen).half() for _ in range(len(ks))]
    hkv = kn[0].shape[0]
    q, k, v = ([x[:, a:b] for x in qkv] for a, b in ((0, hq), (hq, hq + hkv), (hq + hkv, hq + 2 * hkv)))
    p0 = torch.tensor([int(pos) + 1 - rows], dtype=torch.int32, device=dev)
    out = torch.empty(rows, hq, d, device=dev, dtype=torch.float16)
    kw = dict(scale=d ** -0.5, config=cfg, kopts=PDL_OFF)
    wsr = at.attention_workspace(hq, d, ks[0].shape[1], dev, config=cfg, rows=rows)
    try:
        kc, vc = ks[0].clone(), vs[0].clone()
        y = at.attention_rows(q[0], k[0], v[0], kc, vc, p0, cos, sin, out=out, workspace=wsr, **kw).clone()
        kc2, vc2 = ks[0].clone(), vs[0].clone()
        same = all(torch.equal(y[r], at.decode_attention_fused(q[0][r], k[0][r], v[0][r], kc2, vc2, p0 + r, cos, sin,
                                                                 **kw)) for r in range(rows))
        row["rows_status"] = "ok" if same and torch.equal(kc, kc2) and torch.equal(vc, vc2) else "NOT BITWISE"
    except Exception as e:  # a compile / launch failure is a result too
        row["rows_status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        return
    if row["rows_status"] == "ok" and replays:
        calls = [(lambda i=i % len(ks): at.attention_rows(q[i], k[i], v[i], ks[i], vs[i], p0, cos, sin, out=out,
                                                           workspace=wsr, **kw)) for i in range(n_calls)]
        row["rows_us"] = graph_time_calls(calls, replays=replays, warmup=2)


def sweep_shape(name, hq, hkv, d, length, configs, replays, dev="cuda", t_max=T_MAX, verify_rows=0):
    """Check and time each config (None: the sequential kernel) at one shape; replays=0: check only (one cache);
    verify_rows > 1: attention_rows of that many tokens too."""
    g = hq // hkv
    scale = d ** -0.5
    kv_bytes = 2 * hkv * length * d * 2
    n_copies = max(2, min(MAX_COPIES, math.ceil(ROTATE_BYTES / kv_bytes))) if replays else 1
    n_calls = max(20, n_copies)
    gen = torch.Generator(device=dev).manual_seed(length * 7 + d)
    # the new token (un-roped q, k, v) and caches that already hold its roped k / v at length - 1
    qn = [torch.randn(hq, d, device=dev, generator=gen).half() * 2 for _ in range(n_copies)]
    kn = [torch.randn(hkv, d, device=dev, generator=gen).half() for _ in range(n_copies)]
    vn = [torch.randn(hkv, d, device=dev, generator=gen).half() for _ in range(n_copies)]
    ks = [torch.randn(hkv, t_max, d, device=dev, generator=gen).half() for _ in range(n_copies)]
    vs = [torch.randn(hkv, t_max, d, device=dev, generator=gen).half() for _ in range(n_copies)]
    cos, sin = fu.rope_tables(t_max, d, device=dev)
    pos = torch.tensor([length - 1], dtype=torch.int32, device=dev)
    qs = [fu.rope_kv_append(qn[i].clone(), kn[i], vn[i], ks[i], vs[i], pos, cos, sin) for i in range(n_copies)]
    outs = [torch.empty(hq, d, device=dev, dtype=torch.float16) for _ in range(n_copies)]
    ln = torch.tensor([length], dtype=torch.int32, device=dev)
    ref = at.decode_attention_reference(qs[0], ks[0], vs[0], length, scale=scale)
    chosen = at.choose_config(d, g, t_max, hkv)
    rows = []
    fused_seen = {}
    for cfg in configs:
        label = "seq" if cfg is None else cfg.name
        row = {"config": label, "params": None if cfg is None else dataclasses.asdict(cfg),
               "chosen": cfg == chosen, "status": "ok"}
        rows.append(row)
        if cfg is not None and not at.config_fits(cfg, d, g):
            row["status"] = "skipped (resource rule)"
            continue
        ws = at.attention_workspace(hq, d, t_max, dev, config=cfg or chosen)
        if cfg is not None:
            inputs = (qn, kn, vn, ks, vs, outs, pos, cos, sin, ref, ws)
            _time_fused(row, cfg, fused_seen, inputs, n_calls, replays, dev)
            if verify_rows > 1 and length >= verify_rows:
                _time_rows(row, cfg, inputs, verify_rows, n_calls, replays, dev)
        if cfg is None:
            def attend(q, k, v, out):
                return seq.decode_attention_seq(q, k, v, ln, scale=scale, out=out)
        else:
            def attend(q, k, v, out, cfg=cfg, ws=ws):
                return at.decode_attention(q, k, v, ln, scale=scale, workspace=ws, config=cfg, out=out, kopts=PDL_OFF)
        try:
            y = attend(qs[0], ks[0], vs[0], outs[0]).clone()
            y2 = attend(qs[0], ks[0], vs[0], outs[0])
            if dev == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # a compile / launch failure is a result too
            row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            continue
        row["status"], row["rel_err"] = _check(y, y2, ref)
        if row["status"] != "ok":
            continue
        if not replays:
            row["status"] = "ok (not timed)"
            continue
        calls = [(lambda i=i % n_copies, f=attend: f(qs[i], ks[i], vs[i], outs[i])) for i in range(n_calls)]
        row["us"] = graph_time_calls(calls, replays=replays, warmup=2)
        row["GBps"] = kv_bytes / row["us"] / 1e3
    timed = [r for r in rows if "us" in r and r["config"] != "seq"]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    timed_f = [r for r in rows if "fused_us" in r]
    best_f = min(timed_f, key=lambda r: r["fused_us"]) if timed_f else None
    return {"shape": name, "hq": hq, "hkv": hkv, "d": d, "length": length, "t_max": t_max,
            "kv_bytes": kv_bytes, "cache_copies": n_copies, "calls_per_graph": n_calls,
            "chosen": chosen.name, "best": best and best["config"], "best_fused": best_f and best_f["config"],
            "rows": rows}


def shape_table(res):
    """One row per config: us (split + merge kernel), fused us (the engine's decode_attention_fused), rows us (with
    --rows), GB/s of us, the larger rel. error of the two; status 'ok' or what went wrong."""
    lines = [(f"### {res['shape']}  (K+V {res['kv_bytes'] / 1e6:.1f} MB read; {res['cache_copies']} cache copies, "
              f"{res['calls_per_graph']} calls per graph)"),
             "| config | us | fused us | rows us | GB/s | rel err | status |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        mark = (" *" if r["chosen"] else "") + (" (best)" if r["config"] == res["best"] else "") + \
            (" (best fused)" if r["config"] == res["best_fused"] else "")
        us = f"{r['us']:.2f}" if "us" in r else "-"
        fus = f"{r['fused_us']:.2f}" if "fused_us" in r else "-"
        rus = f"{r['rows_us']:.2f}" if "rows_us" in r else "-"
        gb = f"{r['GBps']:,.0f}" if "GBps" in r else "-"
        errs = [r[k] for k in ("rel_err", "fused_rel_err") if k in r]
        er = f"{max(errs):.1e}" if errs else "-"
        fst = r.get("fused_status", r["status"])
        st = r["status"] if fst == r["status"] else f"{r['status']}; fused: {fst}"
        st += f"; rows: {r['rows_status']}" if r.get("rows_status", "ok") != "ok" else ""
        lines.append(f"| {r['config']}{mark} | {us} | {fus} | {rus} | {gb} | {er} | {st} |")
    return "\n".join(lines)


def summary_table(results):
    lines = ["| shape | legacy us | chosen (*) us | best config | best us | best GB/s | chosen (*) fused us | "
             "best fused config | best fused us |", "|---|---|---|---|---|---|---|---|---|"]
    legacy = ac.LEGACY_CONFIG.name
    for res in results:
        by = {r["config"]: r for r in res["rows"]}
        def f(n, key="us", by=by):
            return f"{by[n][key]:.2f}" if n in by and key in by[n] else "-"
        b = by.get(res["best"]) or {}
        lines.append(f"| {res['shape']} | {f(legacy)} | {f(res['chosen'])} | {res['best']} | "
                     f"{b.get('us', float('nan')):.2f} | {b.get('GBps', float('nan')):,.0f} | "
                     f"{f(res['chosen'], 'fused_us')} | {res['best_fused']} | {f(res['best_fused'], 'fused_us')} |")
    return "\n".join(lines)


def precompile(configs, shapes, jobs, rows):
    """Compile the configs' kernels for the shapes in `jobs` worker processes (--compile-only: the same checks, one
    cache copy, no timing) into Triton's on-disk cache, from which this process then loads them. A worker that
    fails only costs time: this process compiles what is missing and reports any error itself."""
    t = time.time()
    groups = [g for g in (configs[i::jobs] for i in range(jobs)) if g]
    procs = [subprocess.Popen([sys.executable, __file__, "--compile-only", "--configs", ",".join(c.name for c in g),
                               "--shapes", ",".join(s[0] for s in shapes), "--rows", str(rows)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for g in groups]
    rcs = [p.wait() for p in procs]
    print(f"(compiled in {len(procs)} processes, {time.time() - t:.1f} s; exit codes {rcs})\n", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="directory for attn_sweep.json / attn_sweep.md")
    ap.add_argument("--configs", help="comma-separated config names (default: all candidates)")
    ap.add_argument("--shapes", help="comma-separated shape names, substrings, or LABEL-HQ/HKVxD@LENGTH (default: all)")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--rows", type=int, default=0, help="also time attention_rows of M tokens (a verify; M >= 2)")
    ap.add_argument("--jobs", type=int, default=8, help="processes that compile the kernels first (CUDA; 1: none)")
    ap.add_argument("--compile-only", action="store_true", help="check the configs without timing (a --jobs worker)")
    ap.add_argument("--list", action="store_true", help="print the shapes and candidate configs and exit")
    ap.add_argument("--cpu-smoke", action="store_true", help="check this script on the CPU interpreter (no timing)")
    a = ap.parse_args()

    dev, t_max = ("cpu", 640) if a.cpu_smoke else ("cuda", T_MAX)
    known = SMOKE_SHAPES if a.cpu_smoke else SHAPES
    shapes = parse_shapes(a.shapes, known) if a.shapes else known
    for name, hq, hkv, d, length in shapes:
        if not (hkv >= 1 and hq % hkv == 0 and 1 <= length <= t_max):
            print(f"attn_sweep: shape {name}: needs Hq a multiple of Hkv and 1 <= length <= {t_max}", file=sys.stderr)
            return 2
    configs = list(ac.CANDIDATE_CONFIGS)
    for d, g, hkv in {(d, hq // hkv, hkv) for _, hq, hkv, d, _ in shapes}:  # the chooser's picks are timed too
        c = at.choose_config(d, g, t_max, hkv)
        if c not in configs:
            configs.append(c)
    if a.configs:
        want = a.configs.split(",")
        configs = [c for c in configs if c.name in want]
    if a.list:
        print("shapes:", ", ".join(s[0] for s in shapes))
        print("configs:\n  " + "\n  ".join(f"{c.name}: {c}" for c in configs))
        return 0
    if dev == "cuda" and not torch.cuda.is_available():
        print("attn_sweep: needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    t0 = time.time()
    if dev == "cuda" and a.jobs > 1 and not a.compile_only:
        precompile(configs, shapes, min(a.jobs, len(configs)), a.rows)
    replays = 0 if a.compile_only or dev != "cuda" else a.replays
    configs = ([] if a.compile_only else [None]) + configs  # None: the sequential kernel ("seq")
    import triton
    results = []
    for name, hq, hkv, d, length in shapes:
        t = time.time()
        res = sweep_shape(name, hq, hkv, d, length, configs, replays, dev, t_max, verify_rows=a.rows)
        results.append(res)
        if dev == "cuda":
            torch.cuda.empty_cache()  # the shape's caches are gone with sweep_shape's frame
        if not a.compile_only:
            print(shape_table(res), flush=True)
            print(f"({time.time() - t:.1f} s)\n", flush=True)
    if a.compile_only:
        return 0
    summary = summary_table(results)
    print(f"## Summary (T_max {t_max}, * = choose_config)")
    print(summary)
    statuses = [(res["shape"], r["config"], r[k]) for res in results for r in res["rows"]
                for k in ("status", "fused_status") if k in r]
    statuses += [(res["shape"], r["config"], r["rows_status"]) for res in results for r in res["rows"]
                 if "rows_status" in r]
    bad = [s for s in statuses if s[2] in ("WRONG", "NOT REPRODUCIBLE", "NOT BITWISE")]
    errors = [s for s in statuses if s[2].startswith("error")]
    for b in bad + errors:
        print("FAILED:" if b in bad else "ERROR:", *b)
    print(f"total {time.time() - t0:.1f} s")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter smoke test)", "torch": torch.__version__, "triton": triton.__version__,
                "python": platform.python_version(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "replays": a.replays, "rotate_bytes": ROTATE_BYTES, "seconds": time.time() - t0, "rows": a.rows}
        (out / "attn_sweep.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        (out / "attn_sweep.md").write_text("\n\n".join(shape_table(r) for r in results) + "\n\n## Summary\n"
                                          + summary + "\n")
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
