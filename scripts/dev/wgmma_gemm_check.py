"""Session 19: the wgmma many-row 4-bit GEMV (trapetum/kernels/codebook_gemm_wgmma.py) against the
production grouped mma kernel: bits (every element, EPI 0 with and without residual, gate/up SiLU), a float64
check, sampled rows against their one-row calls; then graph-timed microseconds of both at the Llama-2-7B shapes.

    python3 scripts/dev/wgmma_gemm_check.py [--rows 17,32,33,64] [--out DIR] [--no-bench]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trapetum.eval.bench_kernels import graph_time_us  # noqa: E402
from trapetum.kernels import codebook_gemv as cg  # noqa: E402
from trapetum.kernels import codebook_gemm_wgmma as wg  # noqa: E402
from trapetum.settings import DEFAULT_KERNELS  # noqa: E402
import dataclasses  # noqa: E402

KOPTS = dataclasses.replace(DEFAULT_KERNELS, pdl="off", many_rows="mma")  # the grouped mma kernel
# (name, nx, rs, wg) timed; 0 = the launcher's choice. wg: warpgroups a block sharing its x stages (session 20)
VARIANTS = [("auto", 0, 0, 0), ("wg2", 64, 0, 2), ("wg2-rs4", 64, 4, 2), ("wg3", 64, 0, 3), ("wg3-rs8", 64, 8, 3),
            ("wg3-rs2", 64, 2, 3)]


def case(n, k, m, gen, gate_up=False, spread=False):
    rows = 2 * n if gate_up else n
    codes = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    cb = torch.randn(rows, 16, device="cuda", generator=gen).half()
    if gate_up:
        codes, cb, _ = cg.interleave_gate_up(codes[:n], cb[:n], codes[n:], cb[n:])
    x = torch.randn(m, k, device="cuda", generator=gen)
    if spread:  # exponents over 2^-6..2^4: alignment and cancellation inside the k-steps (no fp16 overflow)
        x = x * torch.exp2(torch.randint(-6, 5, (m, k), device="cuda", generator=gen).float())
    return cg.tile_codes(codes), cb, x.half(), codes


def check(args, gen) -> list[str]:
    bad = []
    shapes = [(64, 256), (80, 384), (4096, 4096), (11008 // 4, 1024), (96, 11008 // 2 // 64 * 128), (300, 640)]
    for (n, k) in shapes:
        for m in args.rows:
            for nx, rs, wgs in [(0, 0, 0), (32, 1, 1), (64, 1, 1), (64, 2, 1), (32, 8, 1), (64, 8, 1), (64, 0, 2),
                                (32, 4, 3), (64, 8, 3)]:
                for mode in ("plain", "res", "gate_up"):
                    gu = mode == "gate_up"
                    if gu and n % 16:
                        continue
                    tiled, cb, x, canon = case(n, k, m, gen, gate_up=gu, spread=(m % 2 == 1 and not gu))
                    if gu:
                        y0 = torch.empty(m, n, device="cuda", dtype=torch.float16)
                        y1 = torch.empty_like(y0)
                        cg.codebook_gemv_gate_up(x, tiled, cb, 4, n, out=y0, tiled=True, kopts=KOPTS)
                        wg.gemm(x, tiled, cb, y1, gate_up_f=n, act=1, nx=nx, rs=rs, wg=wgs)
                    else:
                        res = torch.randn(m, n, device="cuda", generator=gen).half() if mode == "res" else None
                        y0 = torch.empty(m, n, device="cuda", dtype=torch.float16)
                        y1 = torch.empty_like(y0)
                        cg.codebook_gemv(x, tiled, cb, 4, out=y0, tiled=True, residual=res, kopts=KOPTS)
                        wg.gemm(x, tiled, cb, y1, residual=res, nx=nx, rs=rs, wg=wgs)
                        ref = cg.codebook_gemv_reference(x, canon, cb, 4, res)  # float64 sanity
                        err = ((y1.double() - ref).norm() / ref.norm()).item()
                        if not err < 2e-3:
                            bad.append(f"{n}x{k} m={m} nx={nx} rs={rs} wg={wgs} {mode}: float64 rel err {err:.2e}")
                    torch.cuda.synchronize()
                    diff = (y0.view(torch.int16) != y1.view(torch.int16)).sum().item()
                    if diff:
                        bad.append(f"{n}x{k} m={m} nx={nx} rs={rs} wg={wgs} {mode}: {diff} of {y0.numel()} elements differ in bits")
                    if mode == "plain":  # a few rows against their one-row calls
                        for r in (0, m // 2, m - 1):
                            y2 = torch.empty(1, n, device="cuda", dtype=torch.float16)
                            cg.codebook_gemv(x[r:r + 1].contiguous(), tiled, cb, 4, out=y2, tiled=True, kopts=KOPTS)
                            if not torch.equal(y2.view(torch.int16)[0], y1.view(torch.int16)[r]):
                                bad.append(f"{n}x{k} m={m} nx={nx} rs={rs} wg={wgs}: row {r} differs from its one-row call")
    return bad


def bench(args, gen) -> list[dict]:
    out = []
    for (k, n, gu) in [(4096, 11008, False), (11008, 4096, False), (4096, 4096, False), (4096, 11008, True)]:
        rows = 2 * n if gu else n
        for m in args.bench_rows:
            nbytes = rows * k // 2 + m * k * 2

            def make(i, kind, nx=0, rs=0, wgs=0):
                tiled, cb, x, _ = case(n, k, m, gen, gate_up=gu)
                y = torch.empty(m, n, device="cuda", dtype=torch.float16)
                if kind == "prod":
                    if gu:
                        return lambda: cg.codebook_gemv_gate_up(x, tiled, cb, 4, n, out=y, tiled=True, kopts=KOPTS)
                    return lambda: cg.codebook_gemv(x, tiled, cb, 4, out=y, tiled=True, kopts=KOPTS)
                return lambda: wg.gemm(x, tiled, cb, y, gate_up_f=n if gu else 0, nx=nx, rs=rs, wg=wgs)
            row = {"shape": f"{k}x{n}" + (" gate/up" if gu else ""), "M": m,
                   "prod_us": graph_time_us(lambda i: make(i, "prod"), nbytes, max_sets=16)}
            for name, nx, rs, wgs in VARIANTS:
                row[name] = graph_time_us(lambda i, nx=nx, rs=rs, wgs=wgs: make(i, "wg", nx, rs, wgs), nbytes,
                                          max_sets=16)
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="17,32,33,64")
    p.add_argument("--out", default=None)
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--bench-rows", default="32,64", help="row counts of the timing table")
    a = p.parse_args()
    a.rows = [int(v) for v in a.rows.split(",")]
    a.bench_rows = [int(v) for v in a.bench_rows.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    bad = check(a, gen)
    print(f"bits: {'all equal' if not bad else str(len(bad)) + ' problems'}")
    for b in bad[:40]:
        print("  ", b)
    res = {"problems": bad}
    if not a.no_bench:
        res["bench"] = bench(a, gen)
        print("| shape | M | grouped mma us | " + " | ".join(f"wgmma {v[0]} us (x mma)" for v in VARIANTS) + " |")
        print("|---|---|---|" + "---|" * len(VARIANTS))
        for r in res["bench"]:
            print(f"| {r['shape']} | {r['M']} | {r['prod_us']:.1f} | " + " | ".join(
                f"{r[v[0]]:.1f} ({r[v[0]] / r['prod_us']:.2f})" for v in VARIANTS) + " |")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "wgmma_gemm.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
