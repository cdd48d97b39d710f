"""``trapetum serve [MODEL ...]``: the OpenAI-compatible HTTP server and the chat/compare page."""
from __future__ import annotations

import argparse
import math
import os
import sys

from ..errors import TrapetumError
from ._common import positive_amount


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve models over an OpenAI-compatible HTTP API with a chat/compare web page",
        description="Serve one or more models over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                    "/v1/completions, /v1/models, /health) with a web page at / to chat with them and "
                    "compare two side by side. MODEL is a .cbk file, a .gguf file or a Hugging Face "
                    "directory, optionally named as ALIAS=PATH; none (or 'default') serves the embedded "
                    "SmolLM2-135M-Instruct.",
        epilog="example: trapetum serve fp16=llama.gguf q4=llama.cbk --port 8000")
    p.add_argument("models", nargs="*", metavar="MODEL", help="model path or ALIAS=PATH (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (the page asks for it); visible to every "
                        "user of the machine in ps: prefer --api-key-file or TRAPETUM_API_KEY")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read the API key from FILE (its first line); TRAPETUM_API_KEY also sets it")
    p.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                   help="answer requests whose Host header is NAME, besides localhost, 127.0.0.1 and ::1 on a "
                        "loopback bind (repeatable); other Host names get 403 (DNS rebinding)")
    p.add_argument("--queue", type=_positive, default=64, metavar="N",
                   help="requests allowed to wait per engine; past it, 429 with Retry-After (default 64)")
    p.add_argument("--max-batch", type=_positive, default=16, metavar="N",
                   help="requests decoded together per model (continuous batching over a paged KV cache; each "
                        "request gets exactly the tokens it gets alone); 1: one request at a time (default 16; "
                        "models without a drafter, on the CPU; on the GPU engine with --gpu-batch)")
    p.add_argument("--gpu-batch", action="store_true",
                   help="batch on the GPU engine too (runtime/paged_engine.py: paged KV cache, CUDA graphs per batch size)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-blocks", type=_positive, default=None, metavar="N",
                    help="KV cache of the batch: N blocks of 16 positions per model (default: room for --max-batch "
                         "full contexts, at most 1 GiB on the CPU, half the free GPU memory with --gpu-batch)")
    kv.add_argument("--kv-mem", type=positive_amount("GiB"), default=None, metavar="GB",
                    help="KV cache of the batch: GB GiB per model (instead of --kv-blocks)")
    p.add_argument("--prefill-budget", type=_positive, default=None, metavar="N",
                   help="prompt positions the batch prefills per step, each prefill forward counting as at least "
                        "one chunk of 128 (default 128: one forward per step, so a decode step waits for at most "
                        "one prompt; more: shorter time to first token under load, longer stalls between tokens)")
    p.add_argument("--fold-prompts", type=int, default=None, metavar="N",
                   help="prompts of at most N tokens run as rows of the batch's decode forward (up to the prefill "
                        "budget's rows a step) instead of a prefill forward (default 128 with --gpu-batch, 0 on "
                        "the CPU; 0: never)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="overlapped batch steps: the next decode step runs on the device while the host streams the "
                        "previous step's tokens (the same tokens, events a step later; default on with --gpu-batch, off on the CPU)")
    p.add_argument("--max-body", type=_positive, default=1 << 20, metavar="BYTES",
                   help="largest request body accepted, else 413 (default 1 MiB)")
    p.add_argument("--device", default=None,
                   help="device for every model, or a comma list with one per model (for example "
                        "cuda:0,cuda:1). Models on one device share one engine and take turns.")
    p.add_argument("-t", "--threads", type=_positive, default=None, metavar="N",
                   help="CPU threads per engine (default: OMP_NUM_THREADS when set, else chosen at start from the "
                        "CPUs this process may use and what else runs: fewer on a busy machine)")
    p.add_argument("-c", "--ctx", type=_positive, default=None, metavar="N",
                   help="context size of every model in tokens (default: the model's, at most 8192 on the GPU)")
    g = p.add_argument_group(
        "sampling defaults", "for requests that leave a field out; order: the request, these options, the model's "
                             "generation_config.json, then temperature 0.7 (as chat and the web page) and the rest off")
    g.add_argument("--temperature", "--temp", type=float, default=None, metavar="T",
                   help="default temperature (0 = greedy; default: the model's, else 0.7)")
    g.add_argument("--top-p", type=float, default=None, metavar="P", help="default top_p (default: the model's, else 1)")
    g.add_argument("--top-k", type=int, default=None, metavar="K", help="default top_k (default: the model's, else 0 = off)")
    g.add_argument("--min-p", type=float, default=None, metavar="P", help="default min_p (default: the model's, else 0)")
    g.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="default repetition_penalty (default: the model's, else 1)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="let web pages from ORIGIN (for example http://localhost:3000, or *) call the API "
                        "from a browser; repeatable (default: same origin only)")
    from ._common import add_draft, add_gpu_mem, add_host_numerics, add_kernel_options, add_sparsity
    add_draft(p)  # every model gets the drafter; each speculative model is also served plainly as NAME:plain
    add_sparsity(p)  # the same thresholds for every model
    add_gpu_mem(p)  # the same budget for every model (each its own GPU engine)
    add_kernel_options(p)  # the same GPU kernel choices for every model
    add_host_numerics(p)  # the same CPU numerics for every model
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="do not log every request")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..serve.server import ModelSpec, run as serve

    models = args.models or ["default"]
    devices: list[str | None]
    if args.device is None:
        devices = [None] * len(models)
    else:
        devices = [d.strip() or None for d in args.device.split(",")]
        if len(devices) == 1:
            devices = devices * len(models)
        elif len(devices) != len(models):
            raise TrapetumError(f"--device lists {len(devices)} devices for {len(models)} models; give one, "
                                "or one per model")
    if not 0 <= args.port <= 65535:
        raise TrapetumError(f"--port must be in 0..65535, got {args.port}")
    api_key = _api_key(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"trapetum: warning: serving on {args.host} without --api-key: anyone who can reach this "
              "machine can use the models", file=sys.stderr)
    from ._common import draft_kwargs
    draft_kw = draft_kwargs(args) if args.draft is not None else {}
    sampling = _sampling(args)
    specs = [ModelSpec.parse(m, d, draft_kw, args.ctx) for m, d in zip(models, devices)]
    if args.gpu_mem is not None and not all((s.device or "").startswith("cuda") for s in specs):
        raise TrapetumError("--gpu-mem: a GPU memory budget applies to the GPU engine (--device cuda)")
    from ._common import options_of
    options = options_of(args)
    for s in specs:
        s.sparsity, s.gpu_mem, s.options = args.sparsity, args.gpu_mem, options
    for s in specs:      # fail now, not later in the background loader
        if s.path is not None and not os.path.exists(s.path):
            raise TrapetumError(f"{s.path}: file not found")
    threads, note = _threads(args)
    serve(specs, host=args.host, port=args.port, api_key=api_key, max_waiting=args.queue,
          max_body=args.max_body, log_level=args.log_level, access_log=not args.no_access_log,
          threads=threads, cors_origins=args.cors_origin, allowed_hosts=args.allowed_host, sampling=sampling,
          note=note, batch=_batch(args))
    return 0


