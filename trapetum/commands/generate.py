"""trapetum generate [MODEL] PROMPT: stream a continuation (or a chat answer with --chat).

The prompt is the last positional argument, ``-p TEXT``, ``-f FILE``, or ``-`` (standard input); the model is
the positional argument before it or ``-m MODEL`` (default: the embedded model). Options may go anywhere.
"""
from __future__ import annotations

import os
import sys

from ..errors import TrapetumError
from ._common import (add_context, add_device, add_draft, add_gpu_mem, add_host_numerics, add_kernel_options, add_model_option, add_sampling, add_sparsity,
                      apply_threads, context_of, draft_kwargs, loading, options_of, settings_from)

MAX_PROMPT_BYTES = 64 << 20  # a prompt file or standard input larger than this is refused
MODEL_SUFFIXES = (".cbk", ".gguf", ".safetensors")
EMBEDDED = "the embedded model (SmolLM2-135M-Instruct)"


def register(sub) -> None:
    p = sub.add_parser("generate", intermixed=True, help="generate text from a prompt",
                       description="Generate text. MODEL is a HF directory, .gguf or .cbk; without it the "
                                   "embedded default (SmolLM2-135M-Instruct). The prompt is PROMPT, -p TEXT, "
                                   "-f FILE, or - to read it from standard input. Options may go anywhere.",
                       epilog='examples: trapetum generate "The capital of France is" -n 16; '
                              'trapetum generate model.cbk --chat "Why is the sky blue?"; '
                              'echo "Once upon a time" | trapetum generate -m model.gguf -')
    p.add_argument("args", nargs="*", metavar="[MODEL] PROMPT")
    add_model_option(p)
    p.add_argument("-p", "--prompt", default=None, metavar="TEXT", help="the prompt (instead of PROMPT)")
    p.add_argument("-f", "--file", default=None, metavar="FILE", help="read the prompt from FILE ('-': stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--stats", action="store_true",
                   help="print tokens/s, time to first token and the thread count to stderr")
    p.add_argument("--precise-prefill", action="store_true", default=None,
                   help="GPU engine: process the prompt in the precise prefill (fp32 activations; slower "
                        "prompt, same decode; same as TRAPETUM_PREFILL=precise)")
    add_device(p)
    add_kernel_options(p)
    add_host_numerics(p)
    add_gpu_mem(p)
    add_context(p)
    add_sampling(p)
    add_draft(p)
    add_sparsity(p)
    p.set_defaults(func=run)


def looks_like_model(s: str) -> bool:
    """An existing directory, or an existing file with a model's suffix."""
    return os.path.isdir(s) or (os.path.isfile(s) and s.lower().endswith(MODEL_SUFFIXES))


def read_prompt(source: str, what: str) -> str:
    """The text of FILE, or of standard input for '-' (one-line TrapetumError naming ``what`` otherwise)."""
    try:
        if source == "-":
            if sys.stdin is None or sys.stdin.isatty():
                raise TrapetumError(f"{what}: '-' reads the prompt from standard input, which is a terminal; "
                                    "pipe the prompt in (echo TEXT | trapetum generate -) or give it as PROMPT")
            raw = sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1)
            name = "standard input"
        else:
            with open(source, "rb") as f:
                raw = f.read(MAX_PROMPT_BYTES + 1)
            name = source
    except OSError as e:
        raise TrapetumError(f"{what} {source}: cannot read ({e.strerror or e})") from None
    if len(raw) > MAX_PROMPT_BYTES:
        raise TrapetumError(f"{what}: {name} is larger than {MAX_PROMPT_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TrapetumError(f"{what}: {name} is not UTF-8 text (byte {e.start})") from None
    text = text[:-1] if text.endswith("\n") else text  # `echo` adds one
    if not text:
        raise TrapetumError(f"{what}: {name} is empty")
    return text


def resolve(args) -> tuple[str | None, str]:
    """(model path or None for the embedded model, prompt) from the positionals, -m, -p and -f."""
    pos = list(args.args)
    model = args.model_opt
    given = [o for o, v in (("-p", args.prompt), ("-f", args.file)) if v is not None]
    if len(given) > 1:
        raise TrapetumError("give the prompt once: -p TEXT or -f FILE, not both")
    if given:
        if model is None and len(pos) == 1:
            model = pos.pop()
        if pos:
            raise TrapetumError(f"the prompt is given by {given[0]}; unexpected argument {pos[0]!r} "
                                f"(the model goes first, or after -m)")
        prompt = args.prompt if args.prompt is not None else read_prompt(args.file, "-f")
        return _model(model), prompt
    if model is None and len(pos) == 2:
        model = pos.pop(0)
        if model != "default" and not os.path.exists(model):
            raise TrapetumError(f"{model!r} is not a model file or directory (generate takes [MODEL] PROMPT: "
                                "quote a prompt of several words, or pass it with -p TEXT)")
    if len(pos) > 1:
        raise TrapetumError("generate takes [MODEL] PROMPT: quote a prompt of several words, or pass it with -p TEXT")
    if not pos:
        raise TrapetumError("no prompt: give PROMPT, -p TEXT, -f FILE, or - to read it from standard input")
    prompt = pos[0]
    if model is None and looks_like_model(prompt):
        raise TrapetumError(f"no prompt after the model {prompt}: give PROMPT, -p TEXT, -f FILE, or - for "
                            "standard input")
    if prompt == "-":
        prompt = read_prompt("-", "PROMPT")
    return _model(model), prompt


def _model(m: str | None) -> str | None:
    return None if m in (None, "default") else m


def run(args) -> int:
    model_path, prompt = resolve(args)
    s = settings_from(args)
    ctx = context_of(args)
    threads = apply_threads(args)
    from ..api import load
    with loading(model_path or EMBEDDED, args.device, threads):
        m = load(model_path, device=args.device, max_context=ctx, precise_prefill=args.precise_prefill,
                 sparsity=args.sparsity, options=options_of(args), gpu_mem=args.gpu_mem, **draft_kwargs(args))
    events = (m.chat_stream([{"role": "user", "content": prompt}], s) if args.chat else m.stream(prompt, s))
    if not args.chat:
        sys.stdout.write(prompt)
    for ev in events:
        if ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        if ev.done:
            sys.stdout.write("\n")
            c = ev.completion
            if args.stats:
                n = threads.threads
                shown = f"{n} thread{'s' if n != 1 else ''}" if n else "torch's threads"
                print(f"[{c.completion_tokens} tokens, {c.tokens_per_s:.1f} tok/s, "
                      f"first token {c.ttft_s * 1000:.0f} ms, finish {c.finish_reason}, {shown} ({threads.why})]",
                      file=sys.stderr)
                if m.speculative is not None:
                    print(f"[speculative {m.speculative.stats.line()}]", file=sys.stderr)
    return 0
