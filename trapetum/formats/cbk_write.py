"""Writer of .cbk files: streams tensors to a temp file, then fsync and rename (atomic).
Format: see trapetum/formats/cbk.py."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from .._version import __version__
from ..errors import TrapetumError
from ..models.config import ModelConfig
from ..schemes.record import QuantRecord
from ..tokenizer import Tokenizer
from .cbk_spec import (
    IO_CHUNK, DTYPE_SIZES, FORMAT_NAME, MAX_DIMS, MAX_HEADER_BYTES, LayerEntry, QuantSpec, TensorSpec, check_model, file_version,
    header_digest, itemsize, one_line)

_MOVE_CHUNK = 16 * 2**20  # bytes per step when commit moves the data to grow the header
SPACE_MARGIN = 16 << 20  # free bytes asked for beyond a planned file (header growth, the filesystem's own)


def check_output_path(path: str | os.PathLike, nbytes: int | None = None, *, flag: str | None = None) -> Path:
    """Before a long job that ends in writing ``path``: that a file can be created there and that the
    filesystem has room for ``nbytes`` (plus ``SPACE_MARGIN``). The directory must exist and take a new file
    (checked by creating and removing an empty one, which also catches read-only mounts and ACLs); ``path``
    must not be a directory. A one-line TrapetumError naming ``flag`` (e.g. "-o") and the path otherwise."""
    p = Path(path)
    what = f"{flag} {p}" if flag else f"cannot write {p}"
    if p.is_dir():
        raise TrapetumError(f"{what}: is a directory; give a file name (e.g. {p / 'model.cbk'})")
    d = p.parent
    if not d.exists():
        raise TrapetumError(f"{what}: the directory {d} does not exist")
    if not d.is_dir():
        raise TrapetumError(f"{what}: {d} is not a directory")
    probe = d / f".{p.name[:200]}.{os.getpid()}.{os.urandom(4).hex()}.probe"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise TrapetumError(f"{what}: cannot create a file in {d} ({one_line(e.strerror or e, 80)})") from None
    if nbytes is not None:
        try:
            free = shutil.disk_usage(d).free
        except OSError:
            return p
        if free < nbytes + SPACE_MARGIN:
            raise TrapetumError(f"{what}: the file will be about {nbytes / 1e6:,.0f} MB and {d} has "
                                f"{free / 1e6:,.0f} MB free")
    return p


# ---------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------
class CbkWriter:
    """Streams a ``.cbk`` file to disk atomically, one tensor at a time.

    Declare every tensor first (``declare_dense`` / ``declare_quantized``: dtype and shape only),
    then ``put_dense`` / ``put_quantized`` each in any order, then ``commit()``. Bytes go straight
    to a temporary file in the target's directory while their sha256 is computed; ``commit``
    rewrites the header with the checksums (same length as the placeholder), fsyncs, renames over
    the target and fsyncs the directory. Any failure (or ``abort()``, or leaving the ``with`` block
    by an exception) removes the temporary file and leaves the target untouched. Memory use is one
    tensor, so a file bigger than RAM can be written from a source that is read lazily.

    Metadata known only at the end (a quantizer's per-layer errors, its duration) is set with
    ``update(recipe=..., provenance=..., generation=...)`` at any time before ``commit()``. The
    header's length is fixed when the first tensor is written: ``reserve_bytes`` keeps that many
    spare bytes in it (the final header is padded with spaces, which JSON and safetensors readers
    skip). A final header that outgrows the reservation is not an error: ``commit`` moves the data
    further into the temporary file to make room (no second copy on disk, still atomic, but it
    rewrites every data byte once; ``header_moved_bytes`` records it), so size the reservation
    generously (e.g. ~120 bytes per layer whose error will be logged, plus 64 KiB).
    """

    def __init__(self, path: str | os.PathLike, *, config: ModelConfig, tokenizer: Tokenizer | None = None,
                 recipe: dict | None = None, provenance: dict | None = None, generation: dict | None = None,
                 reserve_bytes: int = 0, sparsity: dict | None = None):
        self.path = Path(path)
        self.config = config
        if not isinstance(reserve_bytes, int) or reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be a non-negative integer, got {reserve_bytes!r}")
        self.reserve_bytes = reserve_bytes
        self.header_moved_bytes = 0  # data bytes moved by commit because the header outgrew its room
        self._created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        prov = {"tool_version": __version__, "created": self._created, **(provenance or {})}
        self.meta: dict[str, Any] = {  # JSON copies: later changes to the arguments cannot reach the file
            "format": FORMAT_NAME, "version": 1, "config": self._plain(config.to_dict(), "config"),
            "tokenizer": self._plain(tokenizer.to_dict(), "tokenizer") if tokenizer is not None else None,
            "generation": self._plain(generation, "generation") if generation else None,
            "layers": {}, "dense": [], "recipe": self._plain(recipe, "recipe") if recipe is not None else None,
            "provenance": self._plain(prov, "provenance"), "checksum": "sha256", "checksums": {}}
        if sparsity is not None:  # activation sparsity (models/sparsity.py: SparsityTable.to_dict())
            self.meta["sparsity"] = self._plain(sparsity, "sparsity")
        self.specs: dict[str, TensorSpec] = {}  # stored name -> spec, in declaration order
        self._layers: dict[str, LayerEntry] = {}
        self._rel: dict[str, tuple[int, int]] = {}  # stored name -> [begin, end) within the data
        self._offsets: dict[str, tuple[int, int]] = {}  # stored name -> absolute [begin, end)
        self._digests: dict[str, str] = {}
        self._file = None
        self._tmp: Path | None = None
        self._header_len = 0
        self._done = False
        self._committed = False

    def _plain(self, x: Any, what: str) -> Any:
        try:
            return json.loads(json.dumps(x, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ValueError(f"cannot write {self.path}: {what} is not plain JSON ({one_line(e, 120)})") from None

    def update(self, *, recipe: dict | None = None, provenance: dict | None = None,
               generation: dict | None = None) -> None:
        """Replace the recipe, provenance or generation settings (only those given) before ``commit``.
        ``provenance`` keeps ``tool_version`` and ``created`` unless it sets them itself."""
        if self._done:
            raise ValueError("writer is already committed or aborted")
        if recipe is not None:
            self.meta["recipe"] = self._plain(recipe, "recipe")
        if provenance is not None:
            prov = {"tool_version": __version__, "created": self._created, **provenance}
            self.meta["provenance"] = self._plain(prov, "provenance")
        if generation is not None:
            self.meta["generation"] = self._plain(generation, "generation") if generation else None

    # -- declarations --------------------------------------------------------------------------
    def _add(self, stored: str, spec: TensorSpec) -> None:
        if self._file is not None:
            raise ValueError("declare every tensor before the first put")
        if stored in self.specs:
            raise ValueError(f"tensor name {stored!r} is declared twice")
        if spec.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {spec.dtype!r} for {stored!r}")
        if not stored or stored == "__metadata__":
            raise ValueError(f"bad tensor name {stored!r}")
        shape = tuple(int(d) for d in spec.shape)
        if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
            raise ValueError(f"bad shape {list(shape)} for {stored!r}")
        self.specs[stored] = TensorSpec(spec.dtype, shape)

    def declare_dense(self, name: str, spec: TensorSpec) -> None:
        self._add(name, spec)
        self.meta["dense"].append(name)

    def declare_quantized(self, name: str, spec: QuantSpec) -> None:
        if not name.endswith(".weight"):
            raise ValueError(f"quantized layer name {name!r} must end with '.weight'")
        prefix = name[:-len(".weight")]
        roles = {}
        for role, ts in spec.tensors.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", role) or role in ("weight", "bias"):
                raise ValueError(f"bad tensor role {role!r} for {name!r}")
            self._add(f"{prefix}.{role}", ts)
            roles[role] = f"{prefix}.{role}"
        bias = None
        if spec.bias is not None:
            bias = f"{prefix}.bias"
            self._add(bias, spec.bias)
        shape = tuple(int(d) for d in spec.shape)
        params = self._plain(spec.params, f"params of {name}")
        self._layers[name] = LayerEntry(name, spec.scheme, shape, params, roles, bias)
        self.meta["layers"][name] = {"scheme": spec.scheme, "shape": list(shape), "params": params,
                                     "tensors": roles, "bias": bias}
        self.meta["version"] = file_version(self.meta["layers"])

    # -- writing -------------------------------------------------------------------------------
    def _header(self, length: int | None = None) -> bytes:
        """The header JSON padded with spaces to a multiple of 8, or to ``length`` when it fits."""
        table, rel = {}, {}
        for n, (b, e) in self._rel.items():  # offsets relative to the data: independent of the header
            s = self.specs[n]
            table[n] = (s.dtype, s.shape, b, e)
            rel[n] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [b, e]}
        self.meta["checksums"] = {n: self._digests.get(n, "0" * 64) for n in self._rel}
        text = json.dumps(self.meta, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        header = {"__metadata__": {"trapetum": text, "trapetum_sha256": header_digest(text, table)}, **rel}
        raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        if length is not None and len(raw) <= length:
            return raw + b" " * (length - len(raw))
        return raw + b" " * (-len(raw) % 8)

    def _begin(self) -> None:
        self.config.validate(f"cannot write {self.path}: config")

        def fail(msg: str) -> None:
            raise ValueError(f"cannot write {self.path}: {msg}")
        check_model(self.config, self._layers, self.meta["dense"], self.specs, fail)
        # Layout: descending element size keeps every tensor aligned to its element size.
        order = sorted(self.specs, key=lambda n: -itemsize(self.specs[n].dtype))
        pos = 0
        for n in order:
            self._rel[n] = (pos, pos + self.specs[n].nbytes)
            pos += self.specs[n].nbytes
        self._header_len = len(self._header())  # placeholder digests have the final length
        if self._header_len > MAX_HEADER_BYTES:
            fail(f"header would be {self._header_len} bytes, over the {MAX_HEADER_BYTES}-byte limit")
        if self.reserve_bytes:  # room for update(); a multiple of 8 keeps the data aligned
            room = self._header_len + self.reserve_bytes
            self._header_len = min(room + (-room % 8), MAX_HEADER_BYTES)
        start = 8 + self._header_len
        self._offsets = {n: (start + b, start + e) for n, (b, e) in self._rel.items()}
        directory = self.path.parent
        name = f".{self.path.name[:200]}.{os.getpid()}.{os.urandom(4).hex()}.tmp"  # within NAME_MAX
        self._tmp = directory / name
        self._file = open(self._tmp, "x+b")  # read too: commit may move the data (_move_data)

    def _put(self, stored: str, t: torch.Tensor) -> None:
        if self._done:
            raise ValueError("writer is already committed or aborted")
        if stored not in self.specs:
            raise ValueError(f"tensor {stored!r} was not declared")
        if stored in self._digests:
            raise ValueError(f"tensor {stored!r} is written twice")
        got = TensorSpec.of(t)
        if got != self.specs[stored]:
            raise ValueError(f"tensor {stored!r} is {got.dtype} {list(got.shape)}, declared "
                             f"{self.specs[stored].dtype} {list(self.specs[stored].shape)}")
        if self._file is None:
            self._begin()
        flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        h = hashlib.sha256()
        self._file.seek(self._offsets[stored][0])
        with memoryview(flat) as mv:
            for i in range(0, len(mv), IO_CHUNK):
                h.update(mv[i:i + IO_CHUNK])
                self._file.write(mv[i:i + IO_CHUNK])
        self._digests[stored] = h.hexdigest()

    def put_dense(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.meta["dense"]:
            raise ValueError(f"{name!r} was not declared dense")
        self._put(name, tensor)

    def put_quantized(self, name: str, record: QuantRecord) -> None:
        layer = self._layers.get(name)
        if layer is None:
            raise ValueError(f"{name!r} was not declared quantized")
        if (record.scheme, tuple(record.shape)) != (layer.scheme, layer.shape) or set(record.tensors) != set(layer.tensors):
            raise ValueError(f"record for {name!r} does not match its declaration")
        if (record.bias is None) != (layer.bias is None):
            raise ValueError(f"record for {name!r}: bias presence does not match its declaration")
        for role, t in record.tensors.items():
            self._put(layer.tensors[role], t)
        if record.bias is not None:
            self._put(layer.bias, record.bias)

    def commit(self) -> Path:
        """Finish the file and move it into place; returns the path."""
        if self._done:
            raise ValueError("writer is already committed or aborted")
        try:
            if self._file is None:
                self._begin()
            missing = [n for n in self.specs if n not in self._digests]
            if missing:
                raise ValueError(f"cannot write {self.path}: tensor {missing[0]!r} was declared but not written")
            header = self._header(self._header_len)
            if len(header) > MAX_HEADER_BYTES:
                raise ValueError(f"cannot write {self.path}: header would be {len(header)} bytes, over the "
                                 f"{MAX_HEADER_BYTES}-byte limit")
            if len(header) != self._header_len:  # update() outgrew the reserved room: make more
                self._move_data(len(header))
            self._file.seek(0)
            self._file.write(struct.pack("<Q", len(header)) + header)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.path)
            self._committed = self._done = True
        except BaseException:
            self.abort()
            raise
        try:
            fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass  # some filesystems cannot fsync a directory; the rename itself is atomic
        return self.path

    def _move_data(self, header_len: int) -> None:
        """Move the data section so that it starts after a header of ``header_len`` bytes.

        Copies chunks from the end backwards (the destination is further on, so a chunk is never
        overwritten before it is read): no second file, one chunk of memory. The checksums are of
        the bytes, which do not change; offsets in the header are relative to the data.
        """
        delta = header_len - self._header_len
        if delta < 0 or delta % 8:
            raise RuntimeError(f"cannot write {self.path}: bad header growth {delta}")
        self._file.flush()
        fd = self._file.fileno()
        start = 8 + self._header_len
        end = start + sum(s.nbytes for s in self.specs.values())
        pos = end
        while pos > start:
            n = min(_MOVE_CHUNK, pos - start)
            pos -= n
            buf = os.pread(fd, n, pos)
            if len(buf) != n:
                raise OSError(f"cannot write {self.path}: short read while moving the data")
            view = memoryview(buf)
            while view:
                k = os.pwrite(fd, view, pos + delta + (n - len(view)))
                view = view[k:]
        self.header_moved_bytes += end - start
        self._header_len = header_len
        self._offsets = {n: (b + delta, e + delta) for n, (b, e) in self._offsets.items()}

    def abort(self) -> None:
        """Drop the temporary file; the target path is left as it was."""
        self._done = True
        if self._file is not None and not self._file.closed:
            self._file.close()
        if self._tmp is not None and not self._committed:
            try:
                self._tmp.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> "CbkWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        elif not self._done:
            self.abort()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.abort()


def write_cbk(path: str | os.PathLike, *, config: ModelConfig, dense: Mapping[str, torch.Tensor],
              quantized: Mapping[str, QuantRecord], tokenizer: Tokenizer | None = None, recipe: dict | None = None,
              provenance: dict | None = None, generation: dict | None = None, sparsity: dict | None = None) -> Path:
    """Write a ``.cbk`` file atomically. ``dense``: canonical name -> tensor; ``quantized``: canonical
    weight name -> QuantRecord. Values are read twice (spec, then bytes): for a source that is costly to
    produce (quantized on the fly), use ``CbkWriter`` with the specs declared up front."""
    w = CbkWriter(path, config=config, tokenizer=tokenizer, recipe=recipe, provenance=provenance,
                  generation=generation, sparsity=sparsity)
    try:
        for name, t in dense.items():
            w.declare_dense(name, TensorSpec.of(t))
        for name, r in quantized.items():
            w.declare_quantized(name, QuantSpec.of(r))
        for name, t in dense.items():
            w.put_dense(name, t)
        for name, r in quantized.items():
            w.put_quantized(name, r)
        return w.commit()
    except BaseException:
        w.abort()
        raise


def rewrite_with_sparsity(src: str | os.PathLike, out: str | os.PathLike, sparsity: dict | None) -> Path:
    """Copy the ``.cbk`` file ``src`` to ``out`` (which may be ``src`` itself) with the activation-sparsity section
    set to ``sparsity`` (``SparsityTable.to_dict()``; None removes it), atomically (``CbkWriter``): every tensor's
    bytes, the config, tokenizer, generation, recipe and provenance as they are (unknown top-level metadata keys
    are not carried over). Reads one tensor at a time from the source's memory maps."""
    from .cbk import open_cbk

    f = open_cbk(src)
    try:
        w = CbkWriter(out, config=f.config, tokenizer=f.tokenizer, recipe=f.recipe, provenance=f.provenance,
                      generation=f.generation or None, sparsity=sparsity)
        try:
            for name in f.dense:
                t = f.tensors_table[name]
                w.declare_dense(name, TensorSpec(t.dtype, t.shape))
            for name in f.layers:
                w.declare_quantized(name, QuantSpec.of(f.record(name)))
            for name in f.dense:
                w.put_dense(name, f.tensor(name))
            for name in f.layers:
                w.put_quantized(name, f.record(name))
            return w.commit()
        except BaseException:
            w.abort()
            raise
    finally:
        f.close()