def _batch(args) -> dict | None:
    """The batch scheduler's options (Model.batch_scheduler), or None with --max-batch 1."""
    if args.max_batch == 1 and args.kv_blocks is None and args.kv_mem is None:
        return None
    out = {"max_batch": args.max_batch, "kv_blocks": args.kv_blocks, "kv_mem": args.kv_mem}
    if args.gpu_batch:
        out["gpu"] = True
    if args.prefill_budget is not None:
        out["prefill_budget"] = args.prefill_budget
    if args.fold_prompts is not None:
        if args.fold_prompts < 0:
            raise TrapetumError(f"--fold-prompts: at least 0, got {args.fold_prompts}")
        out["fold"] = args.fold_prompts
    if args.overlap is not None:
        out["overlap"] = args.overlap
    return out


def _threads(args) -> tuple[int | None, str]:
    """--threads, else OMP_NUM_THREADS (torch's default), else the automatic choice (cpu_threads.py); and how
    the "serving on" line says an automatic choice."""
    from ..cpu_threads import choose_threads
    from ..settings import CpuEnv
    env = CpuEnv.from_env()
    import torch
    choice = choose_threads(args.threads, env.omp_threads_set, torch.get_num_threads())
    note = ""
    if choice.threads is not None and choice.why.startswith("auto"):
        note = (f"; {choice.threads} CPU thread{'s' if choice.threads != 1 else ''} per engine ({choice.why}; "
                "--threads N to choose)")
    return choice.threads, note


def _sampling(args) -> dict:
    """serve's sampling defaults (the options given), checked like a request's fields, named by their flags."""
    from ..serve.defaults import FIELDS
    flags = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
             "repetition_penalty": "--repetition-penalty"}
    out = {}
    for name, flag in flags.items():
        v = getattr(args, name)
        if v is None:
            continue
        kind, lo, hi, lo_open = FIELDS[name]
        if not (math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi):
            rng = f"at least {lo}" if kind is int else f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise TrapetumError(f"{flag} must be {rng}, got {v:g}")
        out[name] = v
    return out


MAX_KEY_FILE = 4096


def _api_key(args) -> str | None:
    """--api-key, else --api-key-file, else TRAPETUM_API_KEY (settings.ServeEnv); at most one of the two options."""
    from ..settings import ServeEnv

    if args.api_key is not None and args.api_key_file is not None:
        raise TrapetumError("give --api-key or --api-key-file, not both")
    if args.api_key is not None:
        print("trapetum: warning: --api-key is visible to every user of this machine (ps); prefer "
              "--api-key-file FILE or TRAPETUM_API_KEY", file=sys.stderr)
        key = args.api_key
    elif args.api_key_file is not None:
        try:
            with open(args.api_key_file, "rb") as f:
                raw = f.read(MAX_KEY_FILE + 1)
        except OSError as e:
            raise TrapetumError(f"{args.api_key_file}: cannot read the API key file ({e.strerror or e})") from None
        if len(raw) > MAX_KEY_FILE:
            raise TrapetumError(f"{args.api_key_file}: larger than {MAX_KEY_FILE} bytes; expected one line, the key")
        try:
            lines = raw.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise TrapetumError(f"{args.api_key_file}: the API key file is not UTF-8 text") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise TrapetumError(f"{args.api_key_file}: the API key file is empty")
    else:
        key = ServeEnv.from_env().api_key
    if key is not None and (not key.strip() or any(c.isspace() or not c.isprintable() for c in key)
                            or not key.isascii()):
        raise TrapetumError("the API key must be printable ASCII without spaces")
    return key
