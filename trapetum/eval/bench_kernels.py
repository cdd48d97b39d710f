"""Kernel benchmark: codebook GEMV vs cuBLAS fp16, decode attention, fused kernels.

    python -m trapetum.eval.bench_kernels --out DIR      (or: trapetum bench kernels --out DIR)

Protocol (DESIGN.md "Measuring"): random data (never zeros); every op is captured in a CUDA graph
that launches it once per buffer set, with enough sets that the bytes touched per replay exceed
the 60 MB L2 several times (so weights come from HBM); warm-up replays first; the figure is the
median over timed replays of (replay time / launches). GEMV shapes are written in x out:
x [M, in] @ W.T, W [out, in]. Writes DIR/kernels.json and DIR/kernels.md and prints the table.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

L2_BYTES = 60 * 2**20
ROTATE_BYTES = 4 * L2_BYTES  # bytes touched per replay, at least


def graph_time_us(make_op, bytes_per_set: int, *, replays: int = 30, warmup: int = 3, max_sets: int = 64) -> float:
    """Median microseconds per launch of op(set) over CUDA-graph replays with rotating buffer sets.

    make_op(i) -> zero-argument callable launching the op on buffer set i (allocations done here).
    """
    n_sets = max(2, min(max_sets, math.ceil(ROTATE_BYTES / max(1, bytes_per_set))))
    ops = [make_op(i) for i in range(n_sets)]
    for op in ops:  # eager warm-up: compilation, attribute setup
        op()
    torch.cuda.synchronize()
    us = graph_time_calls(ops, replays=replays, warmup=warmup)
    del ops
    return us


def graph_time_calls(calls, *, replays: int = 30, warmup: int = 3) -> float:
    """Median microseconds per call of `calls` (zero-argument launches) captured in one CUDA graph.

    Programmatic dependent launch is off while capturing (TRAPETUM_PDL=0): with it, each launch's prologue
    would overlap the previous launch of the same kernel in the graph, an overlap cuBLAS does not get; the
    decode benchmark (bench_e2e) measures PDL where it belongs, between different kernels.
    """
    old = os.environ.get("TRAPETUM_PDL")
    os.environ["TRAPETUM_PDL"] = "0"
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in calls:
                f()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in calls:
                f()
    finally:
        if old is None:
            os.environ.pop("TRAPETUM_PDL", None)
        else:
            os.environ["TRAPETUM_PDL"] = old
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    del g
    return statistics.median(times)


def _rand_codes(n, kb, gen):
    return torch.randint(0, 256, (n, kb), dtype=torch.uint8, device="cuda", generator=gen)


VARIANTS = (3, 4, 5, 7, 11)
GEMV_BACKENDS = ("mma",) + tuple(f"mma_v{v}" for v in VARIANTS) + ("triton",)


def bench_gemv(k: int, n: int, bits: int, m: int = 1, backends=GEMV_BACKENDS) -> dict:
    """One GEMV shape: cuBLAS fp16 (torch.matmul) vs the codebook kernels, same process."""
    from trapetum.kernels import codebook_gemv as cg
    gen = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    row = {"shape": f"{k}x{n}", "in": k, "out": n, "bits": bits, "M": m}
    fp16_bytes = n * k * 2 + m * k * 2 + m * n * 2

    def make_dense(i):
        w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        y = torch.empty(m, n, device="cuda", dtype=torch.float16)
        return lambda: torch.matmul(x, w.t(), out=y)

    row["cublas_us"] = graph_time_us(make_dense, fp16_bytes)
    row["cublas_GBps"] = fp16_bytes / row["cublas_us"] / 1e3
    from trapetum.kernels import cuda_ext
    from trapetum.kernels.dense_gemv import dense_gemv
    if m == 1 and bits == 4 and k % 8 == 0 and cuda_ext.ready() is not None:  # our fp16 GEMV (fp16 path)
        def make_ours(i):
            w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen)
            x = torch.randn(k, device="cuda", dtype=torch.float16, generator=gen)
            y = torch.empty(n, device="cuda", dtype=torch.float16)
            return lambda: dense_gemv(x, w, out=y)
        row["dense_us"] = graph_time_us(make_ours, fp16_bytes)
        row["dense_GBps"] = fp16_bytes / row["dense_us"] / 1e3
    kb = -(-k * bits // 8)
    q_bytes = n * kb + n * (1 << bits) * 2 + m * k * 2 + m * n * 2
    row["bytes"] = q_bytes
    for be in backends:
        if be.startswith("mma") and not (cg.mma_available() and cg._mma_shape_ok(m, k, bits)):
            continue
        kernel_be = "mma" if be.startswith("mma") else be

        tiled = be == f"mma_v{cg.TILED_VARIANT}" or (be == "mma" and cg._variant() == cg.TILED_VARIANT)

        def make_q(i, kernel_be=kernel_be, tiled=tiled):
            codes = _rand_codes(n, kb, gen)
            cb = torch.randn(n, 1 << bits, device="cuda", generator=gen).half()
            x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
            y = torch.empty(m, n, device="cuda", dtype=torch.float16)
            if tiled:  # the engine's layout for variant 11, made once at load
                codes = cg.tile_codes(codes)
            return lambda: cg.codebook_gemv(x, codes, cb, bits, out=y, backend=kernel_be, tiled=tiled)

        old_v = os.environ.get("TRAPETUM_GEMV_V")
        if bits == 8 and be.startswith("mma_v") and be not in ("mma_v3", "mma_v5", "mma_v7", "mma_v11"):
            continue  # the 8-bit head has the table kernels only (v4 == v3)
        if be.startswith("mma_v"):
            os.environ["TRAPETUM_GEMV_V"] = be[len("mma_v"):]
        try:
            us = graph_time_us(make_q, q_bytes)
        except Exception as e:  # report, keep going
            row[f"{be}_error"] = f"{type(e).__name__}: {e}"[:300]
            continue
        finally:
            if old_v is None:
                os.environ.pop("TRAPETUM_GEMV_V", None)
            else:
                os.environ["TRAPETUM_GEMV_V"] = old_v
        row[f"{be}_us"] = us
        row[f"{be}_GBps"] = q_bytes / us / 1e3
        row[f"{be}_vs_cublas"] = row["cublas_us"] / us
    return row


def bench_gate_up(k: int, f: int, bits: int = 4) -> dict:
    from trapetum.kernels import codebook_gemv as cg
    from trapetum.kernels import fused
    gen = torch.Generator(device="cuda").manual_seed(99)
    kb = k * bits // 8
    row = {"shape": f"{k}x2*{f}", "in": k, "out": 2 * f}
    q_bytes = 2 * f * kb + 2 * f * 32 + k * 2 + f * 2

    def make_sep(i):
        codes = _rand_codes(2 * f, kb, gen)
        cb = torch.randn(2 * f, 16, device="cuda", generator=gen).half()
        x = torch.randn(1, k, device="cuda", dtype=torch.float16, generator=gen)
        y = torch.empty(1, 2 * f, device="cuda", dtype=torch.float16)
        h = torch.empty(1, f, device="cuda", dtype=torch.float16)

        def op():
            cg.codebook_gemv(x, codes, cb, bits, out=y)
            fused.act_mul(y[:, :f], y[:, f:], "silu", out=h)
        return op

    def make_fused(i):
        codes = _rand_codes(2 * f, kb, gen)
        cb = torch.randn(2 * f, 16, device="cuda", generator=gen).half()
        x = torch.randn(1, k, device="cuda", dtype=torch.float16, generator=gen)
        h = torch.empty(1, f, device="cuda", dtype=torch.float16)
        return lambda: cg.codebook_gemv_gate_up(x, codes, cb, bits, f, "silu", out=h)

    row["separate_us"] = graph_time_us(make_sep, q_bytes)
    row["fused_us"] = graph_time_us(make_fused, q_bytes)
    row["fused_GBps"] = q_bytes / row["fused_us"] / 1e3
    return row


def bench_attention(hq: int, hkv: int, d: int, length: int, tmax: int = 4096) -> dict:
    from trapetum.kernels import attention as at
    gen = torch.Generator(device="cuda").manual_seed(length)
    kv_bytes = 2 * hkv * length * d * 2
    row = {"heads": f"{hq}/{hkv}x{d}", "length": length}
    for split in (True, False):
        def make(i, split=split):
            q = torch.randn(hq, d, device="cuda", generator=gen).half()
            k = torch.randn(hkv, tmax, d, device="cuda", generator=gen).half()
            v = torch.randn(hkv, tmax, d, device="cuda", generator=gen).half()
            ln = torch.tensor([length], dtype=torch.int32, device="cuda")
            ws = at.attention_workspace(hq, d, tmax, "cuda")
            out = torch.empty(hq, d, device="cuda", dtype=torch.float16)
            return lambda: at.decode_attention(q, k, v, ln, scale=d ** -0.5, out=out, workspace=ws, split=split)
        name = "split" if split else "seq"
        us = graph_time_us(make, max(kv_bytes, 2 * hkv * tmax * d * 2 // 4), max_sets=16)
        row[f"{name}_us"] = us
        row[f"{name}_GBps"] = kv_bytes / us / 1e3
    return row


def bench_fused(h: int = 4096, nh: int = 32, nkv: int = 32, d: int = 128, f: int = 11008) -> list[dict]:
    from trapetum.kernels import fused
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows = []

    def make_rms(i):
        x = torch.randn(1, h, device="cuda", generator=gen).half()
        w = torch.randn(h, device="cuda", generator=gen).half()
        y = torch.empty_like(x)
        return lambda: fused.rmsnorm(x, w, 1e-5, out=y)

    def make_rope(i):
        q = torch.randn(nh, d, device="cuda", generator=gen).half()
        k = torch.randn(nkv, d, device="cuda", generator=gen).half()
        v = torch.randn(nkv, d, device="cuda", generator=gen).half()
        kc = torch.zeros(nkv, 4096, d, device="cuda").half()
        vc = torch.zeros_like(kc)
        cos, sin = fused.rope_tables(4096, d, device="cuda")
        pos = torch.tensor([1000], device="cuda")
        return lambda: fused.rope_kv_append(q, k, v, kc, vc, pos, cos, sin)

    def make_act(i):
        g = torch.randn(1, f, device="cuda", generator=gen).half()
        u = torch.randn(1, f, device="cuda", generator=gen).half()
        y = torch.empty_like(g)
        return lambda: fused.act_mul(g, u, "silu", out=y)

    for name, mk in (("rmsnorm 4096", make_rms), ("rope+kv append 32/32x128", make_rope), ("silu*up 11008", make_act)):
        rows.append({"kernel": name, "us": graph_time_us(mk, 1 << 20, max_sets=16)})
    return rows


def copy_bandwidth_GBps() -> float:
    a = torch.randn(2**28, device="cuda").half()  # 512 MB
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    return 2 * a.numel() * 2 / statistics.median(ts) / 1e6


def _md(res: dict) -> str:
    L = ["# Kernel benchmark", "", f"- command: `{res['command']}`", f"- GPU: {res['gpu']}",
         f"- date: {res['date']}", f"- torch {res['torch']}, triton {res['triton']}, CUDA {res['cuda']}",
         f"- device copy bandwidth (read+write): {res['copy_GBps']:.0f} GB/s", "",
         "## GEMV, batch 1 unless noted (shape = in x out; CUDA-graph replays, weights rotated past L2, median)", "",
         f"default mma variant: v{res.get('default_variant', '?')}; vN columns: TRAPETUM_GEMV_V=N (NOTES-kernels.md)", "",
         "| shape | bits | M | cuBLAS fp16 us | our fp16 us (GB/s) | mma us | mma GB/s | mma vs cuBLAS | "
         + " | ".join(f"v{v} us" for v in VARIANTS) + " | Triton us | Triton vs cuBLAS |",
         "|---|---|---|---|---|---|---|---|" + "---|" * len(VARIANTS) + "---|---|"]

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"
    for r in res["gemv"]:
        vs = " | ".join(f(r.get(f"mma_v{v}_us"), ".1f") for v in VARIANTS)
        ours = f"{f(r.get('dense_us'), '.1f')} ({f(r.get('dense_GBps'), '.0f')})"
        L.append(f"| {r['shape']} | {r['bits']} | {r['M']} | {f(r.get('cublas_us'), '.1f')} | {ours} | {f(r.get('mma_us'), '.1f')} | "
                 f"{f(r.get('mma_GBps'), '.0f')} | {f(r.get('mma_vs_cublas'), '.2f')}x | {vs} | {f(r.get('triton_us'), '.1f')} | "
                 f"{f(r.get('triton_vs_cublas'), '.2f')}x |")
    if res.get("gate_up"):
        L += ["", "## Fused gate/up (SiLU) GEMV, 4-bit, batch 1", "", "| shape | GEMV + act_mul us | fused us | fused GB/s |", "|---|---|---|---|"]
        for r in res["gate_up"]:
            L.append(f"| {r['shape']} | {r['separate_us']:.1f} | {r['fused_us']:.1f} | {r['fused_GBps']:.0f} |")
    if not res["attention"]:
        return "\n".join(L) + "\n"
    L += ["", "## Decode attention (cache 4096 positions, length tensor on device)", "",
          "| heads (q/kv x D) | length | split-KV us | split GB/s | sequential us |", "|---|---|---|---|---|"]
    for r in res["attention"]:
        L.append(f"| {r['heads']} | {r['length']} | {r['split_us']:.1f} | {r['split_GBps']:.0f} | {r['seq_us']:.1f} |")
    L += ["", "## Small fused kernels", "", "| kernel | us |", "|---|---|"]
    for r in res["fused"]:
        L.append(f"| {r['kernel']} | {r['us']:.1f} |")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trapetum.eval.bench_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="directory for kernels.json and kernels.md")
    p.add_argument("--quick", action="store_true", help="fewer shapes (smoke test)")
    p.add_argument("--ncu-driver", action="store_true", help="a few eager GEMV launches to profile under ncu")
    p.add_argument("--only", choices=["all", "gemv"], default="all", help="gemv: GEMV tables only")
    p.add_argument("--backends", default=",".join(GEMV_BACKENDS),
                   help="comma list of GEMV backends to time (mma = default variant, mma_vN = TRAPETUM_GEMV_V=N)")
    a = p.parse_args(argv)
    if a.ncu_driver:
        return ncu_driver()
    res = run_all(a.out, quick=a.quick, only=a.only, backends=tuple(a.backends.split(",")),
                  command="python -m trapetum.eval.bench_kernels " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(res["markdown"])
    return 0


def ncu_driver() -> int:
    """Eager launches for `ncu -k regex:cb_gemv`: per shape, every variant (one launch each)."""
    from trapetum.kernels import codebook_gemv as cg
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, n, bits in ((4096, 11008, 4), (8192, 28672, 4), (4096, 32000, 8)):
        codes = _rand_codes(n, k * bits // 8, gen)
        cb = torch.randn(n, 1 << bits, device="cuda", generator=gen).half()
        x = torch.randn(1, k, device="cuda", dtype=torch.float16, generator=gen)
        tiled = cg.tile_codes(codes)
        for v in (("5", "7") if bits == 8 else ("3", "4", "5", "7")):
            os.environ["TRAPETUM_GEMV_V"] = v
            cg.codebook_gemv(x, codes, cb, bits, backend="mma")
        cg.codebook_gemv(x, tiled, cb, bits, tiled=True)  # variant 11
    torch.cuda.synchronize()
    os.environ.pop("TRAPETUM_GEMV_V", None)
    return 0


BENCH_4BIT = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (28672, 8192)]
BENCH_8BIT = [(4096, 32000)]


def run_all(out_dir: str | None, *, quick: bool = False, command: str = "", only: str = "all",
            backends: tuple = GEMV_BACKENDS) -> dict:
    """Run every benchmark; write kernels.json / kernels.md under out_dir; return the results."""
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels: needs a CUDA GPU")
    import triton
    res = {"command": command, "gpu": torch.cuda.get_device_name(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "host": platform.node(), "TRAPETUM_TC": os.environ.get("TRAPETUM_TC", "1")}
    from trapetum.kernels import codebook_gemv as cg
    res["default_variant"] = cg._variant()
    res["copy_GBps"] = copy_bandwidth_GBps()
    shapes4 = BENCH_4BIT[:2] if quick else BENCH_4BIT
    gemv = []
    for k, n in shapes4:
        gemv.append(bench_gemv(k, n, 4, backends=backends))
        print(json.dumps(gemv[-1]), flush=True)
    for k, n in BENCH_8BIT:
        gemv.append(bench_gemv(k, n, 8, backends=backends))
        print(json.dumps(gemv[-1]), flush=True)
    for m in ((2, 4, 8, 16) if not quick else (8,)):  # speculative-verify rows
        gemv.append(bench_gemv(4096, 11008, 4, m=m, backends=tuple(b for b in backends if b.startswith("mma"))))
        print(json.dumps(gemv[-1]), flush=True)
    res["gemv"] = gemv
    res["gate_up"], res["attention"], res["fused"] = [], [], []
    if only == "gemv":
        return _finish(res, out_dir)
    res["gate_up"] = [bench_gate_up(4096, 11008)]
    att = []
    for hq, hkv, d in ((32, 32, 128), (32, 8, 128)):
        for length in (1024, 4096):
            att.append(bench_attention(hq, hkv, d, length))
            print(json.dumps(att[-1]), flush=True)
    res["attention"] = att
    res["fused"] = bench_fused()
    return _finish(res, out_dir)


def _finish(res: dict, out_dir: str | None) -> dict:
    res["markdown"] = _md(res)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, "kernels.json").write_text(json.dumps({k: v for k, v in res.items() if k != "markdown"}, indent=1))
        Path(out_dir, "kernels.md").write_text(res["markdown"])
    return res


if __name__ == "__main__":
    sys.exit(main())
