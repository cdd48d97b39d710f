"""Sparse-input codebook GEMV (kernels/sparse_gemv.py) against the dense codebook GEMV, on the GPU.

    python -m trapetum.eval.bench_sparse [--shapes 4096x4096,4096x11008,11008x4096] [--sparsity 0,0.25,0.4,0.5,0.7]

Shapes are in x out (x [1, in] @ W.T). Random 4-bit codes and fp16 codebooks; x random fp16 with a fraction S of
its entries zero (uniformly placed: the thresholded input of TEAL at sparsity S), one row (decode). Timing:
bench_kernels.graph_time_us (CUDA graphs over rotating buffer sets larger than L2, median of replays). Printed per
shape and S: dense us, sparse us, the speed-up, and the sparse kernel's floor (bytes_read / 4.8 TB/s, the H200's
HBM bandwidth) so that the gap to it is visible. Nothing is recorded by this module: figures go to BENCHMARKS.md
with the command that produced them.
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..kernels.codebook_gemv import codebook_gemv
from ..kernels.pack import pack_codes
from ..kernels.sparse_gemv import bytes_read, input_major_codes, sparse_gemv
from .bench_kernels import graph_time_us

HBM_BYTES_PER_S = 4.8e12


def run(shapes: list[tuple[int, int]], sparsities: list[float], bits: int = 4) -> list[dict]:
    dev = torch.device("cuda")
    out = []
    for K, N in shapes:
        g = torch.Generator(device="cpu").manual_seed(K * 7 + N)
        idx = torch.randint(0, 1 << bits, (N, K), generator=g)
        codes = pack_codes(idx, bits).to(dev)
        ct = input_major_codes(codes.cpu(), bits, K).to(dev)
        cb = torch.randn(N, 1 << bits, generator=g).to(torch.float16).to(dev)
        weight_bytes = codes.numel() + cb.numel() * 2
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

            d = graph_time_us(dense_op, weight_bytes)
            sp = graph_time_us(sparse_op, weight_bytes)
            floor = bytes_read(K, N, bits, s) / HBM_BYTES_PER_S * 1e6
            out.append({"in": K, "out": N, "sparsity": s, "dense_us": d, "sparse_us": sp, "speedup": d / sp,
                        "sparse_floor_us": floor})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (also those of ``trapetum bench sparse``)."""
    p.add_argument("--shapes", default="4096x4096,4096x11008,11008x4096", help="IN x OUT, comma-separated")
    p.add_argument("--sparsity", default="0,0.25,0.4,0.5,0.7", help="input sparsities, comma-separated")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_args(p.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("bench_sparse: needs a CUDA GPU", file=sys.stderr)
        return 1
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = run(shapes, [float(s) for s in args.sparsity.split(",")])
    print("| in x out | S | dense us | sparse us | speed-up | sparse floor us |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['in']}x{r['out']} | {r['sparsity']:.2f} | {r['dense_us']:.1f} | {r['sparse_us']:.1f} | "
              f"{r['speedup']:.2f}x | {r['sparse_floor_us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
