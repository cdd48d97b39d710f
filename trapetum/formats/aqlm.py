"""Hugging Face AQLM directories <-> ``.cbk``.

An AQLM directory is a Hugging Face model directory whose ``config.json`` holds
``quantization_config = {"quant_method": "aqlm", "nbits_per_codebook", "num_codebooks",
"in_group_size", "out_group_size", "linear_weights_not_to_quantize"}`` and whose quantized
linears ``P`` are stored as ``P.codes`` (int8 / int16 [out/og, in/ig, M]), ``P.codebooks``
(fp16 [M, 2**nbits, og, ig]), ``P.scales`` (fp16 [out/og, 1, 1, 1]) and optionally ``P.bias``
(see ``trapetum.quant.additive`` for the arithmetic).

* ``load_aqlm(dir)`` -> Checkpoint whose quantized projections are QuantRecords of scheme "aqlm"
  holding the source tensors unchanged (byte for byte); everything else as the source has it.
* ``import_aqlm(dir, out.cbk)``: that checkpoint, with the LM head (dense in every published AQLM
  model) turned into an 8-bit per-row scalar codebook by the scalar quantizer (unweighted: an import
  runs no calibration), written as ``.cbk``. The source ``config.json`` is kept in the recipe so an
  export can give it back.
* ``export_aqlm(in.cbk, dir)``: "aqlm" records are written back unchanged; any other quantized
  projection (the 8-bit LM head, 4-bit layers) is dequantized to fp16 and listed in
  ``linear_weights_not_to_quantize``; dense tensors are written as stored. The directory loads in
  ``transformers`` with the ``aqlm`` package (on the CPU: ``dtype=torch.float32``).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import FormatError, UnsupportedError
from ..schemes.record import QuantRecord
from ..models.checkpoint import Checkpoint, LazyTensors
from .hf import _safetensor_files, _tokenizer, canonical_name, read_json

__all__ = ["is_aqlm_dir", "load_aqlm", "import_aqlm", "export_aqlm", "hf_config_for", "write_aqlm_dir"]

AQLM_ROLES = ("codes", "codebooks", "scales")
_HF_ARCH = {"llama": ("llama", "LlamaForCausalLM"), "mistral": ("mistral", "MistralForCausalLM"),
            "qwen2": ("qwen2", "Qwen2ForCausalLM")}


def _qconfig(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    q = cfg.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "aqlm":
        raise FormatError(f"{where}: not an AQLM checkpoint (quantization_config.quant_method != 'aqlm')")
    for k in ("nbits_per_codebook", "num_codebooks", "in_group_size", "out_group_size"):
        if not isinstance(q.get(k), int) or q[k] <= 0:
            raise FormatError(f"{where}: quantization_config.{k} must be a positive integer, got {q.get(k)!r}")
    if q["nbits_per_codebook"] > 16:
        raise UnsupportedError(f"{where}: nbits_per_codebook {q['nbits_per_codebook']} > 16 is not supported")
    return q


def is_aqlm_dir(path: str | os.PathLike) -> bool:
    p = Path(path) / "config.json"
    try:
        q = json.loads(p.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(q, dict) and q.get("quant_method") == "aqlm"


def load_aqlm(path: str | os.PathLike) -> Checkpoint:
    """AQLM directory -> Checkpoint (lazy; "aqlm" QuantRecords keep the source tensors as they are)."""
    from ..models.families import config_from_hf

    d = Path(path)
    if not d.is_dir():
        raise FormatError(f"{d}: not a directory")
    hf_cfg = read_json(d / "config.json")
    q = _qconfig(hf_cfg, str(d / "config.json"))
    config = config_from_hf({k: v for k, v in hf_cfg.items() if k != "quantization_config"},
                            where=str(d / "config.json"))
    gen = read_json(d / "generation_config.json") if (d / "generation_config.json").exists() else {}
    params = {"num_codebooks": q["num_codebooks"], "nbits": q["nbits_per_codebook"],
              "in_group_size": q["in_group_size"], "out_group_size": q["out_group_size"]}
    where: dict[str, tuple[Any, str, Path]] = {}  # canonical name -> (handle, key, file)
    for f in _safetensor_files(d):
        try:
            h = safe_open(str(f), framework="pt")
            keys = list(h.keys())
        except Exception as e:  # safetensors raises several types
            raise FormatError(f"{f}: not a valid safetensors file ({e})") from None
        for k in keys:
            name = canonical_name(k)
            if name is None or name.endswith("rotary_emb.inv_freq"):
                continue
            if "qkv_proj" in name or "gate_up_proj" in name:
                raise UnsupportedError(f"{f}: fused projection {k} in an AQLM checkpoint is not supported")
            where[name] = (h, k, f)

    def get(name: str) -> torch.Tensor:
        h, k, f = where[name]
        try:
            return h.get_tensor(k)
        except Exception as e:
            raise FormatError(f"{f}: cannot read tensor {k!r} ({e})") from None

    def expected_shape(proj: str) -> tuple[int, int]:
        from ..models.checkpoint import expected_shapes

        s = expected_shapes(config).get(proj + ".weight")
        if s is None:
            raise FormatError(f"{d}: quantized tensor {proj} is not a projection of this model")
        return s

    projs = sorted({n.rsplit(".", 1)[0] for n in where if n.rsplit(".", 1)[-1] in AQLM_ROLES})
    getters: dict[str, Callable[[], Any]] = {}
    formats: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for p in projs:
        missing = [r for r in AQLM_ROLES if f"{p}.{r}" not in where]
        if missing:
            raise FormatError(f"{d}: quantized projection {p} lacks {', '.join(missing)}")
        shape = expected_shape(p)

        def rec(p=p, shape=shape) -> QuantRecord:
            return QuantRecord("aqlm", shape, dict(params), {r: get(f"{p}.{r}") for r in AQLM_ROLES},
                               get(p + ".bias") if p + ".bias" in where else None)

        getters[p + ".weight"] = rec
        formats[p + ".weight"] = f"aqlm-{params['num_codebooks']}x{params['nbits']}"
        shapes[p + ".weight"] = shape
    quant_biases = {p + ".bias" for p in projs}
    for n in where:
        if n.rsplit(".", 1)[0] in projs or n in quant_biases:
            continue
        getters[n] = lambda n=n: get(n)
        h, k, _ = where[n]
        sl = h.get_slice(k)
        formats[n], shapes[n] = sl.get_dtype(), tuple(sl.get_shape())
    meta = {"hf_config": hf_cfg, "aqlm": params}
    return Checkpoint(config=config, tensors=LazyTensors(getters, formats, shapes), tokenizer=_tokenizer(d, gen),
                      source=str(d), source_format="aqlm", generation=gen, meta=meta)


def import_aqlm(src: str | os.PathLike, out: str | os.PathLike, *, head_bits: int | None = 8,
                device: str = "cpu", log: Callable[[str], None] | None = None) -> Path:
    """AQLM directory -> ``.cbk``: AQLM tensors byte for byte, LM head as a ``head_bits`` scalar codebook."""
    from dataclasses import replace

    from ..quant.quantize import Recipe, _quantize_matrix
    from .cbk import write_cbk

    log = log or (lambda s: print(s, file=sys.stderr))
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
        rec, err = _quantize_matrix(H.float(), head_bits, None, Recipe(head_bits=head_bits), device, None)
        quantized["lm_head.weight"] = rec
        head_err = err["rel_err"]
        log(f"lm_head {head_bits}-bit  rel. weight error {head_err:.4f}")
    n_aqlm = sum(r.scheme == "aqlm" for r in quantized.values())
    p = ckpt.meta["aqlm"]
    recipe = {"method": f"imported AQLM {p['num_codebooks']}x{p['nbits']} (codes, codebooks, scales byte for byte)"
                        + (f"; lm_head {head_bits}-bit per-row scalar codebook (unweighted)" if head_err is not None else ""),
              "aqlm": p, "hf_config": ckpt.meta["hf_config"], "head_bits": head_bits,
              "layer_errors": {"lm_head": round(head_err, 6)} if head_err is not None else {}}
    prov = {"source": Path(src).name, "source_format": "aqlm", "aqlm_projections": n_aqlm}
    return Path(write_cbk(out, config=cfg, dense=dense, quantized=quantized, tokenizer=ckpt.tokenizer,
                          recipe=recipe, provenance=prov, generation=ckpt.generation or None))


# ----------------------------------------------------------------------------- export
def hf_config_for(config, qparams: dict[str, int], not_quantized: list[str]) -> dict[str, Any]:
    """A transformers config.json for a ModelConfig (llama, mistral, qwen2 families) with an AQLM
    quantization_config."""
    fam = config.family
    if fam not in _HF_ARCH:
        raise UnsupportedError(f"export-aqlm: family {fam!r} is not supported (llama, mistral, qwen2)")
    if config.sandwich_norms or config.qk_norm or config.norm_offset or config.embed_scale or config.final_softcap:
        raise UnsupportedError(f"export-aqlm: this {fam} model has quirks transformers' {fam} class lacks")
    mt, arch = _HF_ARCH[fam]
    d: dict[str, Any] = {
        "architectures": [arch], "model_type": mt, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": "silu", "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings, "torch_dtype": "float16",
    }
    if fam == "llama":
        d["attention_bias"] = bool(config.qkv_bias or config.o_bias)
        d["mlp_bias"] = bool(config.mlp_bias)
    elif fam == "mistral":
        d["sliding_window"] = config.sliding_window if "sliding" in config.layer_types else None
    d["quantization_config"] = _quant_config(qparams, not_quantized)
    return d


def _quant_config(qparams: dict[str, int], not_quantized: list[str]) -> dict[str, Any]:
    # Both spellings: older transformers match "<module>.weight", newer match module-name prefixes.
    names = []
    for n in not_quantized:
        names += [n, n[: -len(".weight")]] if n.endswith(".weight") else [n]
    return {"quant_method": "aqlm", "nbits_per_codebook": qparams["nbits"], "num_codebooks": qparams["num_codebooks"],
            "in_group_size": qparams["in_group_size"], "out_group_size": qparams["out_group_size"],
            "linear_weights_not_to_quantize": names}


def write_aqlm_dir(out: str | os.PathLike, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor],
                   tokenizer=None, generation: dict | None = None) -> Path:
    """Write config.json, model.safetensors (and tokenizer files) into ``out`` (via a temporary sibling,
    renamed into place). ``tensors`` uses HF names (``model.layers.0.self_attn.q_proj.codes``)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if generation:
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.tk.save(str(tmp / "tokenizer.json"))
        tc: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
                              "eos_token": tokenizer.eos_tokens[0] if tokenizer.eos_tokens else None}
        tc.update(tokenizer.extra_special)
        if tokenizer.chat_template:
            tc["chat_template"] = tokenizer.chat_template
        (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    if out.exists():
        old = out.with_name(out.name + ".old-export")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
    return out


def export_aqlm(src: str | os.PathLike, out: str | os.PathLike, log: Callable[[str], None] | None = None) -> Path:
    """``.cbk`` -> AQLM directory (see the module docstring)."""
    from ..quant.linear import build_linear
    from .cbk import open_cbk

    log = log or (lambda s: print(s, file=sys.stderr))
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
        else:
            mod = build_linear(rec, name)
            if name == "model.embed_tokens.weight":
                tensors[name] = mod.dequantize(torch.float32).to(torch.float16)
                continue
            tensors[name] = mod.dequantize(torch.float32).to(torch.float16)
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
    src_cfg = (f.recipe or {}).get("hf_config") if isinstance(f.recipe, dict) else None
    if isinstance(src_cfg, dict) and src_cfg.get("quantization_config", {}).get("quant_method") == "aqlm":
        hf_cfg = dict(src_cfg)
        hf_cfg["tie_word_embeddings"] = cfg.tie_word_embeddings
        hf_cfg["quantization_config"] = {**src_cfg["quantization_config"],
                                         **_quant_config(qparams, sorted(set(not_quantized)))}
    else:
        hf_cfg = hf_config_for(cfg, qparams, sorted(set(not_quantized)))
    if not cfg.tie_word_embeddings and "lm_head.weight" not in tensors:
        raise FormatError(f"{src}: untied model without lm_head.weight")
    path = write_aqlm_dir(out, hf_cfg, tensors, f.tokenizer, dict(f.generation) or None)
    log(f"exported {sum(1 for l in f.layers.values() if l.scheme == 'aqlm')} AQLM projections, "
        f"{len(not_quantized)} dequantized to fp16 ({', '.join(not_quantized[:3])}{'...' if len(not_quantized) > 3 else ''})")
    f.close()
    return path
