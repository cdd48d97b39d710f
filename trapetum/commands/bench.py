"""``trapetum bench WHAT``: kernel, end-to-end, quantizer, serving, sparse-GEMV and speculative benchmarks (GPU),
and the CLI and CPU-decode benchmarks (start-up time, default thread count, host kernels; CPU). Subcommands whose
arguments live in a heavy module are populated only when chosen (``commands/_args.py``), so ``trapetum --help`` stays light."""
from __future__ import annotations

QUANT_SCHEMES = ("scalar", "aqlm-2x8", "aqlm-1x16")  # the names of `trapetum quantize --scheme`


def _load_arguments(p) -> None:
    from ..eval.loadbench import add_arguments
    add_arguments(p)


def _spec_arguments(p) -> None:
    from ..eval.bench_spec import add_arguments
    add_arguments(p)


def _cli_arguments(p) -> None:
    from ..eval.bench_cli import add_arguments
    add_arguments(p)


def _cpu_arguments(p) -> None:
    from ..eval.bench_cpu import add_arguments
    add_arguments(p)


def _sparse_arguments(p) -> None:
    from ..eval.bench_sparse import add_arguments
    add_arguments(p)


def _energy_arguments(p) -> None:
    from ..eval.bench_energy import add_arguments
    add_arguments(p)


def _offload_arguments(p) -> None:
    from ..eval.bench_offload import add_arguments
    add_arguments(p)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (GPU; 'bench cli' on any machine)")
    sub = p.add_subparsers(dest="bench_what", metavar="WHAT")
    k = sub.add_parser("kernels", help="codebook GEMV vs cuBLAS fp16, decode attention, fused kernels")
    k.add_argument("--out", default=None, help="directory for kernels.json and kernels.md")
    k.add_argument("--quick", action="store_true", help="fewer shapes (smoke test)")
    k.set_defaults(func=_kernels)
    e = sub.add_parser("e2e", help="end-to-end decode/prefill tok/s, fp16 vs 4-bit, random weights at real shapes")
    e.add_argument("--out", default="out/bench-e2e", metavar="DIR",
                   help="directory for results.json and results.md (default out/bench-e2e)")
    e.add_argument("--models", default="llama2-7b,llama3-8b", metavar="SHAPE,...",
                   help="model shapes, comma-separated, from trapetum/eval/random_model.py SHAPES "
                        "(default llama2-7b,llama3-8b)")
    e.add_argument("--switches", action="store_true", help="also measure with each kill switch")
    e.set_defaults(func=_e2e)
    ld = sub.add_parser("load", populate=_load_arguments,
                        help="serving load benchmark: TTFT, inter-token latency and throughput for N "
                             "concurrent streaming clients (starts `trapetum serve` unless --url)")
    ld.set_defaults(func=_load)
    q = sub.add_parser("quantize", help="quantizer speed on a random-weight model at a real shape")
    q.add_argument("--shape", default="llama2-7b", help="model shape (default llama2-7b)")
    q.add_argument("--device", default=None,
                   help="default: cuda when available, as for `trapetum quantize` (k-means is the slow part)")
    q.add_argument("--layers", type=int, default=None, help="only the first N blocks (smoke run)")
    q.add_argument("--scheme", default="scalar", metavar="|".join(QUANT_SCHEMES),
                   help="scalar: 4-bit per-row scalar codebooks (default; 'cb4' is accepted too); aqlm-2x8 / "
                        "aqlm-1x16: the additive quantizer (the names of `trapetum quantize --scheme`)")
    q.add_argument("--work", default=None,
                   help="additive schemes: keep DIR/model.cbk and its .parts folder; a killed run resumes from there")
    q.add_argument("--gptq", action="store_true", help="scalar: the recipe of `trapetum quantize --gptq` (random Hessians)")
    q.set_defaults(func=_quantize)
    c = sub.add_parser("cli", populate=_cli_arguments,
                       help="CLI start-up times (--help, info) and the default thread count against fixed "
                            "counts under a competing CPU load it creates (any machine)")
    c.set_defaults(func=_cli)
    cp = sub.add_parser("cpu", populate=_cpu_arguments,
                        help="CPU decode of a .cbk: the torch, host-GEMV and step paths (and llama.cpp's llama-bench "
                             "if given), alternated, and the host GEMV's GB/s against the read bandwidth")
    cp.set_defaults(func=_cpu)
    sa = sub.add_parser("sparse", populate=_sparse_arguments,
                        help="dense vs sparse-input codebook GEMV with the bytes floor (GPU)")
    sa.set_defaults(func=_sparse)
    en = sub.add_parser("energy", populate=_energy_arguments,
                        help="GPU power (W) and J/token during decode, fp16 / 4-bit / 2x8 shapes in one run (NVML)")
    en.set_defaults(func=_energy)
    of = sub.add_parser("offload", populate=_offload_arguments,
                        help="routed experts (MoE) or the embedding (dense) in host RAM against all on the GPU: "
                              "tok/s, host GB/s, GPU peak; --per-layer: per-layer times and the extrapolation")
    of.set_defaults(func=_offload)
    sp = sub.add_parser("spec", populate=_spec_arguments,
                        help="speculative decoding end to end, plain and speculative in one process "
                             "(modeled acceptance on random models, real acceptance on real ones)")
    sp.set_defaults(func=_spec)
    s = sub.add_parser("suite", help="kernels (4-bit, 8-bit, fp16, 2-bit, attention), then end to end with kill "
                                     "switches, and 70B-shape 2-bit decode (one command for the GPU machine)")
    s.add_argument("--out", default="out/bench-suite")
    s.set_defaults(func=_suite)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _cli(args) -> int:
    from ..eval.bench_cli import run_args
    return run_args(args)


