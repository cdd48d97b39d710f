"""The ``.cbk`` file: specification, writer and reader (see also docs/CBK.md).

Specification, versions 1 and 2
-------------------------------
A ``.cbk`` file is a valid safetensors file (any safetensors reader can list and load its tensors)::

    [8 bytes]  N: little-endian unsigned 64-bit length of the header
    [N bytes]  header: UTF-8 JSON object, padded with spaces so that 8 + N is a multiple of 8
    [the rest] data: every tensor's bytes, back to back, no gaps, no trailing bytes

The header maps each *stored* tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the first data byte; little-endian, row-major) and holds
``"__metadata__"``, a string -> string map with two Trapetum keys:

``trapetum``
    JSON text of the Trapetum metadata::

        {"format": "trapetum-cbk", "version": 1,
         "config": ModelConfig.to_dict(),
         "tokenizer": Tokenizer.to_dict() or null,
         "generation": {default sampling settings} or null,
         "layers": {canonical weight name: {"scheme": str, "shape": [out, in], "params": {...},
                                            "tensors": {role: stored name}, "bias": stored name or null}},
         "dense": [canonical names stored as plain tensors under the same name],
         "recipe": {...} or null,
         "provenance": {"source", "source_sha256", "tool_version", "created", ...} or null,
         "checksum": "sha256",
         "checksums": {stored name: hex sha256 of its bytes}}

``trapetum_sha256``
    hex sha256 of ``json.dumps([trapetum_text, rows], separators=(",", ":"))`` where ``rows`` is
    ``[[name, dtype, shape], ...]`` for every stored tensor, sorted by name. It guards the metadata
    and the tensor table (a flipped dtype or shape would pass the byte checksums); offsets are left
    out so that a safetensors tool may rewrite the file with the tensors in another order.

The writer stores a quantized projection ``P.weight`` as ``P.<role>`` (``P.codes``,
``P.codebook``, ...) and its bias as ``P.bias``; readers follow the ``layers`` map, not the names.
Tensors are laid out by descending element size so every tensor is aligned to its element size
(a reader copies a misaligned tensor instead of mapping it).

Version 2 differs in one point: a codebook layer may store its centroids compactly (``params["codebook"]``
"u8" or "shared", schemes/codebook_store.py; decoded to the fp16 [out, K] codebook at load). Writers write
version 1 unless a layer needs 2, and a version-1 file with a compact codebook is refused.

Readers refuse another ``version`` with "<file> has .cbk version X; this build reads versions 1 and 2",
ignore unknown top-level metadata keys (a change an older reader must not ignore bumps the version),
and validate everything before use: header size against the file size, JSON (no duplicate keys,
no NaN), dtypes, shapes, offsets (in range, contiguous, covering the data exactly), the metadata
hash, the config, every tensor's shape against ``expected_shapes(config)``, that every tensor the
config needs is present and every stored tensor is referenced once. Every failure is a
``FormatError`` whose one-line message names the file and the problem. Tensors are then read
lazily from a copy-on-write memory map (no pickle, nothing allocated from a declared size).

The reader is two layers: ``cbk_header.CbkHeader`` parses and validates the header, the table and the metadata
without torch (what ``trapetum info`` and the checksums need), and ``CbkFile`` here adds the tensors as torch
tensors.
"""
from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import FormatError
from ..models.checkpoint import Checkpoint
from ..schemes.record import QuantRecord
from .cbk_header import CbkHeader, tensor_kind  # noqa: F401  (tensor_kind: re-exported)
from .cbk_spec import DTYPE_SIZES, IO_CHUNK, TORCH_DTYPES, itemsize, one_line
from .cbk_spec import FLOAT_DTYPES, QuantSpec, TensorSpec  # noqa: F401  (re-exported: the format's public names)
from .cbk_write import CbkWriter, write_cbk  # noqa: F401  (the writer is part of this module's API)

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, TORCH_DTYPES[name]) for name in DTYPE_SIZES}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class CbkFile(CbkHeader):
    """A validated, memory-mapped ``.cbk`` file: the header as ``CbkHeader`` reads and checks it (``FormatError``
    otherwise), and its tensors as torch tensors. ``verify()`` also recomputes every checksum and checks the
    contents. Tensors are views of a copy-on-write map of the file: writing to one never changes the file."""

    # -- access ----------------------------------------------------------------------------------
    def tensor(self, stored: str) -> torch.Tensor:
        """The stored tensor ``stored`` as a CPU tensor over its own copy-on-write map of the file:
        pages are read on first touch, and writing to the tensor changes neither the file nor any
        other tensor (each call maps afresh)."""
        t = self.tensors_table[stored]
        dtype = DTYPES[t.dtype]
        count = (t.end - t.begin) // itemsize(t.dtype)
        if count == 0:
            return torch.empty(t.shape, dtype=dtype)
        start = t.begin - t.begin % mmap.ALLOCATIONGRANULARITY
        try:
            mm = mmap.mmap(self._f.fileno(), t.end - start, access=mmap.ACCESS_COPY, offset=start)
        except (ValueError, OSError) as e:
            self._fail(f"cannot map tensor {stored} (file changed since it was opened? {one_line(e, 80)})")
        if t.begin % itemsize(t.dtype):  # misaligned (a foreign writer): copy the bytes
            return torch.frombuffer(bytearray(mm[t.begin - start:]), dtype=dtype).reshape(t.shape)
        return torch.frombuffer(mm, dtype=dtype, count=count, offset=t.begin - start).reshape(t.shape)

    def record(self, name: str) -> QuantRecord:
        """The quantized projection ``name`` (a canonical weight name) as a QuantRecord."""
        layer = self.layers[name]
        return QuantRecord(layer.scheme, tuple(layer.shape), dict(layer.params),
                           {role: self.tensor(s) for role, s in layer.tensors.items()},
                           self.tensor(layer.bias) if layer.bias is not None else None)

    def to_checkpoint(self) -> Checkpoint:
        """A Checkpoint whose tensors (dense tensors and QuantRecords) are read on access (``description()`` with
        the tensors)."""
        getters: dict[str, Callable[[], Any]] = {n: (lambda n=n: self.tensor(n)) for n in self.dense}
        getters.update({n: (lambda n=n: self.record(n)) for n in self.layers})
        return self._checkpoint(getters)

    def verify(self) -> list[str]:
        """Recompute every tensor's sha256 (``verify_checksums``), then check the contents a load would refuse
        (``check_contents``); one line per problem (empty list: the file is intact)."""
        return self.verify_checksums() or self.check_contents()

    def check_contents(self) -> list[str]:
        """What a load would refuse after the checksums match: each quantized layer through its scheme's check
        (params, tensor dtypes and shapes, finite codebooks), and dense float tensors finite."""
        from ..schemes.registry import SCHEMES, scheme_of

        problems = []
        for name, layer in self.layers.items():
            if layer.scheme not in SCHEMES or layer.scheme == "dense":
                continue        # a scheme this build does not read: refused by name at load, not corrupt
            try:
                rec = self.record(name)
                scheme_of(rec).check(rec, name)
            except FormatError as e:
                problems.append(f"{self.path}: {one_line(e, 200)}")
            except Exception as e:  # noqa: BLE001 -- a scheme's check that trips on odd params is a problem too
                problems.append(f"{self.path}: quantized layer {name} is malformed ({type(e).__name__}: "
                                f"{one_line(e, 120)})")
        for name in self.dense:
            t = self.tensor(name).reshape(-1)
            if t.is_floating_point() and not all(bool(torch.isfinite(t[i:i + IO_CHUNK]).all())
                                                 for i in range(0, t.numel(), IO_CHUNK)):
                problems.append(f"{self.path}: dense tensor {name} holds NaN or infinite values")
        return problems



