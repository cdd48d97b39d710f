"""``trapetum ppl MODEL --text FILE [--ctx 2048] [--windows N|all] [--decode | --precise-prefill]``: perplexity."""
from __future__ import annotations

import argparse
import sys
import time

from ..errors import TrapetumError
from ._common import add_sparsity


def register(sub) -> None:
    p = sub.add_parser("ppl", help="perplexity of a model on a text file (non-overlapping windows)",
                       description="Mean NLL over every predicted token of non-overlapping windows of a text "
                                   "file, tokenized without special tokens. Prints e.g. "
                                   "'PPL 20.73  NLL 3.0317  32752 tokens  16 windows x 2048'.")
    p.add_argument("model", help="HF directory, .gguf or .cbk")
    p.add_argument("--text", required=True, metavar="FILE", help="plain text file to score")
    p.add_argument("--ctx", type=int, default=2048, metavar="N", help="window length in tokens (default 2048)")
    p.add_argument("--windows", default="all", metavar="N|all", help="first N windows, or all (default)")
    p.add_argument("--decode", action="store_true",
                   help="score token by token through the KV cache (a self-check: equals prefill in fp32)")
    p.add_argument("--bos", action="store_true",
                   help="put BOS in front of each window (ctx-1 text tokens, all scored); default: no BOS")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="compute dtype (default float32 on CPU)")
    p.add_argument("--precise-prefill", action="store_true", default=None,
                   help="GPU engine: score in the precise prefill (fp32 activations, prompt logits at the CPU "
                        "fp32 reference's accuracy; 2-3x the GEMM work; same as TRAPETUM_PREFILL=precise)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_sparsity(p)
    from ._common import add_gpu_mem, add_host_numerics
    add_gpu_mem(p)
    add_host_numerics(p)
    p.set_defaults(func=run)


def parse_windows(s: str) -> int | None:
    if s == "all":
        return None
    try:
        n = int(s)
    except ValueError:
        raise TrapetumError(f"--windows must be a positive integer or 'all', got {s!r}") from None
    if n <= 0:
        raise TrapetumError(f"--windows must be a positive integer or 'all', got {s!r}")
    return n


def run(args: argparse.Namespace) -> int:
    import torch

    from ..api import load
    from ..eval.perplexity import perplexity, tokenize_file

    windows = parse_windows(args.windows)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.precise_prefill and args.decode:
        raise TrapetumError("--precise-prefill scores in the prefill; --decode scores through the (fp16) decode "
                            "step: use one of them")
    from ._common import options_of
    model = load(args.model, device=args.device, dtype=dtype, precise_prefill=args.precise_prefill,
                 sparsity=args.sparsity, gpu_mem=args.gpu_mem, options=options_of(args))
    ids = tokenize_file(model.tokenizer, args.text)
    bos_id = None
    if args.bos:
        bos_id = model.tokenizer.bos_id
        if bos_id is None:
            raise TrapetumError(f"{args.model}: the tokenizer has no BOS token; run without --bos")
    t0 = time.perf_counter()
    scorer = model.runner if hasattr(model.runner, "logits_for") else model.decoder  # GPU engine on CUDA
    r = perplexity(scorer, ids, args.ctx, windows, decode=args.decode, bos_id=bos_id, progress=not args.quiet)
    dt = time.perf_counter() - t0
    print(r.line())
    path = "GPU engine" if scorer is model.runner else "reference decoder"
    if model.sparsity is not None:
        path += f", activation sparsity {args.sparsity}"
    if getattr(scorer, "precise", None) is not None:
        path += ", precise prefill"
    if model.options.host_numerics != "fp32" and args.device == "cpu":
        path += f", host numerics {model.options.host_numerics}"
    print(f"# {args.model} on {args.text}: {r.protocol()}; {model.dtype} on {args.device} ({path}); {dt:.1f} s",
          file=sys.stderr)
    return 0
