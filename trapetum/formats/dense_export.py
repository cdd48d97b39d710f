"""Write a dense (fp16 or fp32) model as a GGUF file or a Hugging Face safetensors directory.

Used by ``trapetum rotate`` (``quant/rotate.py``'s fair sources) so that every quantizer, ours and llama.cpp's,
starts from the same file. Both writers take a Checkpoint of dense float tensors under canonical names
(``models/checkpoint.py``: HF convention, Gemma norms as ``w`` with ``norm_offset``).

GGUF (``write_dense_gguf``): needs a GGUF *source* file, whose metadata (architecture parameters, vocabulary,
chat template) is copied key by key with its GGUF types; ``general.file_type`` says F16 or F32. What
``formats/gguf.py`` undoes on reading is redone: llama-arch Q/K rows are permuted back to llama.cpp's interleaved
RoPE order, Gemma norms are stored as ``1 + w``. 2-D tensors are written in the chosen dtype, 1-D tensors (norms,
biases) in F32, as llama.cpp's converter does. A head the source did not have (``output.weight``) is added.

HF (``write_dense_hf``): ``config.json`` (the source's own when it is an HF directory, with the tie flag and dtype
updated; otherwise built from the ModelConfig for llama / mistral / qwen2 / gemma2 / gemma3), ``model.safetensors``,
``tokenizer.json`` + ``tokenizer_config.json``, ``generation_config.json``; written into a temporary sibling and
renamed into place.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..errors import FormatError, UnsupportedError
from ..models.checkpoint import Checkpoint
from ..models.config import ModelConfig
from .aqlm import write_aqlm_dir
from .gguf import CONFIG_TENSORS, GEMMA_LAYER_TENSORS, GLOBAL_TENSORS, GGUF_ARCHS, LAYER_TENSORS
from .hf import read_json

DTYPES = ("f16", "f32")
SKIP_KEYS = ("general.architecture", "general.alignment", "general.file_type")


def gguf_name(name: str, arch: str) -> str:
    """Canonical tensor name -> GGUF name (the inverse of ``gguf.canonical_gguf_name`` for dense layers)."""
    if name.startswith("model.layers."):
        _, _, i, *rest = name.split(".")
        base, suffix = ".".join(rest[:-1]), rest[-1]
        table = GEMMA_LAYER_TENSORS if arch.startswith("gemma") else \
            {k: v for k, v in LAYER_TENSORS.items() if k not in ("post_attention_norm", "post_ffw_norm")}
        inv = {v: k for k, v in table.items()}
        if base not in inv:
            raise UnsupportedError(f"GGUF export: no GGUF name for tensor {name} ({arch})")
        return f"blk.{i}.{inv[base]}.{suffix}"
    stem, _, suffix = name.rpartition(".")
    inv = {v: k for k, v in GLOBAL_TENSORS.items()}
    if stem not in inv:
        raise UnsupportedError(f"GGUF export: no GGUF name for tensor {name}")
    return f"{inv[stem]}.{suffix}"


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K row permutation (llama arch); ``gguf._unpermute_rows`` undoes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise UnsupportedError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def _stored(t: torch.Tensor, dtype: str, name: str) -> np.ndarray:
    a = t.detach().to(torch.float32).contiguous().numpy()
    if not np.isfinite(a).all():
        raise FormatError(f"export: tensor {name} holds NaN or infinite values")
    if a.ndim >= 2 and dtype == "f16":
        if float(np.abs(a).max(initial=0.0)) > 65504.0:
            raise FormatError(f"export: tensor {name} exceeds the fp16 range (use --dtype f32)")
        return a.astype(np.float16)
    return a


def write_dense_gguf(ckpt: Checkpoint, source_gguf: str | os.PathLike, out: str | os.PathLike, dtype: str = "f16",
                     extra_meta: dict[str, str] | None = None, log: Callable[[str], None] = lambda s: None) -> Path:
    """Write ``ckpt`` (dense tensors, canonical names) as a GGUF file with ``source_gguf``'s metadata; module doc."""
    import gguf

    _check_dtype(dtype)
    src = Path(source_gguf)
    if not src.is_file():
        raise FormatError(f"{src}: file not found")
    with open(src, "rb") as f:
        if f.read(4) != b"GGUF":
            raise FormatError(f"{src}: not a GGUF file (GGUF export copies a GGUF source's metadata)")
    try:
        reader = gguf.GGUFReader(str(src))
    except Exception as e:  # the gguf package raises ValueError / struct errors on a bad file
        raise FormatError(f"{src}: cannot read as GGUF ({type(e).__name__}: {' '.join(str(e).split())[:120]})") \
            from None
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch not in ("llama", "qwen2", "gemma2", "gemma3"):
        raise UnsupportedError(f"{src}: GGUF export supports the llama, qwen2, gemma2 and gemma3 architectures, "
                               f"not {arch!r}")
    cfg: ModelConfig = ckpt.config
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp-export")
    w = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in SKIP_KEYS:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16"
                                          else gguf.LlamaFileType.ALL_F32))
    for k, v in (extra_meta or {}).items():
        w.add_string(k, v)
    permute = GGUF_ARCHS[arch].get("permute_qk", False)
    for name in ckpt.tensors:
        t = ckpt.tensors[name]
        gname = gguf_name(name, arch)
        if permute and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            t = torch.from_numpy(permute_rows(t.numpy(), heads))
        if cfg.norm_offset and name.endswith("norm.weight"):
            t = t + cfg.norm_offset
        w.add_tensor(gname, _stored(t, dtype, name))
    for t in reader.tensors:  # configuration tensors (rope_freqs) as the source stores them
        if t.name in CONFIG_TENSORS:
            w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed([int(x) for x in t.shape])),
                         raw_dtype=t.tensor_type)
    log(f"writing {out}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers ``config.json`` for a dense ModelConfig of the llama / mistral / qwen2 / gemma2 / gemma3
    families (explicit ``layer_types``; what ``models/families.config_from_hf`` reads back)."""
    arch = {"llama": ("llama", "LlamaForCausalLM"), "mistral": ("mistral", "MistralForCausalLM"),
            "qwen2": ("qwen2", "Qwen2ForCausalLM"), "gemma2": ("gemma2", "Gemma2ForCausalLM"),
            "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}.get(cfg.family)
    if arch is None:
        raise UnsupportedError(f"HF export: family {cfg.family!r} is not supported (llama, mistral, qwen2, gemma2, "
                               "gemma3)")
    types = cfg.layer_types or ["full"] * cfg.num_layers
    d: dict[str, Any] = {
        "architectures": [arch[1]], "model_type": arch[0], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": "float16",
        "layer_types": [{"sliding": "sliding_attention"}.get(t, "full_attention") for t in types],
    }
    if cfg.sliding_window:
        d["sliding_window"] = cfg.sliding_window
    if cfg.family in ("llama", "mistral"):
        d["attention_bias"] = bool(cfg.qkv_bias or cfg.o_bias)
        d["mlp_bias"] = bool(cfg.mlp_bias)
    if cfg.family == "qwen2" and cfg.sliding_window:
        d["use_sliding_window"] = True
    if cfg.family.startswith("gemma"):
        d["hidden_activation"] = "gelu_pytorch_tanh"
        d["query_pre_attn_scalar"] = (cfg.attn_scale ** -2) if cfg.attn_scale else cfg.head_dim
        d["final_logit_softcapping"] = cfg.final_softcap
        d["attn_logit_softcapping"] = cfg.attn_softcap
        if cfg.rope_local_theta is not None:
            d["rope_local_base_freq"] = cfg.rope_local_theta
    else:
        d["hidden_act"] = "silu"
    return d


def write_dense_hf(ckpt: Checkpoint, out: str | os.PathLike, dtype: str = "f16",
                   log: Callable[[str], None] = lambda s: None) -> Path:
    """Write ``ckpt`` as a Hugging Face safetensors directory; module doc."""
    _check_dtype(dtype)
    cfg: ModelConfig = ckpt.config
    if ckpt.source_format == "hf" and (Path(ckpt.source) / "config.json").is_file():
        conf = dict(read_json(Path(ckpt.source) / "config.json"))
        conf["tie_word_embeddings"] = cfg.tie_word_embeddings
        conf["torch_dtype"] = "float16" if dtype == "f16" else "float32"
        conf.pop("dtype", None)
    else:
        conf = hf_config(cfg)
        conf["torch_dtype"] = "float16" if dtype == "f16" else "float32"
    tensors = {}
    for name in ckpt.tensors:
        a = _stored(ckpt.tensors[name], dtype, name)
        tensors[name] = torch.from_numpy(a.astype(np.float16) if dtype == "f16" else a)
    log(f"writing {out}")
    return write_aqlm_dir(out, conf, tensors, tokenizer=ckpt.tokenizer, generation=ckpt.generation or None)

