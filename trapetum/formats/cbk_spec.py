"""The .cbk format: constants, dtype table, tensor/layer specs and the model-consistency check
shared by the writer (cbk_write.py) and the reader (cbk.py). The format itself is described in cbk.py."""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..models.config import ModelConfig
from ..schemes.record import QuantRecord
from ..models.schema import expected_names, expected_shapes

FORMAT_NAME = "trapetum-cbk"
# Version 2 (2026-12-01): codebook layers may store their centroids compactly (params "codebook": "u8" or
# "shared", schemes/codebook_store.py). The writer writes version 1 unless a layer needs version 2, so plain files
# stay readable by older builds; a version-1 file that holds a compact codebook is refused.
VERSION = 2
READ_VERSIONS = (1, 2)
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit
MAX_DIMS = 8
MAX_ELEMENTS = 2**62
IO_CHUNK = 64 * 2**20  # bytes per step when a file's or tensor's bytes are hashed or copied
HEX64 = re.compile(r"[0-9a-f]{64}")  # a sha256 hex digest, as the checksums are stored

# The tensor dtypes a .cbk stores, as safetensors names them: bytes per element, and the torch dtype's name (the torch
# reader, cbk.py, maps them to torch dtypes; this module imports no torch, so that the header reader does not).
_DTYPE_TABLE: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"), "U8": (1, "uint8"), "I8": (1, "int8"), "I16": (2, "int16"), "U16": (2, "uint16"),
    "I32": (4, "int32"), "U32": (4, "uint32"), "I64": (8, "int64"), "U64": (8, "uint64"), "F16": (2, "float16"),
    "BF16": (2, "bfloat16"), "F32": (4, "float32"), "F64": (8, "float64"),
    "F8_E4M3": (1, "float8_e4m3fn"), "F8_E5M2": (1, "float8_e5m2")}
DTYPE_SIZES: dict[str, int] = {name: size for name, (size, _) in _DTYPE_TABLE.items()}
TORCH_DTYPES: dict[str, str] = {name: attr for name, (_, attr) in _DTYPE_TABLE.items()}  # "F16" -> "float16"
_NAME_OF_TORCH = {f"torch.{attr}": name for name, attr in TORCH_DTYPES.items()}  # str(torch dtype) -> name
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def itemsize(dtype_name: str) -> int:
    """Bytes per element of a dtype named as safetensors names it ("F16" -> 2); KeyError if unknown."""
    return DTYPE_SIZES[dtype_name]


def one_line(x: Any, limit: int = 120) -> str:
    """``str(x)`` on one line (white space folded), cut to ``limit`` characters: for error messages that quote
    what a file holds."""
    s = " ".join(str(x).split())
    return s if len(s) <= limit else s[:limit] + "..."


# ---------------------------------------------------------------------------------------------
# Tensor and layer descriptions shared by the writer and the reader
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """dtype (safetensors name, e.g. "F16") and shape of a stored tensor, known before its bytes."""
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, t: Any) -> "TensorSpec":
        """The spec of a torch tensor."""
        name = _NAME_OF_TORCH.get(str(t.dtype))
        if name is None:
            raise ValueError(f"dtype {t.dtype} cannot be stored in a .cbk file")
        return cls(name, tuple(int(d) for d in t.shape))

    @property
    def nbytes(self) -> int:
        return itemsize(self.dtype) * math.prod(self.shape)


@dataclass
class QuantSpec:
    """Everything about a quantized projection except its bytes (see ``QuantRecord``)."""
    scheme: str
    shape: tuple[int, int]
    params: dict[str, Any]
    tensors: dict[str, TensorSpec]
    bias: TensorSpec | None = None

    @classmethod
    def of(cls, r: QuantRecord) -> "QuantSpec":
        return cls(r.scheme, tuple(int(d) for d in r.shape), dict(r.params),
                   {role: TensorSpec.of(t) for role, t in r.tensors.items()},
                   TensorSpec.of(r.bias) if r.bias is not None else None)


