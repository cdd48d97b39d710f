"""Drafter specifications (what ``--draft`` and ``trapetum.load(draft=...)`` take) -> a SpeculativeRunner.

    "ngram"              n-gram / prompt lookup (ngram.py); "ngram:N" looks up suffixes of up to N tokens
    "pard:MODEL"         a PARD drafter (pard.py): MODEL is any path Trapetum loads; its mask token comes from its
                         config (``pard_token``) or ``mask_token``
    "MODEL"              a draft model (draft_model.py): a HF directory, .gguf or .cbk with the target's tokenizer,
                         e.g. a 2- or 3-bit .cbk of the target's own checkpoint
A Drafter object is used as it is. Model paths are loaded by the caller's ``load(path)`` (api.Model on the target's
device and options: the GPU engine on CUDA, the reference decoder on the CPU), a separate model whose KV cache is
its own.
"""
from __future__ import annotations

from typing import Any, Callable

from ...errors import ConfigError
from .draft_model import DraftModelDrafter
from .drafter import Drafter
from .loop import SpeculativeRunner, check_k
from .ngram import NgramDrafter
from .pard import PardDrafter, mask_token_id
from .rows import Rows, model_rows

PROBE = "The quick brown fox jumps over the lazy dog. def f(x):\n    return x ** 2  # 3.14 café 東京 🙂"


def parse_draft(spec: str) -> tuple[str, str | None]:
    """("ngram", "N" or None) | ("pard", path) | ("model", path); ConfigError on an empty spec."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"draft: 'ngram', 'pard:MODEL' or a model path, got {spec!r}")
    spec = spec.strip()
    if spec == "ngram" or spec.startswith("ngram:"):
        n = spec[len("ngram:"):] if ":" in spec else None
        if n is not None and not (n.isdigit() and 1 <= int(n) <= 16):
            raise ConfigError(f"draft: ngram:N takes N in 1..16, got {spec!r}")
        return "ngram", n
    if spec.startswith("pard:"):
        path = spec[len("pard:"):]
        if not path:
            raise ConfigError("draft: pard:MODEL needs a model path")
        return "pard", path
    return "model", spec


def check_tokenizers(target_tok, draft_tok, where: str) -> None:
    """ConfigError when both tokenizers are known and encode a probe text differently."""
    if target_tok is None or draft_tok is None:
        return
    if target_tok.encode(PROBE) != draft_tok.encode(PROBE):
        raise ConfigError(f"{where}: the draft model's tokenizer differs from the target's (a drafter must share "
                          "the target's tokenizer)")


def drafter_rows(m: Any, max_len: int) -> Rows:
    """Rows over a loaded model (api.Model): its GPU engine, else its reference decoder."""
    return model_rows(engine=m.engine, decoder=None if m.engine is not None else m.decoder, max_len=max_len)


def make_drafter(spec: str | Drafter, *, load: Callable[[str], Any], target_tokenizer=None, max_len: int = 8192,
                 mask_token: int | None = None) -> tuple[Drafter, Any]:
    """(drafter, its loaded model or None)."""
    if isinstance(spec, Drafter):
        return spec, None
    kind, arg = parse_draft(spec)
    if kind == "ngram":
        n = int(arg) if arg else 4
        return NgramDrafter(max_n=n, min_n=min(2, n)), None
    m = load(arg)
    check_tokenizers(target_tokenizer, m.tokenizer, arg)
    rows = drafter_rows(m, max_len)
    if kind == "pard":
        return PardDrafter(rows, mask_token_id(m.checkpoint, mask_token)), m
    return DraftModelDrafter(rows, label=str(arg)), m


def speculative_runner(target: Rows, drafter: Drafter, k: int = 4, adaptive: bool = False) -> SpeculativeRunner:
    return SpeculativeRunner(target, drafter, check_k(k), adaptive=adaptive)
