"""Hugging Face AQLM directories: reading (``load_aqlm``) and writing (``write_aqlm_dir``).

An AQLM directory is a Hugging Face model directory whose ``config.json`` holds
``quantization_config = {"quant_method": "aqlm", "nbits_per_codebook", "num_codebooks",
"in_group_size", "out_group_size", "linear_weights_not_to_quantize"}`` and whose quantized
linears ``P`` are stored as ``P.codes`` (int8 / int16 [out/og, in/ig, M]), ``P.codebooks``
(fp16 [M, 2**nbits, og, ig]), ``P.scales`` (fp16 [out/og, 1, 1, 1]) and optionally ``P.bias``
(see ``trapetum.quant.additive`` for the arithmetic).

* ``load_aqlm(dir)`` -> Checkpoint whose quantized projections are QuantRecords of scheme "aqlm"
  holding the source tensors unchanged (byte for byte); everything else as the source has it.
* ``write_aqlm_dir(out, hf_config, tensors, ...)`` writes such a directory atomically;
  ``export_hf_config`` / ``hf_config_for`` give its ``config.json``.

The conversions to and from ``.cbk`` (which quantize the LM head, or dequantize non-AQLM layers) are
``trapetum.quant.convert_aqlm.import_aqlm`` / ``export_aqlm``.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import FormatError, UnsupportedError
from ..schemes.record import QuantRecord
from ..models.checkpoint import Checkpoint, LazyTensors
from ..models.schema import expected_shapes
from ..models.families import config_from_hf
from .hf import canonical_name, read_json, read_tokenizer, safetensor_files

__all__ = ["is_aqlm_dir", "load_aqlm", "hf_config_for", "export_hf_config", "write_aqlm_dir", "AQLM_ROLES"]

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
    for f in safetensor_files(d):
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
    return Checkpoint(config=config, tensors=LazyTensors(getters, formats, shapes), tokenizer=read_tokenizer(d, gen),
                      source=str(d), source_format="aqlm", generation=gen, meta=meta)


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


def export_hf_config(config, recipe: Any, qparams: dict[str, int], not_quantized: list[str]) -> dict[str, Any]:
    """The config.json of an exported AQLM directory: the source's own config.json when the ``.cbk``'s
    ``recipe`` kept it (an import), with the file's tie flag and this export's quantization_config;
    else ``hf_config_for``."""
    src_cfg = recipe.get("hf_config") if isinstance(recipe, dict) else None
    if isinstance(src_cfg, dict) and src_cfg.get("quantization_config", {}).get("quant_method") == "aqlm":
        hf_cfg = dict(src_cfg)
        hf_cfg["tie_word_embeddings"] = config.tie_word_embeddings
        hf_cfg["quantization_config"] = {**src_cfg["quantization_config"], **_quant_config(qparams, not_quantized)}
        return hf_cfg
    return hf_config_for(config, qparams, not_quantized)


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
