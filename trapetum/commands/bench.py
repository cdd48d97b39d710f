"""`trapetum bench kernels --out DIR`: kernel microbenchmarks (GEMV vs cuBLAS, attention, fused)."""
from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (GPU)")
    sub = p.add_subparsers(dest="bench_what", metavar="WHAT")
    k = sub.add_parser("kernels", help="codebook GEMV vs cuBLAS fp16, decode attention, fused kernels")
    k.add_argument("--out", default=None, help="directory for kernels.json and kernels.md")
    k.add_argument("--quick", action="store_true", help="fewer shapes (smoke test)")
    k.set_defaults(func=_kernels)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _kernels(args) -> int:
    import torch

    from ..errors import UnsupportedError
    if not torch.cuda.is_available():
        raise UnsupportedError("bench kernels needs a CUDA GPU")
    from ..eval.bench_kernels import run_all
    cmd = "trapetum bench kernels" + (f" --out {args.out}" if args.out else "") + (" --quick" if args.quick else "")
    res = run_all(args.out, quick=args.quick, command=cmd)
    print(res["markdown"])
    return 0
