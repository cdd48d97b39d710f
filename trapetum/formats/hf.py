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
from ..models.families import config_from_hf, split_fused
from ..tokenizer import Tokenizer
from ..models.checkpoint import Checkpoint, LazyTensors

# Prefixes under which multimodal / wrapped checkpoints keep the text decoder.
PREFIXES = ("language_model.model.", "model.language_model.", "language_model.")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise FormatError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise FormatError(f"{path}: expected a JSON object")
    return d


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
    tc = read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").exists() else {}

    def tok_str(v: Any) -> str | None:
        if isinstance(v, dict):
            return v.get("content")
        return v if isinstance(v, str) else None

    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja = d / "chat_template.jinja"
    if template is None and jinja.exists():
        template = jinja.read_text(encoding="utf-8")
    eos = [tok_str(tc.get("eos_token"))]
    ids = gen.get("eos_token_id")
    for i in (ids if isinstance(ids, list) else [ids] if ids is not None else []):
        t = tk.id_to_token(int(i))
        if t is not None:
            eos.append(t)
    extra = {k: tok_str(tc.get(k)) for k in ("unk_token", "pad_token") if tok_str(tc.get(k))}
    return Tokenizer(tk, bos_token=tok_str(tc.get("bos_token")), eos_tokens=[e for e in dict.fromkeys(eos) if e],
                     chat_template=template, extra_special=extra)


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

            for cname, g in split_fused(name, get, config).items():
                getters[cname] = g
                formats[cname] = dtype
            shapes[name] = tuple(sl.get_shape())
    return Checkpoint(config=config, tensors=LazyTensors(getters, formats, shapes), tokenizer=read_tokenizer(d, gen),
                      source=str(d), source_format="hf", generation=gen)
