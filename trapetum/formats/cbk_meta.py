"""Schema of the ``.cbk`` metadata objects besides the tensor table: tokenizer, generation, recipe, provenance,
sparsity.

The metadata hash proves nothing about intent (anyone can recompute it), so every value a later stage reads is
type- and range-checked when the file is opened: ``trapetum verify`` and ``load`` refuse what generation,
``info`` or ``export-aqlm`` would crash on, with the field named. The config is checked by
``ModelConfig.from_dict`` (types, ranges and consistency, ``models/config.py``); the quantized layers' params by
their schemes (``schemes/*.check``, at load and by ``CbkFile.verify``).

Unknown keys inside these objects are ignored (as unknown top-level keys are), values of known keys are not.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from ..models import sparsity as _sparsity

Fail = Callable[[str], Any]

MAX_TEMPLATE_CHARS = 1 << 20      # a chat template (the largest real ones are ~20 KB)
MAX_TOKEN_CHARS = 4096            # one special token's text
MAX_EOS_TOKENS = 256


def _show(v: Any) -> str:
    return " ".join(repr(v).split())[:60]


def _opt_str(d: dict, key: str, what: str, fail: Fail, limit: int = MAX_TOKEN_CHARS) -> None:
    v = d.get(key)
    if v is not None and (not isinstance(v, str) or len(v) > limit):
        fail(f"{what}.{key} must be a string of at most {limit} characters or null, got {_show(v)}")


def check_tokenizer(tk: dict, fail: Fail) -> None:
    """``Tokenizer.to_dict()``'s form: tokenizer_json (str), bos_token (str|null), eos_tokens ([str]|null),
    chat_template (str|null), extra_special ({str: str}|null)."""
    if not isinstance(tk.get("tokenizer_json"), str):
        fail("tokenizer has no tokenizer_json string")
    _opt_str(tk, "bos_token", "tokenizer", fail)
    eos = tk.get("eos_tokens")
    if eos is not None and (not isinstance(eos, list) or len(eos) > MAX_EOS_TOKENS
                            or not all(isinstance(t, str) and len(t) <= MAX_TOKEN_CHARS for t in eos)):
        fail(f"tokenizer.eos_tokens must be a list of at most {MAX_EOS_TOKENS} strings or null, got {_show(eos)}")
    _opt_str(tk, "chat_template", "tokenizer", fail, MAX_TEMPLATE_CHARS)
    extra = tk.get("extra_special")
    if extra is not None and (not isinstance(extra, dict) or not all(
            isinstance(v, str) and len(v) <= MAX_TOKEN_CHARS for v in extra.values())):
        fail(f"tokenizer.extra_special must be an object of strings or null, got {_show(extra)}")
    if isinstance(extra, dict) and any(k in ("messages", "add_generation_prompt", "tools", "documents")
                                       for k in extra):
        fail("tokenizer.extra_special may not name a chat template variable (messages, tools, ...)")


def _int_list(v: Any) -> bool:
    items = v if isinstance(v, list) else [v]
    return all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in items)


def check_generation(g: dict, fail: Fail) -> None:
    """Default generation settings as a Hugging Face generation_config (exported as generation_config.json):
    token ids are non-negative integers (or lists of them), sampling values finite numbers."""
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if g.get(key) is not None and not _int_list(g[key]):
            fail(f"generation.{key} must be a token id or a list of token ids, got {_show(g[key])}")
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens", "max_length"):
        v = g.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or v < 0):
            fail(f"generation.{key} must be a non-negative number, got {_show(v)}")
    if g.get("do_sample") is not None and not isinstance(g["do_sample"], bool):
        fail(f"generation.do_sample must be true or false, got {_show(g['do_sample'])}")


def check_recipe(r: dict, fail: Fail) -> None:
    """The quantization recipe: free-form, except what ``trapetum info`` and ``export-aqlm`` read."""
    errs = r.get("layer_errors")
    if errs is not None and (not isinstance(errs, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in errs.values())):
        fail("recipe.layer_errors must be an object of finite numbers")
    bpw = r.get("bits_per_weight")
    if bpw is not None and (not isinstance(bpw, (int, float, dict)) or isinstance(bpw, bool)):
        fail(f"recipe.bits_per_weight must be a number or an object, got {_show(bpw)}")
    hf = r.get("hf_config")
    if hf is not None:
        if not isinstance(hf, dict):
            fail(f"recipe.hf_config must be an object, got {_show(hf)}")
        qc = hf.get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            fail(f"recipe.hf_config.quantization_config must be an object, got {_show(qc)}")


def check_provenance(p: dict, fail: Fail) -> None:
    """Where the file came from: source, source_sha256, tool_version, created are strings when present."""
    for key in ("source", "source_sha256", "tool_version", "created", "source_format"):
        _opt_str(p, key, "provenance", fail)


def check_sparsity(sp: Any, num_layers: int, fail: Fail) -> "_sparsity.SparsityTable | None":
    """The optional activation-sparsity section (models/sparsity.py: per-layer, per-site thresholds). A section of
    another integer ``version`` is kept unread (None: the file still opens; ``--sparsity on`` says which version
    it has); anything else malformed fails naming the field."""
    if isinstance(sp, dict) and isinstance(sp.get("version"), int) and not isinstance(sp.get("version"), bool) \
            and sp["version"] != _sparsity.VERSION:
        return None
    return _sparsity.SparsityTable.from_dict(sp, fail, num_layers)
