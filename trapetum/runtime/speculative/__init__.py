"""Exact speculative decoding (issue 16): drafters propose, the target verifies K + 1 rows in one pass.

    rows.py         the target/drafter side: position-addressed row forwards over the GPU engine or the reference
    drafter.py      the Drafter interface (begin, propose -> Draft(tokens, q)), the drafters' sampler
    draft_model.py  a draft model (any model with the target's tokenizer, a lower-bit copy of the target included)
    pard.py         PARD parallel drafting (one forward over the new tokens plus K - 1 mask tokens)
    ngram.py        n-gram / prompt lookup
    scripted.py     scripted (modeled acceptance) and adversarial drafters
    accept.py       the accept rules: greedy prefix match; speculative sampling with the residual distribution
    loop.py         SpeculativeRunner (the Runner protocol of runtime/generate.py), SpecStats; the synchronous loop
    pipeline.py     the pipelined loop (round r + 1 queued before round r's verdict is read back; CUDA default)
    factory.py      "ngram" | "pard:MODEL" | "MODEL" -> a drafter
Greedy output is token for token plain greedy decoding of the same target; sampled output has its distribution.
"""
from .drafter import Draft, DraftContext, Drafter
from .draft_model import DraftModelDrafter
from .factory import make_drafter, parse_draft, speculative_runner
from .loop import MAX_K, SpecStats, SpeculativeRunner
from .ngram import NgramDrafter
from .pard import PardDrafter
from .rows import EngineRows, ReferenceRows, Rows, model_rows
from .scripted import ConstantDrafter, OverlongDrafter, RandomDrafter, ScriptedDrafter

__all__ = ["Draft", "DraftContext", "Drafter", "DraftModelDrafter", "PardDrafter", "NgramDrafter", "ScriptedDrafter",
           "RandomDrafter", "ConstantDrafter", "OverlongDrafter", "SpeculativeRunner", "SpecStats", "MAX_K",
           "Rows", "EngineRows", "ReferenceRows", "model_rows", "make_drafter", "parse_draft", "speculative_runner"]
