"""Arguments shared by several commands (model selection, sampling settings, bit widths)."""
from __future__ import annotations

import argparse

from ..errors import ConfigError, TrapetumError
from ..runtime.sampling import GenerationSettings


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch (default: torch's choice; 1 is faster on a busy machine)")


def apply_threads(args: argparse.Namespace) -> None:
    if args.threads is not None:
        if args.threads < 1:
            raise TrapetumError(f"--threads must be at least 1, got {args.threads}")
        import torch
        torch.set_num_threads(args.threads)


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


def add_sampling(p: argparse.ArgumentParser, temperature: float = 0.0, max_new: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=max_new, metavar="N")
    g.add_argument("--temperature", type=float, default=temperature, metavar="T", help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P")
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R")
    g.add_argument("--seed", type=int, default=None, metavar="S")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def settings_from(args: argparse.Namespace) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos).validate()


def bits_or_none(s: str, what: str) -> int | None:
    """A ``--head-bits`` / ``--embed-bits`` value: a number of bits, or None for fp16 / none / dense
    (ConfigError naming the option ``what`` otherwise)."""
    if s.lower() in ("fp16", "none", "dense"):
        return None
    try:
        return int(s)
    except ValueError:
        raise ConfigError(f"{what} must be a number of bits or fp16, got {s!r}") from None
