"""Hugging Face AQLM directories <-> ``.cbk``: the two conversions that quantize or dequantize.

``formats/aqlm.py`` reads and writes AQLM directories; this module moves models between that format
and ``.cbk``:

* ``import_aqlm(dir, out.cbk)``: the directory's checkpoint (``load_aqlm``: AQLM codes, codebooks and
  scales byte for byte), with the LM head (dense in every published AQLM model) turned into a
  ``head_bits`` per-row scalar codebook by the scalar quantizer (``quantize.quantize_matrix``,
  unweighted: an import runs no calibration), written as ``.cbk``. The source ``config.json`` is kept
  in the recipe so an export can give it back.
* ``export_aqlm(in.cbk, dir)``: "aqlm" records are written back unchanged; any other quantized
  projection (the 8-bit LM head, 4-bit layers) is dequantized to fp16 and listed in
  ``linear_weights_not_to_quantize``; dense tensors are written as stored. The directory loads in
  ``transformers`` with the ``aqlm`` package (on the CPU: ``dtype=torch.float32``).
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from ..errors import FormatError, UnsupportedError
from ..formats.aqlm import AQLM_ROLES, export_hf_config, load_aqlm, write_aqlm_dir
from ..formats.cbk import open_cbk, write_cbk
from ..schemes.record import QuantRecord
from ..schemes import registry
from .quantize import Recipe, quantize_matrix

__all__ = ["import_aqlm", "export_aqlm"]


def _stderr(s: str) -> None:
    print(s, file=sys.stderr)


def import_aqlm(src: str | os.PathLike, out: str | os.PathLike, *, head_bits: int | None = 8,
                device: str = "cpu", log: Callable[[str], None] | None = None) -> Path:
    """AQLM directory -> ``.cbk``: AQLM tensors byte for byte, LM head as a ``head_bits`` scalar codebook
    (``None``: the head as the source has it). Returns the written path."""
    log = log or _stderr
    ckpt = load_aqlm(src)
    cfg = ckpt.config
    dense: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantRecord] = {}
    for name in ckpt.tensors:
        v = ckpt.tensors[name]
        if isinstance(v, QuantRecord):
            quantized[name] = v
        else:
            dense[name] = v
    head_err = None
    if "lm_head.weight" in quantized:
        pass  # quantized in the source: kept as it is
    elif head_bits is not None:
        H = dense.pop("lm_head.weight", None)
        if H is None:  # tied: the head gets its own quantized table, the embedding stays as it is
            H = dense["model.embed_tokens.weight"]
            cfg = replace(cfg, tie_word_embeddings=False)
        rec, err = quantize_matrix(H.float(), head_bits, None, Recipe(head_bits=head_bits), device, None)
        quantized["lm_head.weight"] = rec
        head_err = err["rel_err"]
        log(f"lm_head {head_bits}-bit  rel. weight error {head_err:.4f}")
    n_aqlm = sum(r.scheme == "aqlm" for r in quantized.values())
    p = ckpt.meta["aqlm"]
    recipe = {"method": f"imported AQLM {p['num_codebooks']}x{p['nbits']} (codes, codebooks, scales byte for byte)"
                        + (f"; lm_head {head_bits}-bit per-row scalar codebook (unweighted)" if head_err is not None
                           else ""),
              "aqlm": p, "hf_config": ckpt.meta["hf_config"], "head_bits": head_bits,
              "layer_errors": {"lm_head": round(head_err, 6)} if head_err is not None else {}}
    prov = {"source": Path(src).name, "source_format": "aqlm", "aqlm_projections": n_aqlm}
    return Path(write_cbk(out, config=cfg, dense=dense, quantized=quantized, tokenizer=ckpt.tokenizer,
                          recipe=recipe, provenance=prov, generation=ckpt.generation or None))


def export_aqlm(src: str | os.PathLike, out: str | os.PathLike, log: Callable[[str], None] | None = None) -> Path:
    """``.cbk`` -> AQLM directory (see the module docstring). Returns the written directory."""
    log = log or _stderr
    f = open_cbk(src)
    qparams = None
    tensors: dict[str, torch.Tensor] = {}
    not_quantized: list[str] = []
    for name, layer in f.layers.items():
        rec = f.record(name)
        p = name[: -len(".weight")]
        if rec.scheme == "aqlm":
            if qparams is None:
                qparams = dict(rec.params)
            elif dict(rec.params) != qparams:
                raise UnsupportedError(f"export-aqlm: {name} is {rec.params}, another layer {qparams}: "
                                       "an AQLM directory has one quantization_config")
            for role in AQLM_ROLES:
                tensors[f"{p}.{role}"] = rec.tensors[role]
            if rec.bias is not None:
                tensors[p + ".bias"] = rec.bias
            continue
        tensors[name] = registry.dequantize(rec, torch.float32, name).to(torch.float16)
        if name == "model.embed_tokens.weight":
            continue  # an embedding table, not a linear: nothing to list
        if rec.bias is not None:
            tensors[p + ".bias"] = rec.bias
        not_quantized.append(name)
    if qparams is None:
        raise FormatError(f"{src}: holds no AQLM (additive) projections; nothing to export as AQLM")
    for name in f.dense:
        tensors[name] = f.tensor(name)
    cfg = f.config
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        tensors.pop("lm_head.weight")
    if "lm_head.weight" not in not_quantized and "lm_head.weight" not in f.layers:
        not_quantized.append("lm_head.weight")  # a dense or tied head must stay an nn.Linear in transformers
    hf_cfg = export_hf_config(cfg, f.recipe, qparams, sorted(set(not_quantized)))
    if not cfg.tie_word_embeddings and "lm_head.weight" not in tensors:
        raise FormatError(f"{src}: untied model without lm_head.weight")
    path = write_aqlm_dir(out, hf_cfg, tensors, f.tokenizer, dict(f.generation) or None)
    shown = ", ".join(not_quantized[:3]) + ("..." if len(not_quantized) > 3 else "")
    log(f"exported {sum(1 for l in f.layers.values() if l.scheme == 'aqlm')} AQLM projections, "
        f"{len(not_quantized)} dequantized to fp16 ({shown})")
    f.close()
    return path
