"""trapetum generate [MODEL] PROMPT: stream a continuation (or a chat answer with --chat)."""
from __future__ import annotations

import sys

from ..errors import TrapetumError
from ._common import add_device, add_draft, add_sparsity, add_sampling, apply_threads, draft_kwargs, settings_from


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate text. MODEL is a HF directory, .gguf or .cbk; "
                                   "without it the embedded default (SmolLM2-135M-Instruct).")
    p.add_argument("args", nargs="+", metavar="[MODEL] PROMPT")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--stats", action="store_true", help="print tokens/s and time to first token to stderr")
    p.add_argument("--precise-prefill", action="store_true", default=None,
                   help="GPU engine: process the prompt in the precise prefill (fp32 activations; slower "
                        "prompt, same decode; same as TRAPETUM_PREFILL=precise)")
    add_device(p)
    add_sampling(p)
    add_draft(p)
    add_sparsity(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..api import load
    if len(args.args) > 2:
        raise TrapetumError("generate takes [MODEL] PROMPT (quote the prompt)")
    model_path, prompt = (args.args if len(args.args) == 2 else (None, args.args[0]))
    s = settings_from(args)
    apply_threads(args)
    m = load(model_path, device=args.device, precise_prefill=args.precise_prefill, sparsity=args.sparsity,
             **draft_kwargs(args))
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
                print(f"[{c.completion_tokens} tokens, {c.tokens_per_s:.1f} tok/s, "
                      f"first token {c.ttft_s * 1000:.0f} ms, finish {c.finish_reason}]", file=sys.stderr)
                if m.speculative is not None:
                    print(f"[speculative {m.speculative.stats.line()}]", file=sys.stderr)
    return 0