def _cpu(args) -> int:
    from ..eval.bench_cpu import run_args
    return run_args(args)


def _sparse(args) -> int:
    from ..eval.bench_sparse import run_args
    return run_args(args)


def _energy(args) -> int:
    from ..eval.bench_energy import run_args
    return run_args(args)


def _offload(args) -> int:
    from ..eval.bench_offload import run_args
    return run_args(args)


def _spec(args) -> int:
    from ..eval.bench_spec import run_args
    return run_args(args)


def _kernels(args) -> int:
    _need_cuda("kernels")
    from ..eval.bench_kernels import run_all
    cmd = "trapetum bench kernels" + (f" --out {args.out}" if args.out else "") + (" --quick" if args.quick else "")
    res = run_all(args.out, quick=args.quick, command=cmd)
    print(res["markdown"])
    return 0


def _need_cuda(what: str) -> None:
    import torch

    from ..errors import UnsupportedError
    if not torch.cuda.is_available():
        raise UnsupportedError(f"bench {what} needs a CUDA GPU")


def _e2e(args) -> int:
    _need_cuda("e2e")
    from pathlib import Path

    from ..eval.bench_e2e import run
    run(args.models.split(","), args.switches, Path(args.out))
    return 0


def _suite(args) -> int:
    _need_cuda("suite")
    from pathlib import Path

    from ..eval.bench_e2e import run
    from ..eval.bench_kernels import run_all
    import json

    from ..eval.bench_additive import bench as bench_additive, bench_table
    out = Path(args.out)
    k = run_all(str(out / "kernels"), quick=False, command=f"trapetum bench suite --out {args.out}")
    rows = bench_additive(backends=("cuda",))  # 2-bit GEMVs against cuBLAS in the same process
    (out / "kernels" / "additive.json").write_text(json.dumps(rows, indent=1))
    (out / "kernels" / "additive.md").write_text(bench_table(rows) + "\n")
    run(["llama2-7b"], True, out / "e2e-llama2-7b")
    run(["llama3-8b"], False, out / "e2e-llama3-8b")
    run(["llama2-70b"], False, out / "e2e-llama2-70b", bins=(0,))  # aqlm-2x8 and aqlm-1x16
    print(k["markdown"])
    print(bench_table(rows))
    return 0


def _load(args) -> int:
    from ..eval.loadbench import run
    return run(args)


def _quantize(args) -> int:
    import torch

    from ..errors import TrapetumError
    from ..eval.random_model import SHAPES
    from ..eval.bench_quantize import run, work_cbk
    if args.shape not in SHAPES:
        raise TrapetumError(f"--shape: unknown shape {args.shape!r} (known: {', '.join(sorted(SHAPES))})")
    scheme = {"scalar": "cb4", "cb4": "cb4"}.get(args.scheme, args.scheme)  # eval/bench_quantize's name
    if scheme not in ("cb4", "aqlm-2x8", "aqlm-1x16"):
        raise TrapetumError(f"--scheme: unknown scheme {args.scheme!r} (known: {', '.join(QUANT_SCHEMES)})")
    run(args.shape, args.device or ("cuda" if torch.cuda.is_available() else "cpu"), None, args.layers,
        scheme=scheme, keep=work_cbk(getattr(args, "work", None), scheme), gptq=getattr(args, "gptq", False))
    return 0