@dataclass(frozen=True)
class StoredTensor:
    """One entry of the safetensors table; ``begin``/``end`` are absolute file offsets."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class LayerEntry:
    name: str  # canonical weight name
    scheme: str
    shape: tuple[int, int]
    params: dict[str, Any]
    tensors: dict[str, str]  # role -> stored name
    bias: str | None = None


def versions_text() -> str:
    """"versions 1 and 2": what this build reads, as the error messages say it."""
    *head, last = (str(v) for v in READ_VERSIONS)
    return f"versions {', '.join(head)} and {last}" if head else f"version {last}"


def file_version(layers: Mapping[str, Any]) -> int:
    """The version a file with these layers (canonical name -> meta dict with "scheme" and "params") is written
    as: 1 unless a layer uses a version-2 feature (``needs_v2``)."""
    from ..schemes.codebook_storage import needs_v2
    return VERSION if any(needs_v2(d.get("scheme"), d.get("params")) for d in layers.values()) else 1


def format_label(scheme: str, params: Mapping[str, Any]) -> str:
    """Storage label of a quantized layer for ``LazyTensors.formats``: "codebook-4bit", "aqlm-2x8"..."""
    bits = params.get("bits")
    if isinstance(bits, int) and not isinstance(bits, bool):
        return f"{scheme}-{bits}bit"
    layout = params.get("layout")
    return f"{scheme}-{layout}" if isinstance(layout, str) else scheme


def header_digest(trapetum_text: str, table: Mapping[str, tuple], with_offsets: bool = False) -> str:
    """Hash of the metadata and each tensor's name, dtype and shape. Offsets are left out: a tool that
    rewrites the file with its tensors in another order (safetensors' save_file) keeps it valid.
    (``with_offsets``: the form written before 2026-11-30 02:07 UTC, still accepted on read.)"""
    rows = [[n, d, list(s), *(x[:2] if with_offsets else [])] for n, (d, s, *x) in sorted(table.items())]
    blob = json.dumps([trapetum_text, rows], ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("ascii")).hexdigest()


def check_model(cfg: ModelConfig, layers: Mapping[str, LayerEntry], dense: list[str],
                 table: Mapping[str, TensorSpec], fail: Callable[[str], Any]) -> None:
    """Check names and shapes against the config; every stored tensor referenced exactly once."""
    if cfg.num_layers > len(table):  # bound the work below by the file's own size
        fail(f"config has {cfg.num_layers} layers but the file stores only {len(table)} tensors")
    exp = expected_shapes(cfg)

    def expected(name: str) -> tuple[int, ...] | None:
        if name in exp:
            return exp[name]
        if name.endswith(".bias"):  # o_bias / mlp_bias projections: bias is [out_features]
            w = exp.get(name[:-len(".bias")] + ".weight")
            if w is not None and len(w) == 2:
                return (w[0],)
        return None

    owner: dict[str, str] = {}

    def claim(stored: str, what: str) -> TensorSpec:
        if stored not in table:
            fail(f"{what} names tensor {stored!r}, which is not in the file")
        if stored in owner:
            fail(f"tensor {stored!r} is used both as {owner[stored]} and as {what}")
        owner[stored] = what
        return table[stored]

    seen: set[str] = set()
    for name in dense:
        if name in seen:
            fail(f"dense tensor {name!r} is listed twice")
        seen.add(name)
        shape = expected(name)
        if shape is None:
            fail(f"dense tensor {name!r} is not a tensor of this model config")
        spec = claim(name, f"dense tensor {name!r}")
        if spec.shape != shape:
            fail(f"dense tensor {name!r} has shape {list(spec.shape)}, config expects {list(shape)}")
        if spec.dtype not in FLOAT_DTYPES:
            fail(f"dense tensor {name!r} has dtype {spec.dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
    for name, layer in layers.items():
        if name in seen:
            fail(f"{name!r} is stored both dense and quantized")
        seen.add(name)
        shape = exp.get(name)
        if shape is None or len(shape) != 2 or not name.endswith(".weight"):
            fail(f"quantized layer {name!r} is not a projection of this model config")
        if tuple(layer.shape) != shape:
            fail(f"quantized layer {name!r} has shape {list(layer.shape)}, config expects {list(shape)}")
        if not layer.tensors:
            fail(f"quantized layer {name!r} has no tensors")
        for role, stored in layer.tensors.items():
            claim(stored, f"{role} of {name!r}")
        if layer.bias is not None:
            spec = claim(layer.bias, f"bias of {name!r}")
            if spec.shape != (shape[0],) or spec.dtype not in FLOAT_DTYPES:
                fail(f"bias of {name!r} is {spec.dtype} {list(spec.shape)}, expected a float vector "
                     f"of {shape[0]}")
    missing = [n for n in expected_names(cfg) if n not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        fail(f"tensor {missing[0]!r} required by the config is missing{more}")
    unused = [n for n in table if n not in owner]
    if unused:
        fail(f"stored tensor {unused[0]!r} is not referenced by the metadata")
