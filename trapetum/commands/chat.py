"""trapetum chat [MODEL]: interactive chat in the terminal, streamed, with the model's chat template."""
from __future__ import annotations

import sys

from ..errors import TrapetumError
from ._common import (add_context, add_device, add_draft, add_gpu_mem, add_host_numerics, add_kernel_options, add_model_option, add_sampling, add_sparsity,
                      apply_threads, context_of, draft_kwargs, loading, options_of, settings_from)

HELP = "Type a message and press Enter; /help lists the commands, /exit (or Ctrl-D) quits."
COMMANDS = """commands:
  /help               this list
  /reset              start the conversation again (the system prompt stays)
  /system [TEXT]      show the system prompt, or set it to TEXT (starts again); '/system -' removes it
  /settings           show the sampling settings
  /set NAME VALUE     change one: temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens, seed
  /exit, /quit        leave (or Ctrl-D)"""
SETTABLE = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "repetition_penalty": float,
            "max_new_tokens": int, "seed": int}


def register(sub) -> None:
    p = sub.add_parser("chat", intermixed=True, help="interactive chat",
                       description="Chat with a model in the terminal (/help inside lists the commands: "
                                   "/reset, /system, /settings, /set, /exit).")
    p.add_argument("model", nargs="?", default=None, help="HF directory, .gguf or .cbk (default: embedded model)")
    add_model_option(p)
    p.add_argument("--system", default=None, help="system prompt (also /system TEXT in the chat)")
    add_device(p)
    add_kernel_options(p)
    add_host_numerics(p)
    add_gpu_mem(p)
    add_context(p)
    add_sampling(p, temperature=0.7, max_new=512)
    add_draft(p)
    add_sparsity(p)
    p.set_defaults(func=run)


def show_settings(s) -> str:
    seed = "random" if s.seed is None else s.seed
    return (f"temperature {s.temperature:g}, top_k {s.top_k}, top_p {s.top_p:g}, min_p {s.min_p:g}, "
            f"repetition_penalty {s.repetition_penalty:g}, max_new_tokens {s.max_new_tokens}, seed {seed}")


def set_setting(s, text: str) -> str:
    """``/set NAME VALUE``: a copy of the settings ``s`` changed, or a TrapetumError naming the problem."""
    import dataclasses
    parts = text.split()
    if len(parts) != 3:
        raise TrapetumError("usage: /set NAME VALUE (NAME: " + ", ".join(SETTABLE) + ")")
    _, name, value = parts
    name = name.replace("-", "_")
    if name not in SETTABLE:
        raise TrapetumError(f"/set: unknown setting {name!r} (one of " + ", ".join(SETTABLE) + ")")
    try:
        v = None if (name == "seed" and value in ("random", "none")) else SETTABLE[name](value)
    except ValueError:
        raise TrapetumError(f"/set {name}: {value!r} is not a number") from None
    new = dataclasses.replace(s, **{name: v}, stop=list(s.stop))
    try:
        return new.validate()
    except TrapetumError as e:
        raise TrapetumError(f"/set {e}") from None


def run(args) -> int:
    if args.model is not None and args.model_opt is not None:
        raise TrapetumError("give the model once: MODEL or -m MODEL")
    path = args.model_opt or args.model
    path = None if path == "default" else path
    s = settings_from(args)
    ctx = context_of(args)
    threads = apply_threads(args)
    from ..api import load
    from ..chat_template import ChatTemplateError
    with loading(path or "the embedded model", args.device, threads):
        m = load(path, device=args.device, max_context=ctx, sparsity=args.sparsity, options=options_of(args),
                 gpu_mem=args.gpu_mem, **draft_kwargs(args))
    m.encode_chat([{"role": "user", "content": "x"}])  # fail early if the model has no chat template
    system = args.system
    messages = [{"role": "system", "content": system}] if system else []
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
        if line.startswith("/"):  # a message may start with "/" after a space
            word = text.split(None, 1)[0]
            if word in ("/exit", "/quit"):
                return 0
            if word == "/help":
                print(COMMANDS)
            elif word == "/reset":
                messages = [{"role": "system", "content": system}] if system else []
                print("(conversation cleared)")
            elif word == "/system":
                rest = text[len(word):].strip()
                if not rest:
                    print(f"system prompt: {system!r}" if system else "(no system prompt)")
                    continue
                system = None if rest == "-" else rest
                messages = [{"role": "system", "content": system}] if system else []
                print("(system prompt removed; conversation cleared)" if system is None
                      else "(system prompt set; conversation cleared)")
            elif word == "/settings":
                print(show_settings(s))
            elif word == "/set":
                try:
                    s = set_setting(s, text)
                    print(show_settings(s))
                except TrapetumError as e:
                    print(f"trapetum: error: {e}", file=sys.stderr, flush=True)
            else:
                print(f"unknown command {word}; /help lists the commands (a message cannot start with '/': "
                      "put a space in front)")
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
