"""trapetum chat [MODEL]: interactive chat in the terminal, streamed, with the model's chat template."""
from __future__ import annotations

import sys

from ..chat_template import ChatTemplateError
from ._common import add_device, add_draft, add_sparsity, add_sampling, apply_threads, draft_kwargs, settings_from

HELP = "Type a message and press Enter. /reset clears the conversation, /exit (or Ctrl-D) quits."


def register(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat", description="Chat with a model in the terminal.")
    p.add_argument("model", nargs="?", default=None, help="HF directory, .gguf or .cbk (default: embedded model)")
    p.add_argument("--system", default=None, help="system prompt")
    add_device(p)
    add_sampling(p, temperature=0.7, max_new=512)
    add_draft(p)
    add_sparsity(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..api import load
    s = settings_from(args)
    apply_threads(args)
    m = load(args.model, device=args.device, sparsity=args.sparsity, **draft_kwargs(args))
    m.encode_chat([{"role": "user", "content": "x"}])  # fail early if the model has no chat template
    base = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(base)
    print(f"trapetum chat: {m.name} ({m.config.family}). {HELP}", flush=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages = list(base)
            print("(conversation cleared)")
            continue
        messages.append({"role": "user", "content": text})
        answer = []
        try:
            for ev in m.chat_stream(messages, s):
                if ev.text:
                    answer.append(ev.text)
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            print(" [interrupted]")
        except ChatTemplateError as e:  # e.g. the template refuses this turn: say so, keep the conversation
            print(f"trapetum: error: {e}", file=sys.stderr, flush=True)
            messages.pop()
            continue
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(answer)})
