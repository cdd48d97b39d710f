"""Sampling defaults of the server: what a request that leaves out ``temperature`` (or ``top_p``, ...) gets.

In order, the first that gives the field wins (vLLM's rule, with the operator's flags above the file):

1. the request;
2. ``trapetum serve --temperature T --top-p P --top-k K --min-p P --repetition-penalty R`` (``overrides``);
3. the model's own defaults: its ``generation_config.json`` (Hugging Face directories; a .cbk file keeps the
   source's), fields ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
   ``max_new_tokens`` (the default ``max_tokens``, within the context); values out of range are ignored;
4. ``BUILTIN``: temperature 0.7, as ``trapetum chat`` and the web page use (OpenAI's own default, 1.0, made the
   embedded 135M model answer a question about the capital of France in garbled French); the other fields are
   off (top_p 1, top_k 0, min_p 0, repetition_penalty 1). ``generate`` stays greedy (temperature 0).
"""
from __future__ import annotations

import math
from typing import Any

BUILTIN: dict[str, Any] = {"temperature": 0.7}
# field -> (kind, low, high, low bound open)
FIELDS = {"temperature": (float, 0.0, 2.0, False), "top_p": (float, 0.0, 1.0, True), "top_k": (int, 0, 1 << 30, False),
          "min_p": (float, 0.0, 1.0, False), "repetition_penalty": (float, 0.01, 10.0, False),
          "max_new_tokens": (int, 1, 1 << 30, False)}


def _valid(name: str, v: Any) -> bool:
    kind, lo, hi, lo_open = FIELDS[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        return False
    return math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi


def model_defaults(model: Any) -> dict[str, Any]:
    """The valid sampling fields of the model's generation config (``model.checkpoint.generation``)."""
    gen = getattr(getattr(model, "checkpoint", None), "generation", None)
    if not isinstance(gen, dict):
        return {}
    out: dict[str, Any] = {}
    for name, (kind, *_rest) in FIELDS.items():
        if name in gen and _valid(name, gen[name]):
            out[name] = kind(gen[name])
    return out


def sampling_defaults(model: Any, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The defaults a request to ``model`` starts from: BUILTIN, then the model's, then ``overrides``."""
    return {**BUILTIN, **model_defaults(model), **{k: v for k, v in (overrides or {}).items() if v is not None}}


def describe(defaults: dict[str, Any], model: Any, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """For ``/v1/models``: each default and where it comes from ("request field" -> value, source)."""
    mine = model_defaults(model)
    src = {k: ("serve option" if (overrides or {}).get(k) is not None else
               "generation_config" if k in mine else "server default") for k in defaults}
    return {k: {"value": v, "from": src[k]} for k, v in defaults.items()}
