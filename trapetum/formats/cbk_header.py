"""The torch-free half of the ``.cbk`` reader: the header, the tensor table and the metadata, validated.

``CbkHeader(path)`` reads the 8-byte length and the JSON header of a ``.cbk`` file (specification: ``cbk.py``) and
checks everything a load checks before touching tensor bytes: header size against the file size, JSON (no duplicate
keys, no NaN, bounded nesting), dtypes, shapes, offsets (in range, contiguous, covering the data exactly), the
metadata hash, the config, the layers against ``expected_shapes(config)``, the checksums' form, the tokenizer and
the optional sections. Every failure is a ``FormatError`` whose one-line message names the file. It needs json,
hashlib and mmap only (no torch, no numpy): ``trapetum info`` and the checksum half of ``trapetum verify`` run on
it, and ``cbk.CbkFile`` (the tensors, as torch tensors over a copy-on-write map) is a ``CbkHeader`` that adds the
tensor access: there is one parser of the format.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any, Callable

from ..errors import FormatError
from ..jsondepth import MAX_DEPTH, nesting_depth
from ..models.checkpoint import Checkpoint, LazyTensors
from ..models.config import ModelConfig
from ..tokenizer import Tokenizer
from .cbk_meta import check_generation, check_provenance, check_recipe, check_sparsity, check_tokenizer
from .cbk_spec import (
    DTYPE_SIZES, FORMAT_NAME, HEX64, IO_CHUNK, MAX_DIMS, MAX_ELEMENTS, MAX_HEADER_BYTES, READ_VERSIONS, VERSION,
    LayerEntry, StoredTensor, TensorSpec, check_model, file_version, format_label, header_digest, itemsize, one_line,
    versions_text)

def _parse_json(text: str, what: str, fail: Callable[[str], Any]) -> Any:
    def pairs(kv: list[tuple[str, Any]]) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for k, v in kv:
            if k in d:
                fail(f"{what} has duplicate key {one_line(repr(k), 60)}")
            d[k] = v
        return d

    def constant(c: str) -> None:
        fail(f"{what} contains {c}, which is not JSON")
    if nesting_depth(text) > MAX_DEPTH:
        fail(f"{what} is nested too deeply (more than {MAX_DEPTH} levels)")
    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except ValueError as e:  # JSONDecodeError, and integers with too many digits
        fail(f"{what} is not valid JSON ({one_line(e, 80)})")


_MAGICS = ((b"GGUF", "it is a GGUF file (info, generate and quantize read it as it is)"),
           (b"PK\x03\x04", "it is a zip archive (a PyTorch checkpoint?)"))


def _foreign_format(head: bytes) -> str | None:
    """What a file that starts with ``head`` is, when that is a known format other than safetensors."""
    return next((what for magic, what in _MAGICS if head.startswith(magic)), None)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class CbkHeader:
    """A validated ``.cbk`` header: ``tensors_table`` (stored name -> ``StoredTensor``, absolute offsets),
    ``meta`` (the trapetum metadata), ``config``, ``layers``, ``dense``, ``checksums``, ``tokenizer``, ``recipe``,
    ``provenance``, ``generation``, ``sparsity``, ``header_bytes`` and ``file_bytes``. Opening checks everything
    (``FormatError`` otherwise); the file stays open (``cbk.CbkFile`` maps its tensors from it) until ``close()``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._f = None
        try:
            self._f = open(self.path, "rb")  # kept open: CbkFile maps its tensors from this very file
            self.file_bytes = os.fstat(self._f.fileno()).st_size
            self._read_header(self._f)
        except BaseException as e:
            if self._f is not None:
                self._f.close()
            if isinstance(e, FileNotFoundError):
                self._fail("no such file")
            if isinstance(e, IsADirectoryError):
                self._fail("is a directory, not a .cbk file")
            if isinstance(e, OSError):
                self._fail(f"cannot read ({one_line(e.strerror or e, 80)})")
            raise

    def _fail(self, msg: str) -> None:
        raise FormatError(f"{self.path}: {msg}")

    # -- validation ------------------------------------------------------------------------------
    def _read_header(self, f) -> None:
        fail = self._fail
        size = self.file_bytes
        head = f.read(16)
        if size < 8:
            fail(f"file is {size} bytes, too short for a .cbk header (truncated?)")
        (n,) = struct.unpack("<Q", head[:8])
        f.seek(8)
        if not 0 < n <= min(size - 8, MAX_HEADER_BYTES):  # a size no .cbk has: another format?
            foreign = _foreign_format(head)
            if foreign:
                fail(f"not a .cbk file: {foreign}")
            if head[8:9] not in (b"{", b""):
                fail("not a .cbk file (it does not start with a safetensors header: an 8-byte length, then '{')")
        if n == 0:
            fail("header size is 0")
        if n > size - 8:
            fail(f"header size {n} is larger than the rest of the file ({size - 8} bytes; truncated?)")
        if n > MAX_HEADER_BYTES:
            fail(f"header size {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
        raw = f.read(n)
        if len(raw) != n:
            fail("file ended inside the header")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            fail(f"header is not UTF-8 (byte {e.start})")
        if not text.startswith("{"):
            fail("header is not a JSON object")
        header = _parse_json(text, "header", fail)
        if not isinstance(header, dict):
            fail("header is not a JSON object")
        self.header_bytes = 8 + n
        self._read_table(header, size - 8 - n)
        self._read_metadata(header.get("__metadata__"))

    def _read_table(self, header: dict, data_len: int) -> None:
        fail = self._fail
        entries: dict[str, StoredTensor] = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            what = f"tensor {one_line(repr(name), 80)}"
            if not name:
                fail("a tensor has an empty name")
            if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
                fail(f"{what}: entry must be an object with exactly dtype, shape and data_offsets")
            dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
            if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
                fail(f"{what}: unknown dtype {one_line(repr(dtype), 40)}")
            if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) for d in shape):
                fail(f"{what}: shape must be a list of at most {MAX_DIMS} integers")
            count = 1
            for d in shape:
                if d < 0:
                    fail(f"{what}: negative dimension {d} in shape")
                count *= d
                if count > MAX_ELEMENTS:
                    fail(f"{what}: shape {one_line(shape, 60)} has too many elements")
            if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs):
                fail(f"{what}: data_offsets must be two integers")
            begin, end = offs
            if not 0 <= begin <= end:
                fail(f"{what}: data_offsets [{one_line(begin, 30)}, {one_line(end, 30)}] are not an "
                     f"increasing pair of non-negative offsets")
            if end > data_len:
                fail(f"{what}: data_offsets end {one_line(end, 30)} is past the end of the data "
                     f"({data_len} bytes; truncated?)")
            if end - begin != count * itemsize(dtype):
                fail(f"{what}: {dtype} shape {shape} needs {count * itemsize(dtype)} bytes but data_offsets "
                     f"span {end - begin}")
            entries[name] = StoredTensor(name, dtype, tuple(shape), self.header_bytes + begin, self.header_bytes + end)
        pos = self.header_bytes
        for t in sorted(entries.values(), key=lambda t: (t.begin, t.end)):
            if t.begin < pos:
                fail(f"tensor {one_line(repr(t.name), 80)} overlaps the previous tensor")
            if t.begin > pos:
                fail(f"gap of {t.begin - pos} bytes before tensor {one_line(repr(t.name), 80)}")
            pos = t.end
        if pos != self.file_bytes:
            fail(f"{self.file_bytes - pos} bytes after the last tensor (tensors must cover the data exactly)")
        self.tensors_table = entries

    def _read_metadata(self, md: Any) -> None:
        fail = self._fail
        if md is None:
            fail("not a .cbk file: safetensors header has no __metadata__ (a plain safetensors file?)")
        if not isinstance(md, dict) or not all(isinstance(v, str) for v in md.values()):
            fail("__metadata__ must be an object of strings")
        if "trapetum" not in md:
            fail("not a .cbk file: safetensors metadata has no 'trapetum' entry")
        meta = _parse_json(md["trapetum"], "trapetum metadata", fail)
        if not isinstance(meta, dict):
            fail("trapetum metadata is not a JSON object")
        if meta.get("format") != FORMAT_NAME:
            fail(f"format is {one_line(repr(meta.get('format')), 40)}, expected {FORMAT_NAME!r}")
        version = meta.get("version")
        if not _is_int(version):
            fail(f"version is {one_line(repr(version), 40)}, expected an integer")
        if version not in READ_VERSIONS:
            raise FormatError(f"{self.path} has .cbk version {version}; this build reads {versions_text()}")
        table = {n: (t.dtype, t.shape, t.begin - self.header_bytes, t.end - self.header_bytes)
                 for n, t in self.tensors_table.items()}
        want = md.get("trapetum_sha256")  # the older form (with offsets) only when the current one differs
        if want != header_digest(md["trapetum"], table) and want != header_digest(md["trapetum"], table,
                                                                                  with_offsets=True):
            fail("metadata checksum mismatch: the header was edited or is corrupt")
        for key in ("config", "layers", "dense", "checksums"):
            if key not in meta:
                fail(f"trapetum metadata has no {key!r}")
        for key in ("tokenizer", "recipe", "provenance", "generation"):
            if meta.get(key) is not None and not isinstance(meta[key], dict):
                fail(f"{key} must be an object or null")
        for key, check in (("tokenizer", check_tokenizer), ("recipe", check_recipe),
                           ("provenance", check_provenance), ("generation", check_generation)):
            if meta.get(key) is not None:
                check(meta[key], fail)
        self.meta = meta
        # config
        if not isinstance(meta["config"], dict):
            fail("config is not an object")
        layers_n = meta["config"].get("num_layers")
        if _is_int(layers_n) and layers_n > len(self.tensors_table):  # before ModelConfig sizes lists by it
            fail(f"config has {layers_n} layers but the file stores only {len(self.tensors_table)} tensors")
        try:
            self.config = ModelConfig.from_dict(meta["config"], where="config")
        except Exception as e:  # ConfigError, or a TypeError from a field of the wrong type
            text = one_line(e, 200)
            fail(f"invalid {text}" if text.startswith("config: ") else f"invalid config: {text}")
        # layers and dense
        layers: dict[str, LayerEntry] = {}
        if not isinstance(meta["layers"], dict):
            fail("layers is not an object")
        for name, d in meta["layers"].items():
            what = f"quantized layer {one_line(repr(name), 80)}"
            if not isinstance(d, dict) or not {"scheme", "shape", "params", "tensors"} <= set(d):
                fail(f"{what}: entry must be an object with scheme, shape, params, tensors")
            if not isinstance(d["scheme"], str) or not d["scheme"]:
                fail(f"{what}: scheme must be a non-empty string")
            if not isinstance(d["shape"], list) or len(d["shape"]) != 2 or not all(_is_int(x) for x in d["shape"]):
                fail(f"{what}: shape must be two integers")
            if not isinstance(d["params"], dict):
                fail(f"{what}: params must be an object")
            if not isinstance(d["tensors"], dict) or not all(isinstance(v, str) for v in d["tensors"].values()):
                fail(f"{what}: tensors must map roles to stored tensor names")
            if d.get("bias") is not None and not isinstance(d["bias"], str):
                fail(f"{what}: bias must be a stored tensor name or null")
            layers[name] = LayerEntry(name, d["scheme"], tuple(d["shape"]), d["params"], dict(d["tensors"]),
                                      d.get("bias"))
        dense = meta["dense"]
        if not isinstance(dense, list) or not all(isinstance(n, str) for n in dense):
            fail("dense is not a list of tensor names")
        if version < file_version(meta["layers"]):
            fail(f"version is {version}, but a layer stores its codebook compactly (needs version {VERSION})")
        specs = {n: TensorSpec(t.dtype, t.shape) for n, t in self.tensors_table.items()}
        check_model(self.config, layers, dense, specs, fail)
        self.layers, self.dense = layers, list(dense)
        # checksums
        if meta.get("checksum") != "sha256":
            fail(f"checksum algorithm is {one_line(repr(meta.get('checksum')), 40)}, expected 'sha256'")
        sums = meta["checksums"]
        if not isinstance(sums, dict):
            fail("checksums is not an object")
        for n in self.tensors_table:
            if n not in sums:
                fail(f"no checksum for tensor {one_line(repr(n), 80)}")
            if not isinstance(sums[n], str) or not HEX64.fullmatch(sums[n]):
                fail(f"checksum of tensor {one_line(repr(n), 80)} is not a sha256 hex digest")
        extra = [n for n in sums if n not in self.tensors_table]
        if extra:
            fail(f"checksum listed for tensor {one_line(repr(extra[0]), 80)}, which is not in the file")
        self.checksums = dict(sums)
        # tokenizer
        self.tokenizer = None
        tk = meta.get("tokenizer")
        if tk is not None:
            try:
                self.tokenizer = Tokenizer.from_dict(tk, source=str(self.path))
            except Exception as e:  # tokenizers raises plain Exception on a bad tokenizer.json
                fail(f"tokenizer does not load: {one_line(e, 160)}")
        self.recipe = meta.get("recipe")
        self.provenance = meta.get("provenance")
        self.generation = meta.get("generation") or {}
        # activation sparsity (optional, versioned; models/sparsity.py)
        self.sparsity = None if meta.get("sparsity") is None else check_sparsity(
            meta["sparsity"], self.config.num_layers, fail)

    # -- what needs no tensor ------------------------------------------------------------------
    def description(self) -> Checkpoint:
        """The Checkpoint that ``cbk.CbkFile.to_checkpoint`` returns, less the tensors: config, tokenizer,
        generation, meta and every tensor's storage format and logical shape (``tensors.formats`` / ``.shapes``),
        but ``tensors`` maps no name (reading one needs torch: ``open_cbk(path).to_checkpoint()``). What
        ``describe`` and ``trapetum info`` need."""
        return self._checkpoint({})

    def _checkpoint(self, getters: dict[str, Callable[[], Any]]) -> Checkpoint:
        formats: dict[str, str] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for name in self.dense:
            formats[name] = self.tensors_table[name].dtype
            shapes[name] = self.tensors_table[name].shape
        for name, layer in self.layers.items():
            formats[name] = format_label(layer.scheme, layer.params)
            shapes[name] = tuple(layer.shape)
        meta = {"cbk_version": VERSION, "recipe": self.recipe, "provenance": self.provenance,
                "sizes": self.size_breakdown(), "sparsity": self.sparsity}
        if self.meta.get("sparsity") is not None and self.sparsity is None:
            meta["sparsity_version"] = self.meta["sparsity"]["version"]  # a section this build does not read
        return Checkpoint(config=self.config, tensors=LazyTensors(getters, formats, shapes),
                          tokenizer=self.tokenizer, source=str(self.path), source_format="cbk",
                          generation=dict(self.generation), meta=meta)

    def verify_checksums(self) -> list[str]:
        """Recompute every tensor's sha256 against the recorded one (and that the file kept its size); one line
        per problem, tensors named with their owner (``dense NAME``, ``ROLE of LAYER``)."""
        problems = []
        try:
            if os.stat(self.path).st_size != self.file_bytes:
                problems.append(f"{self.path}: file size changed since it was opened")
        except OSError as e:
            problems.append(f"{self.path}: cannot stat ({e.strerror})")
        owners = {n: f"dense {n}" for n in self.dense}
        for layer in self.layers.values():
            owners.update({s: f"{role} of {layer.name}" for role, s in layer.tensors.items()})
            if layer.bias is not None:
                owners[layer.bias] = f"bias of {layer.name}"
        with mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as mv:
            for t in sorted(self.tensors_table.values(), key=lambda t: t.begin):
                h = hashlib.sha256()
                for i in range(t.begin, t.end, IO_CHUNK):
                    with mv[i:min(i + IO_CHUNK, t.end)] as part:
                        h.update(part)
                if h.hexdigest() != self.checksums[t.name]:
                    problems.append(f"{self.path}: tensor {t.name} ({owners.get(t.name, '?')}) checksum mismatch: "
                                    f"recorded {self.checksums[t.name][:16]}..., computed {h.hexdigest()[:16]}...")
        return problems

    def size_breakdown(self) -> dict[str, Any]:
        """Bytes and bits per weight by tensor kind (everything a layer stores, codebooks included).

        Returns {"kinds": {kind: {"tensors", "bytes", "weights", "bits_per_weight", "formats": {label: n}}},
        "tensor_bytes", "header_bytes", "file_bytes", "weights", "bits_per_weight", "file_bits_per_weight"}
        with kind one of attention, mlp, embedding, lm_head, norms, other. "weights" counts logical
        elements (biases included); bits_per_weight = 8 * bytes / weights.
        """
        kinds: dict[str, dict[str, Any]] = {}

        def add(name: str, nbytes: int, weights: int, label: str) -> None:
            k = kinds.setdefault(tensor_kind(name), {"tensors": 0, "bytes": 0, "weights": 0, "formats": {}})
            k["tensors"] += 1
            k["bytes"] += nbytes
            k["weights"] += weights
            k["formats"][label] = k["formats"].get(label, 0) + 1

        for name in self.dense:
            t = self.tensors_table[name]
            add(name, t.end - t.begin, math.prod(t.shape), t.dtype)
        for name, layer in self.layers.items():
            stored = list(layer.tensors.values()) + ([layer.bias] if layer.bias else [])
            nbytes = sum(self.tensors_table[s].end - self.tensors_table[s].begin for s in stored)
            bias = math.prod(self.tensors_table[layer.bias].shape) if layer.bias else 0
            add(name, nbytes, math.prod(layer.shape) + bias, format_label(layer.scheme, layer.params))
        for k in kinds.values():
            k["bits_per_weight"] = 8 * k["bytes"] / k["weights"] if k["weights"] else 0.0
        tensor_bytes = sum(k["bytes"] for k in kinds.values())
        weights = sum(k["weights"] for k in kinds.values())
        order = ["attention", "mlp", "embedding", "lm_head", "norms", "other"]
        return {"kinds": {k: kinds[k] for k in order if k in kinds}, "tensor_bytes": tensor_bytes,
                "header_bytes": self.header_bytes, "file_bytes": self.file_bytes, "weights": weights,
                "bits_per_weight": 8 * tensor_bytes / weights if weights else 0.0,
                "file_bits_per_weight": 8 * self.file_bytes / weights if weights else 0.0}

    def close(self) -> None:
        """Close the file; tensors already read (``CbkFile``) stay valid (each holds its own map)."""
        self._f.close()

    def __del__(self) -> None:
        f = getattr(self, "_f", None)
        if f is not None:
            f.close()

    def __enter__(self) -> "CbkHeader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def tensor_kind(name: str) -> str:
    """attention | mlp | embedding | lm_head | norms | other, from a canonical tensor name."""
    if "embed_tokens" in name:
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if "norm" in name.rsplit(".", 2)[-2]:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    return "other"


