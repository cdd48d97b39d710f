"""Arguments shared by several commands (device and threads, context size, sampling, bit widths, drafts).

Nothing heavy is imported at module level: ``trapetum --help`` builds every command's parser, and must not
pay for torch (tests/test_cli_startup.py).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

from ..errors import ConfigError, TrapetumError
from ..settings import HOST_NUMERICS, MANY_ROWS_KERNELS, SPARSE_KERNELS
from ._args import with_default

DEVICE_HELP = ("cpu or cuda (default cpu: it runs the same everywhere, and the GPU engine compiles its CUDA "
               "kernels on first use, about a minute)")


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads (default: OMP_NUM_THREADS when set, else chosen from the CPUs this process may "
                        "use and what else runs now: fewer on a busy machine, where extra threads stall each other)")


def add_kernel_options(p: argparse.ArgumentParser) -> None:
    """GPU kernel choices (settings.KernelOptions fields without a variable): two change numerics (aqlm, sparse),
    many-rows only speed."""
    p.add_argument("--aqlm-kernel", default=None, choices=("table", "mma"),
                   help="2x8 AQLM models on the GPU: the decode / verify GEMV, 'table' (default: fp32 lookup "
                        "tables) or 'mma' (tensor cores: faster verify rows, slower decode, other rounding)")
    p.add_argument("--sparse-kernel", default=None, choices=SPARSE_KERNELS,
                   help="with --sparsity on the GPU: the activation-sparse GEMV, 'mma' (default: tensor cores, "
                        "where the CUDA extension builds, else 'compact'), or the Triton 'compact' / 'masked' kernels")
    p.add_argument("--many-rows", default=None, choices=MANY_ROWS_KERNELS,
                   help="4-bit GEMVs of 17+ rows on the GPU (batched decode, serve --gpu-batch): 'wgmma' (default: "
                        "Hopper's warpgroup MMA where it measured faster) or 'mma' (the grouped mma kernel); the "
                        "same bits either way")
    p.add_argument("--wgmma-warpgroups", type=int, default=None, choices=(0, 1, 2, 3), metavar="W",
                   help="with --many-rows wgmma: warpgroups a block (64 weight rows each, sharing the block's "
                        "activation stages), 1-3, or 0 (default) for the kernel's own rule; speed only, same bits")


def add_host_numerics(p: argparse.ArgumentParser) -> None:
    """The CPU's host GEMV numerics (settings.Options.host_numerics)."""
    p.add_argument("--host-numerics", default=None, choices=HOST_NUMERICS,
                   help="on the CPU, the codebook GEMV's numbers: 'fp32' (default: fp32 activations times "
                        "the fp16 centroids) or 'int8' (opt-in, other numbers: centroids and activations as int8 "
                        "with scales, integer dots, the 8-bit head's weights looked up once at load; faster where "
                        "the CPU lacks AVX-512)")


def options_of(args: argparse.Namespace):
    """The engine's Options for this command (the TRAPETUM_* switches, then the kernel and host flags), or None."""
    kernels = {k: v for k in ("aqlm_kernel", "sparse_kernel", "many_rows", "wgmma_warpgroups")
               if (v := getattr(args, k, None)) is not None}
    numerics = getattr(args, "host_numerics", None)
    if not kernels and numerics is None:
        return None
    from ..settings import Options
    opts = Options.from_env().replace(kernels=kernels)
    return opts if numerics is None else opts.replace(host_numerics=numerics)


def apply_threads(args: argparse.Namespace):
    """Set torch's CPU thread count for this command (``cpu_threads.choose_threads``); returns the ThreadChoice."""
    from ..cpu_threads import choose_threads
    from ..settings import CpuEnv
    if args.threads is not None and args.threads < 1:
        raise TrapetumError(f"--threads must be at least 1, got {args.threads}")
    env = CpuEnv.from_env()
    import torch
    choice = choose_threads(args.threads, env.omp_threads_set, torch.get_num_threads())
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
    return choice


def add_context(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--ctx", type=int, default=None, metavar="N",
                   help="context size in tokens: prompt plus answer (default: the model's, at most 8192 on the GPU)")


def context_of(args: argparse.Namespace) -> int | None:
    if args.ctx is not None and args.ctx < 1:
        raise TrapetumError(f"--ctx must be at least 1, got {args.ctx}")
    return args.ctx


def add_model_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", dest="model_opt", default=None, metavar="MODEL",
                   help="the model (instead of the first positional argument)")


def positive_amount(unit: str):
    """An argparse type: a finite positive number of ``unit`` (GB, GiB), else a one-line usage error."""
    def parse(text: str) -> float:
        import math
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text!r}") from None
        if not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive number of {unit}, got {text}")
        return v
    return parse


