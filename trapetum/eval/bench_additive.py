"""2-bit additive (AQLM 2x8 / 1x16) GEMV benchmark: against cuBLAS fp16, and M activation rows against one.

    python -m trapetum.eval.bench_additive [--backends cuda,triton,mma] [--layouts 2x8,1x16] [--bps 1,3]
                                           [--rows 1,2,4,8,16] [--shapes 4096x4096,...] [--json PATH]

Protocol (DESIGN.md "Measuring", ``bench_kernels.graph_time_us``): random codes, codebooks, scales and
activations (never zeros), a fresh set of weights per buffer set, enough sets that a replay touches several
times the L2; every op captured in one CUDA graph launching it once per set; median over timed replays. Kernel
options: ``KernelOptions(pdl="off")`` (no programmatic launch between launches of the same GEMV, as cuBLAS
gets none) and ``aqlm_blocks_per_sm`` from ``--bps``. Shapes are in x out.

Rows "backend": ``cuda`` = ``additive_gemv`` on canonical codes (the CUDA kernel reads them as stored),
``cuda_slices`` = the engine's ``Packed2x8`` ("slices" layout), ``cuda_gate_up`` = a packed gate/up pair of two
in x out parts with act(gate) * up in the reduction (the engine's MLP launch), ``triton``; ``mma`` = the
tensor-core 2x8 kernel (``PackedMma2x8``, the "mma" aqlm_kernel option; 2x8 only), ``mma_gate_up`` = its gate/up
pair as the engine runs it (one launch into two planes, then ``fused.act_mul``); ``cuda_bpsN``: the
canonical CUDA kernel with N blocks per SM. With ``--rows``, each (shape, layout, backend) is timed at every
row count in the same process and reported against its own one-row time (``vs_rows1``): the cost of a
speculative-decoding verify pass of M rows relative to a decode step's GEMV.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..kernels import additive_gemv as ag
from ..kernels import additive_mma as am
from ..kernels.additive_layout import index_to_codes
from ..settings import KernelOptions
from .bench_kernels import graph_time_us

BENCH_SHAPES = ((4096, 4096), (4096, 11008), (11008, 4096), (8192, 28672), (28672, 8192))
ROWS_SHAPES = ((4096, 4096), (4096, 11008), (8192, 8192), (8192, 28672), (28672, 8192))
GATE_UP_SHAPES = ((4096, 11008), (8192, 28672))  # shapes that are an MLP's gate/up pair in a real model


def random_layout(n, k, M, nb, gen, device="cuda"):
    """Random codes, codebooks and scales of an n x k additive matrix (canonical layout)."""
    K = 1 << nb
    codes = index_to_codes(torch.randint(0, K, (n, k // 8, M), device=device, generator=gen), nb)
    cb = torch.randn(M, K, 1, 8, device=device, generator=gen).half()
    sc = (torch.rand(n, 1, 1, 1, device=device, generator=gen) * 0.05 + 0.01).half()
    return codes, cb, sc


def variants(layout, backends, bps_sweep, shape) -> list[tuple[str, str, int | None]]:
    """(label, backend, blocks per SM or None) to time for one layout and shape."""
    cuda = ag.cuda_available()
    out = [(b, b, None) for b in backends if b not in ("cuda", "mma") or cuda]
    if "mma" in backends:
        out = [v for v in out if v[0] != "mma"]
        if layout == (2, 8) and am.mma_available():
            out.append(("mma", "mma", None))
            if tuple(shape) in GATE_UP_SHAPES:
                out.append(("mma_gate_up", "mma_gate_up", None))
    if cuda and layout == (2, 8) and "cuda" in backends:
        out.append(("cuda_slices", "cuda_slices", None))
        if tuple(shape) in GATE_UP_SHAPES:
            out.append(("cuda_gate_up", "cuda_gate_up", None))
        out += [(f"cuda_bps{v}", "cuda", v) for v in bps_sweep]
    return out


def time_additive(k, n, M, nb, backend, bps, rows, gen, block_r=64, block_g=16, device="cuda"):
    """(median us per call, bytes per call) of one variant over ``rows`` activation rows."""
    kopts = KernelOptions(pdl="off", aqlm_blocks_per_sm=bps or 2)
    parts = 2 if backend in ("cuda_gate_up", "mma_gate_up") else 1
    q_bytes = parts * (n * (k // 8) * M * (nb // 8) + M * (1 << nb) * 16 + n * 2) + rows * (k * 2 + n * 2)
    ws = []  # one workspace shared by every buffer set (the calls run one after another)

    def make_q(i):
        mats = [random_layout(n, k, M, nb, gen, device) for _ in range(parts)]
        if not ws:
            ws.append(ag.AdditiveWorkspace(device, parts * ag.workspace_need(mats[0][0], mats[0][1], rows)))
        x = torch.randn(rows, k, device=device, dtype=torch.float16, generator=gen)
        y = torch.empty(rows, n, device=device, dtype=torch.float16)
        return _call(backend, mats, x, y, ws[0], kopts, block_r, block_g)

    return graph_time_us(make_q, q_bytes), q_bytes


def _call(backend, mats, x, y, ws, kopts, block_r, block_g):
    """The zero-argument launch of one variant on one buffer set."""
    if backend in ("mma", "mma_gate_up"):
        pk = am.PackedMma2x8([m + (None,) for m in mats])
        if backend == "mma":
            return lambda: pk.gemv(x, y, kopts=kopts)
        from ..kernels.fused import act_mul
        planes = torch.empty(2, x.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
        return lambda: act_mul(*pk.gemv_planes(x, planes, kopts=kopts), "silu", out=y)  # as schemes.aqlm.MmaGateUp
    if backend in ("cuda_slices", "cuda_gate_up"):
        packed = ag.Packed2x8([m + (None,) for m in mats], layout="slices")
        if backend == "cuda_gate_up":
            return lambda: packed.gemv_gate_up(x, y, "silu", workspace=ws, kopts=kopts)
        return lambda: packed.gemv(x, y, workspace=ws, kopts=kopts)
    codes, cb, sc = mats[0]
    return lambda: ag.additive_gemv(x, codes, cb, sc, out=y, workspace=ws, backend=backend, block_r=block_r,
                                    block_g=block_g, kopts=kopts)


def cublas_us(k, n, rows, gen, device="cuda") -> float:
    fp16_bytes = n * k * 2 + rows * (k * 2 + n * 2)

    def make_dense(i):
        w = torch.randn(n, k, device=device, dtype=torch.float16, generator=gen)
        x = torch.randn(rows, k, device=device, dtype=torch.float16, generator=gen)
        y = torch.empty(rows, n, device=device, dtype=torch.float16)
        return lambda: torch.matmul(x, w.t(), out=y)

    return graph_time_us(make_dense, fp16_bytes)


def bench(shapes=BENCH_SHAPES, layouts=((2, 8), (1, 16)), backends=("cuda", "triton"), bps_sweep=(), rows=(1,),
          block_r: int = 64, block_g: int = 16, device="cuda") -> list[dict]:
    """GEMV times (shape = in x out) at each row count, against cuBLAS fp16 at the same row count, and against
    the variant's own one-row time when several row counts are asked for. The Triton 2x8 time includes its
    lookup-table launch."""
    out = []
    gen = torch.Generator(device=device).manual_seed(0)
    rows = tuple(sorted(set(rows)))
    for k, n in shapes:
        dense = {m: cublas_us(k, n, m, gen, device) for m in rows}
        for M, nb in layouts:
            for label, backend, bps in variants((M, nb), backends, bps_sweep, (k, n)):
                base = None
                for m in rows:
                    us, q_bytes = time_additive(k, n, M, nb, backend, bps, m, gen, block_r, block_g, device)
                    base = us if m == rows[0] else base
                    out.append({"shape": f"{k}x{n}", "layout": f"{M}x{nb}", "backend": label, "rows": m,
                                "us": round(us, 2), "cublas_us": round(dense[m], 2),
                                "vs_cublas": round(dense[m] / us, 3), "vs_rows1": round(us / base, 3),
                                "GBps": round(q_bytes / us / 1e3, 1)})
                    print(out[-1], flush=True)
    print(bench_table(out))
    return out


def bench_table(rows: list[dict]) -> str:
    lines = ["| shape (in x out) | layout | backend | rows | us | vs rows 1 | cuBLAS fp16 us | vs cuBLAS | GB/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']}{' (x2)' if r['backend'].endswith('gate_up') else ''} | {r['layout']} | {r['backend']} | "
              f"{r.get('rows', 1)} | {r['us']:.1f} | {r.get('vs_rows1', 1.0):.2f}x | {r['cublas_us']:.1f} | "
              f"{r['vs_cublas']:.2f}x | {r['GBps']:.0f} |" for r in rows]
    return "\n".join(lines)


def _ints(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in s.split(",") if v)
    except ValueError:
        raise SystemExit(f"expected comma-separated integers, got {s!r}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="additive GEMV vs cuBLAS fp16 and M rows vs one (CUDA graphs)")
    p.add_argument("--backends", default="cuda,triton")
    p.add_argument("--bps", default="", help="extra CUDA 2x8 rows with these blocks per SM, e.g. 1,3")
    p.add_argument("--layouts", default="2x8,1x16")
    p.add_argument("--rows", default="", help="activation row counts, e.g. 1,2,4,8,16 (default: 1; with several, "
                                              "the verify-shape set unless --shapes is given)")
    p.add_argument("--shapes", default="", help="in x out shapes, e.g. 4096x4096,8192x28672")
    p.add_argument("--block-r", type=int, default=64)
    p.add_argument("--block-g", type=int, default=16)
    p.add_argument("--json", default="", help="write the rows here")
    a = p.parse_args(argv)
    rows = _ints(a.rows) or (1,)
    if any(not 1 <= m <= 64 for m in rows):
        raise SystemExit(f"--rows: row counts must be in 1..64, got {a.rows!r}")
    try:
        layouts = [tuple(int(v) for v in s.split("x")) for s in a.layouts.split(",") if s]
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
    except ValueError:
        raise SystemExit("--layouts / --shapes: expected AxB[,AxB...]") from None
    if any(lay not in ((2, 8), (1, 16)) for lay in layouts):
        raise SystemExit(f"--layouts: 2x8 and/or 1x16, got {a.layouts!r}")
    if not torch.cuda.is_available():
        print("the additive GEMV benchmark needs a CUDA GPU")
        return 1
    shapes = shapes or (ROWS_SHAPES if len(rows) > 1 else BENCH_SHAPES)
    out = bench(shapes=shapes, layouts=layouts, backends=tuple(b for b in a.backends.split(",") if b),
                bps_sweep=_ints(a.bps), rows=rows, block_r=a.block_r, block_g=a.block_g)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
