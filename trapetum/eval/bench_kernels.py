"""Kernel benchmark: codebook GEMV vs cuBLAS fp16, multi-row GEMVs, decode attention, fused kernels.

    python -m trapetum.eval.bench_kernels --out DIR      (or: trapetum bench kernels --out DIR)
    python -m trapetum.eval.bench_kernels --only rows --rows 1,2,4,8,16 --out DIR
    python -m trapetum.eval.bench_kernels --only rows --rows 1,16,32,64 --kinds cb4,cb4-g4,cb4-g2,gu4 --out DIR

Protocol (DESIGN.md "Measuring"): random data (never zeros); every op is captured in a CUDA graph that launches it
once per buffer set, with enough sets that the bytes touched per replay exceed the 60 MB L2 several times (so
weights come from HBM); warm-up replays first; the figure is the median over timed replays of (replay time /
launches). GEMV shapes are written in x out: x [M, in] @ W.T, W [out, in]. Writes DIR/kernels.json and
DIR/kernels.md and prints the table.

Kernel options: the run's options are read from the environment once (``Options.from_env``, as at any entry
point) and passed to every call. The single-kernel tables time each kernel with programmatic dependent launch off
(with it, a launch's prologue would overlap the previous launch of the same kernel in the graph, an overlap cuBLAS
does not get; bench_e2e measures PDL where it belongs, between different kernels). The rows table (``--rows``)
times M = 1..16 activation rows (speculative verify) of the production GEMVs, each row count relative to M = 1 in
the same run, with PDL off and, for the codebook GEMVs, on; beside them the codebook kernel as it was before the
multi-row work (experimental variant 11) and cuBLAS (which is not batch-invariant). More than 16 rows (batched
decode, tiled codes: one launch over groups of 16 rows): the production kinds run the default of
``KernelOptions.grouped_gemv_groups`` (1: a block per group), the kinds ``-g4`` / ``-g2`` / ``-g1`` 4 and 2 groups
a block and a block per group; the kinds that cannot take more than 16 rows report an error at those M.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import platform
import statistics
import sys
from pathlib import Path

import torch

from ..settings import DEFAULT_KERNELS, KernelOptions, Options

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

    The calls carry their own kernel options (``kopts=``): this module's tables pass PDL off (``_no_pdl``).
    """
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


def _no_pdl(kopts: KernelOptions) -> KernelOptions:
    return dataclasses.replace(kopts, pdl="off")


def _rand_codes(n, kb, gen):
    return torch.randint(0, 256, (n, kb), dtype=torch.uint8, device="cuda", generator=gen)


VARIANTS = (3, 4, 5, 7, 11)  # kernels/experimental/codebook_gemv_variants.py
GEMV_BACKENDS = ("mma", "mma_canonical") + tuple(f"mma_v{v}" for v in VARIANTS) + ("triton",)


def _codebook_op(be: str, codes, cb, bits, x, y, kopts):
    """A launch of backend `be` (GEMV_BACKENDS) on canonical `codes`: mma = the production kernel on tiled codes,
    mma_canonical = on canonical codes, mma_vN = experimental variant N, triton = the Triton kernel."""
    from ..kernels import codebook_gemv as cg
    if be.startswith("mma_v"):
        from ..kernels.experimental import codebook_gemv_variants as xv
        v = int(be[len("mma_v"):])
        c = cg.tile_codes(codes) if v == xv.TILED_VARIANT else codes
        if bits == 8 and v == 4:
            raise ValueError("variant 4 is 4-bit only (the 8-bit head runs variant 3)")
        return lambda: xv.gemv(x, c, cb, bits, out=y, variant=v, kopts=kopts)
    if be == "mma":
        c = cg.tile_codes(codes)
        return lambda: cg.codebook_gemv(x, c, cb, bits, out=y, tiled=True, kopts=kopts)
    kernel_be = "mma" if be == "mma_canonical" else be
    return lambda: cg.codebook_gemv(x, codes, cb, bits, out=y, backend=kernel_be, kopts=kopts)


