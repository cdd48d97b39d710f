"""Sparse-input codebook GEMV (kernels/sparse_gemv.py) against the dense codebook GEMV, on the GPU.

    python -m trapetum.eval.bench_sparse [--shapes 4096x4096,4096x11008,11008x4096] [--sparsity 0,0.25,0.4,0.5,0.7]
    python -m trapetum.eval.bench_sparse --e2e [--model llama2-7b] [--sparsity 0.25,0.4,0.5]   (decode, end to end)

Shapes are in x out (x [1, in] @ W.T). Random 4-bit codes and fp16 codebooks; x random fp16 with a fraction S of
its entries zero (uniformly placed: the thresholded input of TEAL at sparsity S), one row (decode). Timing:
bench_kernels.graph_time_us (CUDA graphs over rotating buffer sets larger than L2, median of replays). Printed per
shape and S: dense us (canonical codes; and the tiled mma kernel the engine runs, where the CUDA kernels are
built), the masked and the compacted Triton sparse kernels' us (KernelOptions.sparse_kernel "masked" / "compact"),
the tensor-core sparse kernel's ("mma", the default, kernels/sparse_mma.py: its extension must build, else the
benchmark stops with the build error), the best dense over the fastest sparse, the tiled dense over "mma", and the
sparse kernel's floor (bytes_read / 4.8 TB/s, the H200's HBM bandwidth) so that the gap to it is visible. Nothing
is recorded by this module: figures go to BENCHMARKS.md with the command that produced them.

--e2e: one engine of the model shape in 4-bit (eval/random_model.py cb4: random codes and codebooks, 8-bit head),
decode tok/s (bench_e2e.decode_bins: 128 greedy CUDA-graph steps from positions 0 and 1024) dense, then at each
sparsity S, then dense again, in one process; ``--sparse-kernel mma,compact``: one engine per kernel in turn, each
with its dense runs (the engine checks that its projections hold the mma kernel's layout under "mma": no silent
fallback). Thresholds: per layer and site, the S-quantile of |x| of the random model's own site inputs over one
eager prompt pass of 256 random tokens (rows 1..; labelled "random activations" in the output: not a real model's).
The same S on every site; position 0 dense.
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager

import torch

from ..kernels import cuda_ext, sparse_mma
from ..kernels.codebook_gemv import codebook_gemv
from ..kernels.codebook_layout import tile_codes
from ..kernels.pack import pack_codes
from ..kernels.sparse_gemv import bytes_read, input_major_codes, sparse_gemv, sparse_project
from ..settings import DEFAULT_KERNELS, SPARSE_KERNELS
from .bench_kernels import graph_time_us

HBM_BYTES_PER_S = 4.8e12


def run(shapes: list[tuple[int, int]], sparsities: list[float], bits: int = 4, mma_splits=()) -> list[dict]:
    """One row per shape and S (module docstring); ``mma_splits``: the tensor-core kernel also timed at these
    K-range counts (row key "mma_splits_us": {S: us}), to compare with the default ``sparse_mma.splits``."""
    dev = torch.device("cuda")
    if bits == 4 and sparse_mma.EXT.ready(dev) is None:
        raise RuntimeError(f"bench_sparse: the tensor-core sparse GEMV (sparse_mma) did not build: {sparse_mma.EXT.error()}")
    out = []
    for K, N in shapes:
        g = torch.Generator(device="cpu").manual_seed(K * 7 + N)
        idx = torch.randint(0, 1 << bits, (N, K), generator=g)
        codes = pack_codes(idx, bits).to(dev)
        ct = input_major_codes(codes.cpu(), bits, K).to(dev)
        cb = torch.randn(N, 1 << bits, generator=g).to(torch.float16).to(dev)
        weight_bytes = codes.numel() + cb.numel() * 2
        tiled = tile_codes(codes) if cuda_ext.ready(dev, DEFAULT_KERNELS) is not None and codes.shape[1] % 64 == 0 \
            else None
        no_dense = torch.zeros(1, dtype=torch.bool, device=dev)
        cm = sparse_mma.tile_codes(codes, K) if bits == 4 else None
        for s in sparsities:
            x = torch.randn(1, K, generator=g)
            x[torch.rand(1, K, generator=g) < s] = 0
            x = x.to(torch.float16).to(dev)

            def dense_op(i, x=x):
                c, b = codes.clone(), cb.clone()
                return lambda: codebook_gemv(x, c, b, bits)

            def sparse_op(i, x=x):
                c, b = ct.clone(), cb.clone()
                return lambda: sparse_gemv(x, c, b, bits, N)

            def tiled_op(i, x=x):
                c, b = tiled.clone(), cb.clone()
                return lambda: codebook_gemv(x, c, b, bits, tiled=True)

            def compact_op(i, x=x):
                c, b = ct.clone(), cb.clone()
                y = torch.empty(1, N, dtype=torch.float16, device=dev)
                return lambda: sparse_project(x, c, b, bits, N, threshold=0.0, dense_rows=no_dense, out=y)

            def mma_op(i, x=x, splits=None):  # the tensor-core sparse kernel on its own layout
                c, b = cm.clone(), cb.clone()
                y = torch.empty(1, N, dtype=torch.float16, device=dev)
                return lambda: sparse_project(x, c, b, bits, N, threshold=0.0, dense_rows=no_dense, out=y, kernel="mma",
                                              splits=splits)

            d = graph_time_us(dense_op, weight_bytes)
            dt = graph_time_us(tiled_op, weight_bytes) if tiled is not None else float("nan")
            sp = graph_time_us(sparse_op, weight_bytes)
            cp = graph_time_us(compact_op, weight_bytes)
            mm = graph_time_us(mma_op, weight_bytes) if cm is not None else float("nan")
            by_msplits = {v: graph_time_us(lambda i, v=v: mma_op(i, splits=v), weight_bytes)
                          for v in mma_splits if cm is not None and -(-K // v) <= sparse_mma.MAX_KS}
            floor = bytes_read(K, N, bits, s) / HBM_BYTES_PER_S * 1e6
            best = min(v for v in (cp, mm) if v == v)
            out.append({"in": K, "out": N, "sparsity": s, "dense_us": d, "tiled_us": dt, "sparse_us": sp,
                        "compact_us": cp, "mma_us": mm, "speedup": min(d, dt) / best,
                        "mma_speedup": (dt if dt == dt else d) / mm, "sparse_floor_us": floor,
                        "mma_splits": sparse_mma.splits(K, N), "mma_splits_us": by_msplits})
    return out


def _check_layout(eng, kernel: str) -> None:
    """The engine's 4-bit projections hold the layout of ``kernel`` ("mma": tile-major), else a RuntimeError: a
    benchmark of a kernel that silently fell back would time another one."""
    if kernel != "mma":
        return
    mod = sparse_mma
    projs = [p for L in eng.model.layers for p in (L.attention.qkv, L.attention.o, L.mlp.gate_up.proj, L.mlp.down)]
    bad = sum(1 for p in projs if p.ct is None or not mod.is_layout(p.ct))
    if bad:
        raise RuntimeError(f"bench_sparse --e2e: {bad} of {len(projs)} projections lack the {kernel} kernel's layout "
                           f"(extension error: {mod.EXT.error()})")


@contextmanager
def _recorded_thresholds(sparsities: list[float], tags: dict[float, tuple[int, str]], out: dict):
    """While active, every PREFILL site input the engine thresholds with a tag threshold (``tags``: tiny distinct
    values, layer and site) gives out[(S, layer, site)] = the S-quantile of |x| over its rows 1.. (eager passes
    only: the quantile is a host read)."""
    from ..models.sparsity import DENSE_POSITIONS
    from ..quant.sparsify import threshold_of
    from ..runtime.engine_ops import EngineOps
    real = EngineOps.sparsify

    def rec(self, x, t, batch):
        if not self.rows and t in tags:
            v = x[DENSE_POSITIONS:].detach().abs().float().reshape(-1)
            for s in sparsities:
                out[(s, *tags[t])] = threshold_of(v, s)
        return real(self, x, t, batch)
    EngineOps.sparsify = rec
    try:
        yield
    finally:
        EngineOps.sparsify = real


def e2e(shape: str, sparsities: list[float], bins=(0, 1024), prompt: int = 256, kernel: str = "mma") -> dict:
    """{"dense": {bin: tok/s}, S: {bin: tok/s}, ..., "dense_again": ...} (module docstring, --e2e)."""
    from ..models.sparsity import SITES, SiteThresholds, SparsityTable
    from ..runtime.engine import GpuEngine
    from .bench_e2e import decode_bins
    from .random_model import random_checkpoint
    from ..settings import Options
    eng = GpuEngine(random_checkpoint(shape, "cb4"), max(bins) + 256, device="cuda",
                    options=Options().replace(kernels={"sparse_kernel": kernel}))
    L = eng.cfg.num_layers
    tags = {(4 * i + j + 1) * 1e-30: (i, site) for i in range(L) for j, site in enumerate(SITES)}
    by_layer = [{site: t for t, (i, site) in tags.items() if i == layer} for layer in range(L)]
    eng.set_sparsity(SparsityTable(tuple(SiteThresholds(**d) for d in by_layer)))
    _check_layout(eng, kernel)
    found: dict = {}
    ids = torch.randint(3, eng.cfg.vocab_size, (prompt,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with _recorded_thresholds(sparsities, tags, found):
        eng.prefill_pass(ids)  # the PREFILL pass whatever the length (short prompts would take the exact prefill);
        # the first pass of a length is eager
    if len(found) != len(sparsities) * L * len(SITES):
        raise RuntimeError(f"bench_sparse --e2e: recorded {len(found)} thresholds, expected "
                           f"{len(sparsities) * L * len(SITES)}")
    eng.set_sparsity(None)
    res = {"dense": decode_bins(eng, bins)}
    for s in sparsities:
        table = SparsityTable(tuple(SiteThresholds(**{site: found[(s, i, site)] for site in SITES}) for i in range(L)),
                              {site: s for site in SITES}, {"source": "random activations of a random-weight model"})
        eng.set_sparsity(table)
        res[s] = decode_bins(eng, bins)
    eng.set_sparsity(None)
    res["dense_again"] = decode_bins(eng, bins)
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (also those of ``trapetum bench sparse``)."""
    p.add_argument("--shapes", default="4096x4096,4096x11008,11008x4096", help="IN x OUT, comma-separated")
    p.add_argument("--sparsity", default="", help="input sparsities, comma-separated (default 0,0.25,0.4,0.5,0.7; "
                   "--e2e: 0.25,0.4,0.5)")
    p.add_argument("--e2e", action="store_true", help="decode tok/s of a 4-bit engine, dense vs each sparsity")
    p.add_argument("--model", default="llama2-7b", help="--e2e: the model shape (eval/random_model.py SHAPES)")
    p.add_argument("--mma-splits", default="", help="kernel table: also time the tensor-core sparse kernel at these "
                   "K-range counts, comma-separated (default: only sparse_mma.splits of the shape)")
    p.add_argument("--sparse-kernel", default="mma",
                   help=f"--e2e: KernelOptions.sparse_kernel, one or several comma-separated of {', '.join(SPARSE_KERNELS)} "
                   "(default mma); mma fails unless its extension builds")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_args(p.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("bench_sparse: needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.e2e:
        sp = [float(s) for s in (args.sparsity or "0.25,0.4,0.5").split(",")]
        kernels = args.sparse_kernel.split(",")
        for kernel in kernels:
            if kernel not in SPARSE_KERNELS:
                print(f"bench_sparse: --sparse-kernel {kernel!r}: expected one of {', '.join(SPARSE_KERNELS)}",
                      file=sys.stderr)
                return 2
        for kernel in kernels:
            res = e2e(args.model, sp, kernel=kernel)
            d = {b: (res["dense"][b] + res["dense_again"][b]) / 2 for b in res["dense"]}
            print(f"{args.model} cb4 decode tok/s (random weights; thresholds from random activations at the target S, "
                  f"every site, position 0 dense; {kernel} kernel); dense = mean of the runs before and after")
            print("| S | tok/s @0-128 | @1024-1152 | vs dense @0 | vs dense @1024 |")
            print("|---|---|---|---|---|")
            for k in ["dense", "dense_again", *sp]:
                r = res[k]
                print(f"| {k} | {r[0]:.1f} | {r[1024]:.1f} | {r[0] / d[0]:.3f}x | {r[1024] / d[1024]:.3f}x |", flush=True)
            torch.cuda.empty_cache()
        return 0
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = run(shapes, [float(s) for s in (args.sparsity or "0,0.25,0.4,0.5,0.7").split(",")],
               mma_splits=[int(v) for v in args.mma_splits.split(",") if v])
    sys.stdout.flush()
    print("| in x out | S | dense us | dense tiled (mma) us | masked sparse us | compact sparse us | "
          "mma sparse us | best dense / best sparse | dense tiled / mma sparse | sparse floor us |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['in']}x{r['out']} | {r['sparsity']:.2f} | {r['dense_us']:.1f} | {r['tiled_us']:.1f} | "
              f"{r['sparse_us']:.1f} | {r['compact_us']:.1f} | {r['mma_us']:.1f} | "
              f"{r['speedup']:.2f}x | {r['mma_speedup']:.2f}x | {r['sparse_floor_us']:.1f} |")
    for r in rows:
        if r["mma_splits_us"]:
            print(f"mma sparse {r['in']}x{r['out']} S={r['sparsity']:.2f}: default splits {r['mma_splits']}; "
                  + ", ".join(f"splits {v}: {us:.1f} us" for v, us in r["mma_splits_us"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
