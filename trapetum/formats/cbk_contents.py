"""``trapetum verify`` without torch where it can: the checksums (``CbkHeader.verify_checksums``), then the contents
a load would refuse, shown with numpy for what ``quantize`` writes.

``contents_pass(header)`` is True only when ``CbkFile.check_contents`` (the torch check: every quantized layer
through its scheme's ``check``, dense float tensors finite) would find nothing:

* codebook layers in every storage (``schemes/codebook_store.py``): ``bits``, the storage and ``group_rows``, the
  tensor roles, their dtypes and shapes, finite values, and a finite decode of a compact codebook. The decode is
  float32 arithmetic rounded to fp16 (overflow past 65519.99 is infinite); it counts as finite here only below
  ``DECODE_MARGIN``, so that a last-bit difference of the float32 arithmetic cannot flip the answer;
* dense tensors (F16, BF16, F32, F64: ``check_model`` allows no other) finite;
* layers of a scheme this build does not read, and "dense" layers: skipped, as the torch check skips them.

False means "not shown" (a problem, a layer of another scheme such as aqlm or rtn, a decode near the fp16 range):
``verify_file`` then runs the torch check, whose messages are the one wording of the problems. So the verdict and
the lines ``trapetum verify`` prints are the torch check's; the numpy half only spares good files the torch import.
"""
from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np

from ..kernels.pack import SUPPORTED_BITS, packed_width
from ..schemes.codebook_storage import ROLES, STORAGES, storage_of
from .cbk_header import CbkHeader
from .cbk_spec import FLOAT_DTYPES, IO_CHUNK, LayerEntry

TORCH_SCHEMES = ("aqlm", "rtn", "ggml")  # checked by the torch check only (with "codebook" and "dense": registry.SCHEMES)
DECODE_MARGIN = 65000.0  # |decoded centroid| below this: finite in fp16 whatever the float32 rounding
_NUMPY = {"U8": np.uint8, "F16": np.float16, "F32": np.float32, "F64": np.float64, "BF16": np.uint16}
_ROWS = 1 << 16  # rows per step of a compact codebook's decode


def verify_file(path: str | os.PathLike) -> tuple[CbkHeader, list[str]]:
    """(header, problems) as ``CbkFile(path).verify()`` gives them: checksums first, then the contents (numpy where
    ``contents_pass`` shows them sound, else the torch check). FormatError when the file does not open."""
    header = CbkHeader(path)
    problems = header.verify_checksums()
    if not problems and not contents_pass(header):
        from .cbk import CbkFile  # torch: only for what the numpy half does not show
        with CbkFile(path) as f:
            problems = f.check_contents()
    return header, problems


def contents_pass(h: CbkHeader) -> bool:
    """True only if ``CbkFile.check_contents`` finds no problem in ``h``'s file (see the module docstring)."""
    with open(h.path, "rb") as f:
        if os.fstat(f.fileno()).st_size != h.file_bytes:
            return False
        # not closed here: the arrays over it hold it (and release it when they go)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return _layers_pass(h, mm) and all(_finite(_array(h, mm, n)) for n in h.dense)


def _layers_pass(h: CbkHeader, mm: mmap.mmap) -> bool:
    for layer in h.layers.values():
        if layer.scheme in TORCH_SCHEMES:
            return False
        if layer.scheme == "codebook" and not _codebook_pass(h, mm, layer):
            return False
    return True


def _array(h: CbkHeader, mm: mmap.mmap, stored: str) -> np.ndarray:
    """The stored tensor as a read-only numpy array over the map (BF16 as its uint16 bit patterns)."""
    t = h.tensors_table[stored]
    dt = np.dtype(_NUMPY[t.dtype]).newbyteorder("<")
    return np.frombuffer(mm, dtype=dt, count=(t.end - t.begin) // dt.itemsize, offset=t.begin).reshape(t.shape)


def _finite(a: np.ndarray) -> bool:
    flat = a.reshape(-1)
    for i in range(0, flat.size, IO_CHUNK):
        part = flat[i:i + IO_CHUNK]
        ok = ((part & 0x7F80) != 0x7F80).all() if part.dtype == np.uint16 else np.isfinite(part).all()
        if not ok:
            return False
    return True


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _codebook_pass(h: CbkHeader, mm: mmap.mmap, layer: LayerEntry) -> bool:
    """The conditions of ``CodebookScheme.check`` (with ``check_compact`` and ``check_bias``), all true."""
    shape, params, roles = layer.shape, layer.params, layer.tensors
    if not (len(shape) == 2 and all(_is_int(s) and 0 < s < 1 << 31 for s in shape)):
        return False
    out_f, in_f = shape
    bits = params.get("bits") if isinstance(params, dict) else None
    if not (_is_int(bits) and bits in SUPPORTED_BITS):
        return False
    K = 1 << bits
    st = storage_of(params)
    if not isinstance(st, str) or st not in STORAGES or set(roles) != {"codes", *ROLES[st]}:
        return False
    table = h.tensors_table

    def spec(role: str, dtype: str, want: tuple[int, ...]) -> bool:
        t = table[roles[role]]
        return t.dtype == dtype and t.shape == want

    if not spec("codes", "U8", (out_f, packed_width(in_f, bits))):
        return False
    if layer.bias is not None:
        b = table[layer.bias]
        if b.dtype not in FLOAT_DTYPES or b.shape != (out_f,):
            return False
    if st == "f16":
        return "group_rows" not in params and spec("codebook", "F16", (out_f, K)) and \
            _finite(_array(h, mm, roles["codebook"]))
    if st == "u8":
        if "group_rows" in params or not (spec("codebook_u8", "U8", (out_f, K)) and
                                          spec("codebook_range", "F16", (out_f, 2))):
            return False
        q, rng = _array(h, mm, roles["codebook_u8"]), _array(h, mm, roles["codebook_range"])
        if not _finite(rng):
            return False
        for r in range(0, out_f, _ROWS):
            lo_step = rng[r:r + _ROWS].astype(np.float32)
            dec = lo_step[:, :1] + lo_step[:, 1:2] * q[r:r + _ROWS].astype(np.float32)
            if not (np.abs(dec) < DECODE_MARGIN).all():
                return False
        return True
    G = params.get("group_rows")
    if not (_is_int(G) and 1 <= G < 1 << 31):
        return False
    if not (spec("codebook_shared", "F16", (-(-out_f // G), K)) and spec("row_scale", "F16", (out_f,))):
        return False
    shared, scale = _array(h, mm, roles["codebook_shared"]), _array(h, mm, roles["row_scale"])
    if not (_finite(shared) and _finite(scale)):
        return False
    for r in range(0, out_f, _ROWS):
        rows = np.arange(r, min(r + _ROWS, out_f)) // G
        dec = scale[r:r + _ROWS].astype(np.float32)[:, None] * shared[rows].astype(np.float32)
        if not (np.abs(dec) < DECODE_MARGIN).all():
            return False
    return True