def bench_gemv(k: int, n: int, bits: int, m: int = 1, backends=GEMV_BACKENDS,
               kopts: KernelOptions = DEFAULT_KERNELS) -> dict:
    """One GEMV shape: cuBLAS fp16 (torch.matmul) and our fp16 GEMV vs the codebook kernels, same process."""
    from ..kernels import codebook_gemv as cg
    from ..kernels import cuda_ext
    from ..kernels.dense_gemv import dense_gemv
    kopts = _no_pdl(kopts)
    gen = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    row = {"shape": f"{k}x{n}", "in": k, "out": n, "bits": bits, "M": m}
    fp16_bytes = n * k * 2 + m * k * 2 + m * n * 2

    def make_dense(i, ours=False):
        w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        y = torch.empty(m, n, device="cuda", dtype=torch.float16)
        if ours:
            return lambda: dense_gemv(x, w, out=y, kopts=kopts)
        return lambda: torch.matmul(x, w.t(), out=y)

    row["cublas_us"] = graph_time_us(make_dense, fp16_bytes)
    row["cublas_GBps"] = fp16_bytes / row["cublas_us"] / 1e3
    if bits == 4 and k % 8 == 0 and cuda_ext.ready(None, kopts) is not None:  # our fp16 GEMV (fp16 path)
        row["dense_us"] = graph_time_us(lambda i: make_dense(i, ours=True), fp16_bytes)
        row["dense_GBps"] = fp16_bytes / row["dense_us"] / 1e3
    kb = -(-k * bits // 8)
    q_bytes = n * kb + n * (1 << bits) * 2 + m * k * 2 + m * n * 2
    row["bytes"] = q_bytes
    for be in backends:
        if be.startswith("mma") and not (cg.mma_available(None, kopts) and cg.mma_shape_ok(m, k, bits)):
            continue
        if bits == 8 and be == "mma_v4":
            continue  # the 8-bit head has the table kernels only

        def make_q(i, be=be):
            codes = _rand_codes(n, kb, gen)
            cb = torch.randn(n, 1 << bits, device="cuda", generator=gen).half()
            x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
            y = torch.empty(m, n, device="cuda", dtype=torch.float16)
            return _codebook_op(be, codes, cb, bits, x, y, kopts)

        try:
            us = graph_time_us(make_q, q_bytes)
        except Exception as e:  # report, keep going
            row[f"{be}_error"] = f"{type(e).__name__}: {e}"[:300]
            continue
        row[f"{be}_us"] = us
        row[f"{be}_GBps"] = q_bytes / us / 1e3
        row[f"{be}_vs_cublas"] = row["cublas_us"] / us
    return row


def bench_gate_up(k: int, f: int, bits: int = 4, kopts: KernelOptions = DEFAULT_KERNELS) -> dict:
    from ..kernels import codebook_gemv as cg
    from ..kernels import fused
    kopts = _no_pdl(kopts)
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
            cg.codebook_gemv(x, codes, cb, bits, out=y, kopts=kopts)
            fused.act_mul(y[:, :f], y[:, f:], "silu", out=h)
        return op

    def make_fused(i):
        codes = _rand_codes(2 * f, kb, gen)
        cb = torch.randn(2 * f, 16, device="cuda", generator=gen).half()
        x = torch.randn(1, k, device="cuda", dtype=torch.float16, generator=gen)
        h = torch.empty(1, f, device="cuda", dtype=torch.float16)
        return lambda: cg.codebook_gemv_gate_up(x, codes, cb, bits, f, "silu", out=h, kopts=kopts)

    row["separate_us"] = graph_time_us(make_sep, q_bytes)
    row["fused_us"] = graph_time_us(make_fused, q_bytes)
    row["fused_GBps"] = q_bytes / row["fused_us"] / 1e3
    return row


# ----------------------------------------------------------------------------- multi-row (verify) GEMVs
ROWS_4BIT = [(4096, 4096), (4096, 11008), (11008, 4096)]
ROWS_8BIT = [(4096, 32000)]
ROWS_GATE_UP = [(4096, 11008)]  # in x F: [gate; up] of 2 x F rows
ROWS_DENSE = [(4096, 4096), (4096, 11008), (11008, 4096)]


def _rows_case(kind: str, k: int, n: int, m: int, gen, kopts):
    """(make_op, bytes per set) of one multi-row case: kind in cb4, cb4-frag, cb4-old, cb8, cb8-old, gu4, gu4-old,
    fp16, fp16-gu, cublas (n = F for the gate/up kinds). cb4-frag: x handed over in fragment order for
    M >= FRAG_ROWS (``Fragments``, as the engine's producers write it: no copy launch), row-major below."""
    from ..kernels.codebook_layout import FRAG_ROWS, Fragments, to_fragments
    from ..kernels import codebook_gemv as cg
    from ..kernels.dense_gemv import dense_gemv, dense_gemv_gate_up
    from ..kernels.experimental import codebook_gemv_variants as xv
    old = kind.endswith("-old")
    if kind.startswith(("cb", "gu")):
        bits = 8 if kind.startswith("cb8") else 4
        gate_up = kind.startswith("gu")
        rows, kb = (2 * n if gate_up else n), k * bits // 8
        nbytes = rows * kb + rows * (2 << bits) + m * k * 2 + m * n * 2

        def make(i):
            codes = _rand_codes(rows, kb, gen)
            cb = torch.randn(rows, 1 << bits, device="cuda", generator=gen).half()
            if gate_up:
                codes, cb, _ = cg.interleave_gate_up(codes[:n], cb[:n], codes[n:], cb[n:])
            tiled = cg.tile_codes(codes)
            x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
            y = torch.empty(m, n, device="cuda", dtype=torch.float16)
            if gate_up and old:
                return lambda: xv.gemv_gate_up(x, tiled, cb, bits, n, out=y, variant=11, kopts=kopts)
            if gate_up:
                return lambda: cg.codebook_gemv_gate_up(x, tiled, cb, bits, n, out=y, tiled=True, kopts=kopts)
            if old:
                return lambda: xv.gemv(x, tiled, cb, bits, out=y, variant=11, kopts=kopts)
            if kind == "cb4-frag" and m >= FRAG_ROWS:
                x = Fragments(to_fragments(x, bits), bits)
            return lambda: cg.codebook_gemv(x, tiled, cb, bits, out=y, tiled=True, kopts=kopts)
        return make, nbytes
    rows = 2 * n if kind == "fp16-gu" else n
    nbytes = rows * k * 2 + m * k * 2 + m * n * 2

    def make_dense(i):
        w = torch.randn(rows, k, device="cuda", dtype=torch.float16, generator=gen)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        y = torch.empty(m, n, device="cuda", dtype=torch.float16)
        if kind == "fp16-gu":
            return lambda: dense_gemv_gate_up(x, w, n, "silu", out=y, kopts=kopts)
        if kind == "fp16":
            return lambda: dense_gemv(x, w, out=y, kopts=kopts)
        return lambda: torch.matmul(x, w.t(), out=y)
    return make_dense, nbytes


ROW_KINDS = {  # kind -> (label, shapes)
    "cb4": ("4-bit GEMV (tiled, production)", ROWS_4BIT),
    "cb4-frag": ("4-bit GEMV, x in fragment order from its producer (the engine's verify)", ROWS_4BIT),
    "cb4-old": ("4-bit GEMV, kernel before the multi-row work (exp. v11)", ROWS_4BIT),
    "gu4": ("4-bit gate/up SiLU (tiled, production)", ROWS_GATE_UP),
    "gu4-old": ("4-bit gate/up, kernel before the multi-row work (exp. v11)", ROWS_GATE_UP),
    "cb8": ("8-bit GEMV (LM head, tiled, production)", ROWS_8BIT),
    "cb8-old": ("8-bit GEMV, kernel before the multi-row work (exp. v11)", ROWS_8BIT),
    "cb4-g4": ("4-bit GEMV (tiled), M > 16: 4 row groups a block", ROWS_4BIT),
    "cb4-g2": ("4-bit GEMV (tiled), M > 16: 2 row groups a block", ROWS_4BIT),
    "cb4-g1": ("4-bit GEMV (tiled), M > 16: a block per row group (session 10)", ROWS_4BIT),
    "gu4-g1": ("4-bit gate/up SiLU (tiled), M > 16: a block per row group (session 10)", ROWS_GATE_UP),
    "cb8-g1": ("8-bit GEMV (LM head, tiled), M > 16: a block per row group (session 10)", ROWS_8BIT),
    "fp16": ("fp16 GEMV (ours)", ROWS_DENSE),
    "fp16-gu": ("fp16 gate/up SiLU (ours)", ROWS_GATE_UP),
    "cublas": ("cuBLAS fp16 matmul (not batch-invariant)", ROWS_DENSE),
}


def bench_rows(rows=(1, 2, 4, 8, 16), kopts: KernelOptions = DEFAULT_KERNELS, kinds=tuple(ROW_KINDS)) -> list[dict]:
    """Each multi-row case at M in `rows` (1 is always timed), relative to M = 1 in the same run; PDL off, and on
    for the production codebook kinds."""
    rows = sorted(set(rows) | {1})
    out = []
    for kind in kinds:
        label, shapes = ROW_KINDS[kind]
        pdl_modes = ("off", "all") if kind in ("cb4", "cb4-frag", "gu4", "cb8") else ("off",)
        groups = {"g4": 4, "g2": 2, "g1": 1}.get(kind.rsplit("-", 1)[-1], kopts.grouped_gemv_groups)
        for k, n in shapes:
            for pdl_mode in pdl_modes:
                ko = dataclasses.replace(kopts, pdl=pdl_mode, grouped_gemv_groups=groups)
                gen = torch.Generator(device="cuda").manual_seed(k + n)
                r = {"kernel": label, "kind": kind, "shape": f"{k}x{n}" if not kind.startswith(("gu", "fp16-gu"))
                     else f"{k}x2*{n}", "pdl": pdl_mode, "us": {}}
                for m in rows:
                    try:
                        make, nbytes = _rows_case(kind, k, n, m, gen, ko)
                        r["us"][m] = graph_time_us(make, nbytes)
                    except Exception as e:  # report, keep going
                        r.setdefault("errors", {})[m] = f"{type(e).__name__}: {e}"[:300]
                base = r["us"].get(1)
                r["vs_m1"] = {m: us / base for m, us in r["us"].items()} if base else {}
                out.append(r)
                print(json.dumps(r), flush=True)
    return out


def _rows_md(rows: list[dict]) -> list[str]:
    ms = sorted({m for r in rows for m in r["us"]})
    L = ["", "## Multi-row GEMVs (speculative verify): time at M rows / time at M = 1, same run", "",
         "| kernel | shape | PDL | M=1 us | " + " | ".join(f"M={m}" for m in ms if m != 1) + " |",
         "|---|---|---|---|" + "---|" * (len(ms) - 1)]
    for r in rows:
        cells = [f"{r['vs_m1'][m]:.2f}x ({r['us'][m]:.1f})" if m in r["vs_m1"] else "-" for m in ms if m != 1]
        m1 = f"{r['us'][1]:.1f}" if 1 in r["us"] else "-"
        L.append(f"| {r['kernel']} | {r['shape']} | {r['pdl']} | {m1} | " + " | ".join(cells) + " |")
    return L


# ----------------------------------------------------------------------------- attention, small kernels
def bench_attention(hq: int, hkv: int, d: int, length: int, tmax: int = 4096,
                    kopts: KernelOptions = DEFAULT_KERNELS) -> dict:
    from ..kernels import attention as at
    from ..kernels.experimental.attention_seq import decode_attention_seq
    kopts = _no_pdl(kopts)
    gen = torch.Generator(device="cuda").manual_seed(length)
    kv_bytes = 2 * hkv * length * d * 2
    row = {"heads": f"{hq}/{hkv}x{d}", "length": length}
    for name in ("split", "seq"):
        def make(i, name=name):
            q = torch.randn(hq, d, device="cuda", generator=gen).half()
            k = torch.randn(hkv, tmax, d, device="cuda", generator=gen).half()
            v = torch.randn(hkv, tmax, d, device="cuda", generator=gen).half()
            ln = torch.tensor([length], dtype=torch.int32, device="cuda")
            out = torch.empty(hq, d, device="cuda", dtype=torch.float16)
            if name == "seq":
                return lambda: decode_attention_seq(q, k, v, ln, scale=d ** -0.5, out=out)
            ws = at.attention_workspace(hq, d, tmax, "cuda", hkv=hkv)
            return lambda: at.decode_attention(q, k, v, ln, scale=d ** -0.5, out=out, workspace=ws, kopts=kopts)
        us = graph_time_us(make, max(kv_bytes, 2 * hkv * tmax * d * 2 // 4), max_sets=16)
        row[f"{name}_us"] = us
        row[f"{name}_GBps"] = kv_bytes / us / 1e3
    return row


def bench_fused(h: int = 4096, nh: int = 32, nkv: int = 32, d: int = 128, f: int = 11008,
                kopts: KernelOptions = DEFAULT_KERNELS) -> list[dict]:
    from ..kernels import fused
    kopts = _no_pdl(kopts)
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows = []

    def make_rms(i):
        x = torch.randn(1, h, device="cuda", generator=gen).half()
        w = torch.randn(h, device="cuda", generator=gen).half()
        y = torch.empty_like(x)
        return lambda: fused.rmsnorm(x, w, 1e-5, out=y, kopts=kopts)

    def make_rope(i):
        q = torch.randn(nh, d, device="cuda", generator=gen).half()
        k = torch.randn(nkv, d, device="cuda", generator=gen).half()
        v = torch.randn(nkv, d, device="cuda", generator=gen).half()
        kc = torch.zeros(nkv, 4096, d, device="cuda").half()
        vc = torch.zeros_like(kc)
        cos, sin = fused.rope_tables(4096, d, device="cuda")
        pos = torch.tensor([1000], device="cuda")
        return lambda: fused.rope_kv_append(q, k, v, kc, vc, pos, cos, sin, kopts=kopts)

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
         f"- kernel options: {res['kernel_options']}",
         f"- device copy bandwidth (read+write): {res['copy_GBps']:.0f} GB/s", ""]

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"
    if res["gemv"]:
        L += ["## GEMV, batch 1 unless noted (shape = in x out; CUDA-graph replays, weights rotated past L2, median, "
              "PDL off)", "",
              "mma: the production kernel on tiled codes; canonical: on canonical codes; vN: experimental variant N "
              "(kernels/experimental/codebook_gemv_variants.py, NOTES-kernels.md)", "",
              "| shape | bits | M | cuBLAS fp16 us | our fp16 us (GB/s) | mma us | mma GB/s | mma vs cuBLAS | canonical us | "
              + " | ".join(f"v{v} us" for v in VARIANTS) + " | Triton us | Triton vs cuBLAS |",
              "|---|---|---|---|---|---|---|---|---|" + "---|" * len(VARIANTS) + "---|---|"]
        for r in res["gemv"]:
            vs = " | ".join(f(r.get(f"mma_v{v}_us"), ".1f") for v in VARIANTS)
            ours = f"{f(r.get('dense_us'), '.1f')} ({f(r.get('dense_GBps'), '.0f')})"
            L.append(f"| {r['shape']} | {r['bits']} | {r['M']} | {f(r.get('cublas_us'), '.1f')} | {ours} | "
                     f"{f(r.get('mma_us'), '.1f')} | {f(r.get('mma_GBps'), '.0f')} | {f(r.get('mma_vs_cublas'), '.2f')}x | "
                     f"{f(r.get('mma_canonical_us'), '.1f')} | {vs} | {f(r.get('triton_us'), '.1f')} | "
                     f"{f(r.get('triton_vs_cublas'), '.2f')}x |")
    if res.get("rows"):
        L += _rows_md(res["rows"])
    if res.get("gate_up"):
        L += ["", "## Fused gate/up (SiLU) GEMV, 4-bit, batch 1", "", "| shape | GEMV + act_mul us | fused us | fused GB/s |",
              "|---|---|---|---|"]
        for r in res["gate_up"]:
            L.append(f"| {r['shape']} | {r['separate_us']:.1f} | {r['fused_us']:.1f} | {r['fused_GBps']:.0f} |")
    if res.get("attention"):
        L += ["", "## Decode attention (cache 4096 positions, length tensor on device)", "",
              "| heads (q/kv x D) | length | split-KV us | split GB/s | sequential us |", "|---|---|---|---|---|"]
        for r in res["attention"]:
            L.append(f"| {r['heads']} | {r['length']} | {r['split_us']:.1f} | {r['split_GBps']:.0f} | {r['seq_us']:.1f} |")
    if res.get("fused"):
        L += ["", "## Small fused kernels", "", "| kernel | us |", "|---|---|"]
        for r in res["fused"]:
            L.append(f"| {r['kernel']} | {r['us']:.1f} |")
    return "\n".join(L) + "\n"


def _int_list(s: str) -> tuple[int, ...]:
    from ..kernels.codebook_gemv import MAX_GROUPED_ROWS
    try:
        v = tuple(int(t) for t in s.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of row counts, got {s!r}") from None
    if not v or any(not 1 <= m <= MAX_GROUPED_ROWS for m in v):
        raise argparse.ArgumentTypeError(f"row counts must be in 1..{MAX_GROUPED_ROWS}, got {s!r}")
    return v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trapetum.eval.bench_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="directory for kernels.json and kernels.md")
    p.add_argument("--quick", action="store_true", help="fewer shapes (smoke test)")
    p.add_argument("--ncu-driver", action="store_true", help="a few eager GEMV launches to profile under ncu")
    p.add_argument("--only", choices=["all", "gemv", "rows"], default="all",
                   help="gemv: GEMV tables only; rows: the multi-row table only")
    p.add_argument("--backends", default=",".join(GEMV_BACKENDS),
                   help="comma list of GEMV backends to time (mma = production on tiled codes, mma_canonical, "
                        "mma_vN = experimental variant N, triton)")
    p.add_argument("--rows", type=_int_list, default=None,
                   help="comma list of activation row counts (e.g. 1,2,4,8,16): adds the multi-row table")
    p.add_argument("--kinds", default=None,
                   help=f"comma list of the multi-row table's kinds (default all: {','.join(ROW_KINDS)})")
    a = p.parse_args(argv)
    kinds = tuple(x for x in (a.kinds or "").split(",") if x) or None
    if kinds and any(x not in ROW_KINDS for x in kinds):
        p.error(f"--kinds: unknown {','.join(x for x in kinds if x not in ROW_KINDS)}; known: {','.join(ROW_KINDS)}")
    kopts = Options.from_env().kernels
    if a.ncu_driver:
        return ncu_driver(kopts)
    res = run_all(a.out, quick=a.quick, only=a.only, backends=tuple(a.backends.split(",")), rows=a.rows, kopts=kopts,
                  kinds=kinds, command="python -m trapetum.eval.bench_kernels " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(res["markdown"])
    return 0


def ncu_driver(kopts: KernelOptions | None = None) -> int:
    """Eager launches for `ncu -k regex:cb_gemv`: per shape, the production kernel (tiled, canonical) at M = 1 and
    8 and every experimental variant at M = 1 (one launch each)."""
    from ..kernels import codebook_gemv as cg
    from ..kernels.experimental import codebook_gemv_variants as xv
    kopts = _no_pdl(kopts or Options.from_env().kernels)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, n, bits in ((4096, 11008, 4), (8192, 28672, 4), (4096, 32000, 8)):
        codes = _rand_codes(n, k * bits // 8, gen)
        cb = torch.randn(n, 1 << bits, device="cuda", generator=gen).half()
        tiled = cg.tile_codes(codes)
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
            cg.codebook_gemv(x, tiled, cb, bits, tiled=True, kopts=kopts)
            cg.codebook_gemv(x, codes, cb, bits, backend="mma", kopts=kopts)
        x = torch.randn(1, k, device="cuda", dtype=torch.float16, generator=gen)
        for v in ((3, 5, 7, 11) if bits == 8 else VARIANTS):
            xv.gemv(x, tiled if v == xv.TILED_VARIANT else codes, cb, bits, variant=v, kopts=kopts)
    torch.cuda.synchronize()
    return 0


BENCH_4BIT = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (28672, 8192)]
BENCH_8BIT = [(4096, 32000)]


def run_all(out_dir: str | None, *, quick: bool = False, command: str = "", only: str = "all",
            backends: tuple = GEMV_BACKENDS, rows: tuple[int, ...] | None = None,
            kopts: KernelOptions | None = None, kinds: tuple[str, ...] | None = None) -> dict:
    """Run the benchmarks; write kernels.json / kernels.md under out_dir; return the results.

    kopts: the kernel options (None: ``Options.from_env().kernels``); rows: add the multi-row table (``only="rows"``:
    that table alone, rows default 1,2,4,8,16; kinds: its kinds, default all of ``ROW_KINDS``)."""
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels: needs a CUDA GPU")
    import triton
    kopts = kopts if kopts is not None else Options.from_env().kernels
    res = {"command": command, "gpu": torch.cuda.get_device_name(),
           "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "host": platform.node(), "kernel_options": dataclasses.asdict(kopts)}
    res["copy_GBps"] = copy_bandwidth_GBps()
    res["gemv"], res["rows"], res["gate_up"], res["attention"], res["fused"] = [], [], [], [], []
    if only == "rows":
        res["rows"] = bench_rows(rows or (1, 2, 4, 8, 16), kopts, kinds=kinds or tuple(ROW_KINDS))
        return _finish(res, out_dir)
    shapes4 = BENCH_4BIT[:2] if quick else BENCH_4BIT
    for k, n in shapes4:
        res["gemv"].append(bench_gemv(k, n, 4, backends=backends, kopts=kopts))
        print(json.dumps(res["gemv"][-1]), flush=True)
    for k, n in BENCH_8BIT:
        res["gemv"].append(bench_gemv(k, n, 8, backends=backends, kopts=kopts))
        print(json.dumps(res["gemv"][-1]), flush=True)
    for m in ((2, 4, 8, 16) if not quick else (8,)):  # speculative-verify rows
        res["gemv"].append(bench_gemv(4096, 11008, 4, m=m, backends=tuple(b for b in backends if b.startswith("mma")),
                                      kopts=kopts))
        print(json.dumps(res["gemv"][-1]), flush=True)
    if rows:
        res["rows"] = bench_rows(rows, kopts, kinds=kinds or tuple(ROW_KINDS))
    if only == "gemv":
        return _finish(res, out_dir)
    res["gate_up"] = [bench_gate_up(4096, 11008, kopts=kopts)]
    for hq, hkv, d in ((32, 32, 128), (32, 8, 128)):
        for length in (1024, 4096):
            res["attention"].append(bench_attention(hq, hkv, d, length, kopts=kopts))
            print(json.dumps(res["attention"][-1]), flush=True)
    res["fused"] = bench_fused(kopts=kopts)
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
