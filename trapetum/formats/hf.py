"""Hugging Face model directory -> Checkpoint (config.json, *.safetensors, tokenizer files).

Only safetensors weights are read (never pickle). Tensors are loaded lazily, one at a time.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer as HFTokenizer

from ..errors import FormatError
from ..jsondepth import MAX_DEPTH, nesting_depth
from ..models.families import config_from_hf, split_fused
from ..tokenizer import Tokenizer
from ..models.checkpoint import Checkpoint, LazyTensors

# Prefixes under which multimodal / wrapped checkpoints keep the text decoder.
PREFIXES = ("language_model.model.", "model.language_model.", "language_model.")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
MAX_JSON_BYTES = 64 << 20       # config.json, tokenizer_config.json, index files: far below this
MAX_TEMPLATE_BYTES = 1 << 20    # a chat template (the largest real ones are ~20 KB)


def _read_text(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except FileNotFoundError:
        raise FormatError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise FormatError(f"{path}: is a directory, not a file") from None
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) > limit:
        raise FormatError(f"{path}: larger than the {limit >> 20} MiB this reader accepts")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: not UTF-8 text (byte {e.start})") from None


def read_json(path: Path) -> dict[str, Any]:
    text = _read_text(path, MAX_JSON_BYTES)
    if nesting_depth(text) > MAX_DEPTH:
        raise FormatError(f"{path}: JSON nested more than {MAX_DEPTH} levels deep")
    try:
        d = json.loads(text)
    except ValueError as e:     # JSONDecodeError, and integers with too many digits
        raise FormatError(f"{path}: not valid JSON ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(d, dict):
        raise FormatError(f"{path}: expected a JSON object")
    return d


def chat_template_of(tc: dict[str, Any], where: Path) -> str | None:
    """The ``chat_template`` of a tokenizer_config.json: a string, or a list of {"name", "template"} objects
    (named templates: the one named "default"); FormatError naming the field for anything else."""
    t = tc.get("chat_template")
    if t is None or isinstance(t, str):
        return t or None
    if isinstance(t, list):
        for i, entry in enumerate(t):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) \
                    or not isinstance(entry.get("template"), str):
                raise FormatError(f"{where}: chat_template[{i}] must be an object with string 'name' and "
                                  "'template'")
        return next((e["template"] for e in t if e["name"] == "default"), None)
    raise FormatError(f"{where}: chat_template must be a string or a list of named templates, "
                      f"not {type(t).__name__}")


def canonical_name(name: str) -> str | None:
    for p in PREFIXES:
        if name.startswith(p):
            rest = name[len(p):]
            return rest if rest.startswith("lm_head") else "model." + rest
    if name.startswith("model.") or name.startswith("lm_head."):
        return name
    return None


def safetensor_files(d: Path) -> list[Path]:
    """The ``*.safetensors`` files of a HF directory (those of its index when it has one), sorted;
    FormatError when there are none or only pickle weights."""
    index = d / "model.safetensors.index.json"
    if index.exists():
        wm = read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise FormatError(f"{index}: missing 'weight_map'")
        files = sorted({d / f for f in wm.values()})
        for f in files:
            if not f.exists():
                raise FormatError(f"{f}: file not found (listed in {index.name})")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        if any(d.glob("*.bin")) or any(d.glob("*.pt")):
            raise FormatError(f"{d}: only pickle weights (*.bin/*.pt) found; Trapetum reads safetensors only")
        raise FormatError(f"{d}: no *.safetensors files")
    return files


def read_tokenizer(d: Path, gen: dict[str, Any]) -> Tokenizer | None:
    """The directory's tokenizer (``tokenizer.json``, ``tokenizer_config.json``, chat template; end-of-sequence
    tokens also from ``gen``, its generation_config), or None without a ``tokenizer.json``."""
    tj = d / "tokenizer.json"
    if not tj.exists():
        return None
    try:
        tk = HFTokenizer.from_file(str(tj))
    except Exception as e:  # tokenizers raises its own Exception type
        raise FormatError(f"{tj}: cannot parse tokenizer ({e})") from None
    tcp = d / "tokenizer_config.json"
    tc = read_json(tcp) if tcp.exists() else {}

    def tok_str(key: str) -> str | None:
        v = tc.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if v is not None and not isinstance(v, str):
            raise FormatError(f"{tcp}: {key} must be a string or an object with a string 'content'")
        return v

    template = chat_template_of(tc, tcp)
    jinja = d / "chat_template.jinja"
    if template is None and jinja.exists():
        template = _read_text(jinja, MAX_TEMPLATE_BYTES) or None
    if template is not None and len(template) > MAX_TEMPLATE_BYTES:
        raise FormatError(f"{tcp}: chat_template is longer than {MAX_TEMPLATE_BYTES} characters")
    eos = [tok_str("eos_token")]
    ids = gen.get("eos_token_id")
    for i in (ids if isinstance(ids, list) else [ids] if ids is not None else []):
        if isinstance(i, bool) or not isinstance(i, int):
            raise FormatError(f"{d / 'generation_config.json'}: eos_token_id must be an integer or a list of "
                              f"integers, got {' '.join(str(i).split())[:40]!r}")
        t = tk.id_to_token(i) if 0 <= i < 1 << 32 else None
        if t is not None:
            eos.append(t)
    extra = {k: v for k in ("unk_token", "pad_token") if (v := tok_str(k))}
    return Tokenizer(tk, bos_token=tok_str("bos_token"), eos_tokens=[e for e in dict.fromkeys(eos) if e],
                     chat_template=template, extra_special=extra, source=str(d))


_tokenizer = read_tokenizer  # the old name, still imported by tests/aqlm_helpers.py


def load_hf(path: str | os.PathLike) -> Checkpoint:
    d = Path(path)
    if not d.is_dir():
        raise FormatError(f"{d}: not a directory")
    cfg_path = d / "config.json"
    config = config_from_hf(read_json(cfg_path), where=str(cfg_path))
    gen = read_json(d / "generation_config.json") if (d / "generation_config.json").exists() else {}

    getters: dict[str, Callable[[], torch.Tensor]] = {}
    formats: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for f in safetensor_files(d):
        try:
            handle = safe_open(str(f), framework="pt")
            keys = list(handle.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise FormatError(f"{f}: not a valid safetensors file ({e})") from None
        for key in keys:
            name = canonical_name(key)
            if name is None or name.endswith(IGNORED_SUFFIXES):
                continue
            sl = handle.get_slice(key)
            dtype = sl.get_dtype()

            def get(h=handle, k=key, file=f) -> torch.Tensor:
                try:
                    return h.get_tensor(k)
                except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                    raise FormatError(f"{file}: cannot read tensor {k!r} ({e})") from None

            parts = split_fused(name, get, config)
            for cname, g in parts.items():
                getters[cname] = g
                formats[cname] = dtype
            if len(parts) == 1:  # renamed at most: the source's shape is the canonical tensor's
                shapes[next(iter(parts))] = tuple(sl.get_shape())
            elif parts:
                shapes[name] = tuple(sl.get_shape())
    return Checkpoint(config=config, tensors=LazyTensors(getters, formats, shapes), tokenizer=read_tokenizer(d, gen),
                      source=str(d), source_format="hf", generation=gen)