def open_cbk(path: str | os.PathLike) -> CbkFile:
    """Open and validate a ``.cbk`` file (FormatError if anything is wrong)."""
    return CbkFile(path)


def load_cbk(path: str | os.PathLike) -> Checkpoint:
    """Open a ``.cbk`` file as a lazily read Checkpoint."""
    return CbkFile(path).to_checkpoint()


def size_breakdown(cbk: CbkFile | str | os.PathLike) -> dict[str, Any]:
    """Size breakdown for ``trapetum info`` (see ``CbkFile.size_breakdown``)."""
    return (cbk if isinstance(cbk, CbkFile) else CbkFile(cbk)).size_breakdown()


def verify_cbk(path: str | os.PathLike) -> tuple[CbkFile | None, list[str]]:
    """Open and verify; returns (file or None, problems). An unreadable file is one problem."""
    try:
        f = CbkFile(path)
    except FormatError as e:
        return None, [str(e)]
    return f, f.verify()


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, or of a directory's regular files (relative name and bytes, sorted)."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
    outer = hashlib.sha256()
    for q in files:
        h = hashlib.sha256()
        with open(q, "rb") as f:
            while chunk := f.read(IO_CHUNK):
                h.update(chunk)
        if p.is_file():
            return h.hexdigest()
        outer.update(f"{q.relative_to(p).as_posix()}\0{h.hexdigest()}\n".encode())
    return outer.hexdigest()