def add_gpu_mem(p: argparse.ArgumentParser) -> None:
    """The GPU engine's memory budget (runtime/placement.py)."""
    p.add_argument("--gpu-mem", type=positive_amount("GB"), default=None, metavar="GB",
                   help="GPU engine: use at most GB GiB of GPU memory; the embedding table, then a mixture-of-experts "
                        "model's routed experts, move to host RAM (the experts run on the CPU) until the rest fits "
                        "(default: everything on the GPU)")


def add_sparsity(p: argparse.ArgumentParser) -> None:
    """Activation sparsity (TEAL, models/sparsity.py): thresholds from ``trapetum sparsify``."""
    p.add_argument("--sparsity", default=None, metavar="FILE|on",
                   help="activation sparsity: 'on' (the thresholds stored in the .cbk by trapetum sparsify) or a "
                        "side file of thresholds (GGUF / HF models); default: dense")


def add_draft(p: argparse.ArgumentParser) -> None:
    """Exact speculative decoding (trapetum/runtime/speculative): greedy output identical to plain decoding,
    sampling exact in distribution."""
    g = p.add_argument_group("speculative decoding (exact)")
    g.add_argument("--draft", default=None, metavar="MODEL|ngram|pard:MODEL",
                   help="a draft model with the target's tokenizer (e.g. a 3-bit .cbk of it), 'ngram' (prompt "
                        "lookup), or 'pard:MODEL' (a PARD drafter)")
    g.add_argument("--draft-k", type=int, default=4, metavar="K", help="drafts per verify round, 1..15 (default 4)")
    g.add_argument("--draft-adaptive", action="store_true", help="adapt K to the acceptance")
    g.add_argument("--draft-mask-token", type=int, default=None, metavar="ID",
                   help="PARD's mask token id (default: the drafter's config)")


def draft_kwargs(args: argparse.Namespace) -> dict:
    return dict(draft=args.draft, draft_k=args.draft_k, draft_adaptive=args.draft_adaptive,
                draft_mask_token=args.draft_mask_token)


# GenerationSettings field -> the flag that sets it (validation errors name the flag)
FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
         "top_p": "--top-p", "min_p": "--min-p", "repetition_penalty": "--repetition-penalty", "seed": "--seed",
         "stop": "--stop", "ignore_eos": "--ignore-eos"}


def add_sampling(p: argparse.ArgumentParser, temperature: float = 0.0, max_new: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-new-tokens", type=int, default=max_new, metavar="N",
                   help=with_default("tokens to generate at most", max_new))
    g.add_argument("--temperature", "--temp", type=float, default=temperature, metavar="T",
                   help=with_default("0 = greedy", temperature))
    g.add_argument("--top-k", type=int, default=0, metavar="K", help=with_default("0 = off", 0))
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help=with_default("nucleus sampling, 1 = off", 1.0))
    g.add_argument("--min-p", type=float, default=0.0, metavar="P", help=with_default("0 = off", 0.0))
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R", help=with_default("1 = off", 1.0))
    g.add_argument("-s", "--seed", type=int, default=None, metavar="S", help="random seed (default: a fresh one)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def flag_message(e: TrapetumError) -> str:
    """A GenerationSettings message ('top_p: must be in (0, 1], got 1.5') with the flag's name in front."""
    msg = str(e)
    field, sep, rest = msg.partition(":")
    return f"{FLAGS[field]}:{rest}" if sep and field in FLAGS else msg


def settings_from(args: argparse.Namespace):
    from ..runtime.sampling import GenerationSettings
    try:
        return GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                  repetition_penalty=args.repetition_penalty, seed=args.seed, stop=list(args.stop),
                                  ignore_eos=args.ignore_eos).validate()
    except TrapetumError as e:
        raise TrapetumError(flag_message(e)) from None


def bits_or_none(s: str, what: str) -> int | None:
    """A ``--head-bits`` / ``--embed-bits`` value: a number of bits, or None for fp16 / none / dense
    (ConfigError naming the option ``what`` otherwise)."""
    if s.lower() in ("fp16", "none", "dense"):
        return None
    try:
        return int(s)
    except ValueError:
        raise ConfigError(f"{what} must be a number of bits or fp16, got {s!r}") from None


@contextlib.contextmanager
def loading(what: str, device: str, threads=None):
    """A status line on a terminal's stderr while a model loads ('loading X on cpu (2 threads) ...', then the
    time); nothing when stderr is not a terminal (pipes and logs get only the output and errors)."""
    tty = sys.stderr.isatty()
    t0 = time.perf_counter()
    how = f" ({threads.threads} thread{'s' if threads.threads != 1 else ''})" if getattr(threads, "threads", None) else ""
    if tty:
        sys.stderr.write(f"loading {what} on {device}{how} ...")
        sys.stderr.flush()
    ok = False
    try:
        yield
        ok = True
    finally:
        if tty:
            sys.stderr.write(f" {time.perf_counter() - t0:.1f} s\n" if ok else "\n")
            sys.stderr.flush()
