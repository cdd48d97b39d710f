"""Compact storage of per-row codebooks (.cbk version 2), decoded to the fp16 [out, K] codebook at load.

A codebook record (``codebook.py``) stores K = 2**bits centroids per output row. The fp16 table costs 16 K bits
per row: 0.44 bits per weight at 4 bits on 576-wide rows, and 7.1 bits per weight at 8 bits (256 centroids for
576 weights: the tied embedding / LM head of SmolLM2-135M is half of its file so). ``params["codebook"]`` names
the storage:

``"f16"`` (or absent, version 1)
    ``codebook`` fp16 [out, K]: the centroids.
``"u8"``
    ``codebook_u8`` uint8 [out, K] and ``codebook_range`` fp16 [out, 2] = (lo, step) per row:
    ``centroid[r, k] = fp16(float32(lo[r]) + float32(step[r]) * float32(q[r, k]))``: 8 bits per centroid
    plus 32 per row (20 bytes a row at 4 bits instead of 32).
``"shared"`` (with ``params["group_rows"]`` G >= 1)
    ``codebook_shared`` fp16 [ceil(out / G), K] and ``row_scale`` fp16 [out]: rows r of group g = r // G share
    one table, scaled per row: ``centroid[r, k] = fp16(float32(row_scale[r]) * float32(shared[g, k]))``
    (16 bits per row plus the groups' tables).

``expand`` returns the record in the ``"f16"`` form (the same object when it is already so); the decode is
elementwise float32 arithmetic rounded once to fp16, so the quantizer (which assigns codes against the decoded
centroids) and every loader see the same centroids bit for bit (the host GEMV forms the "shared" tables per row
with the same arithmetic: kernels/host_gemv.py). ``check_compact`` validates a compact record's tensors (roles,
dtypes, shapes, finite values, a finite decode) and expands a "u8" record; a "shared" one is returned as stored
(its decode checked in blocks of rows, never whole: the CPU modules keep it so); failures are ``FormatError``
naming the layer.
"""
from __future__ import annotations

import torch

from ..errors import FormatError
from .codebook_storage import ROLES, STORAGES, needs_v2, storage_of
from .record import QuantRecord

__all__ = ["STORAGES", "ROLES", "storage_of", "needs_v2", "decode_u8", "decode_shared", "expand", "check_compact"]


def decode_u8(q: torch.Tensor, rng: torch.Tensor) -> torch.Tensor:
    """fp16 [R, K] centroids from uint8 [R, K] and fp16 (lo, step) [R, 2]."""
    r = rng.float()
    return (r[:, :1] + r[:, 1:2] * q.float()).to(torch.float16)


def decode_shared(shared: torch.Tensor, scale: torch.Tensor, group_rows: int) -> torch.Tensor:
    """fp16 [R, K] centroids from the groups' fp16 tables [ceil(R / G), K] and fp16 row scales [R]."""
    R = scale.shape[0]
    g = torch.arange(R, device=scale.device) // group_rows
    return (scale.float().unsqueeze(1) * shared.float()[g]).to(torch.float16)


def expand(record: QuantRecord) -> QuantRecord:
    """The record with its fp16 [out, K] codebook (unchanged when stored so). Call ``check_compact`` first on
    anything read from a file."""
    st = storage_of(record.params)
    if st == "f16":
        return record
    t = record.tensors
    if st == "u8":
        book = decode_u8(t["codebook_u8"], t["codebook_range"])
    else:
        book = decode_shared(t["codebook_shared"], t["row_scale"], int(record.params["group_rows"]))
    params = {k: v for k, v in record.params.items() if k not in ("codebook", "group_rows")}
    return QuantRecord(record.scheme, record.shape, params, {"codes": t["codes"], "codebook": book}, record.bias)


def _fail(name: str, msg: str) -> None:
    raise FormatError(f"quantized tensor {name}: {msg}")


def _tensor(record: QuantRecord, role: str, dtype: torch.dtype, shape: tuple[int, ...], name: str) -> torch.Tensor:
    t = record.tensors.get(role)
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        _fail(name, f"{role} must be {str(dtype).replace('torch.', '')}, got "
                    f"{getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != shape:
        _fail(name, f"{role} shape {tuple(t.shape)} != {shape}")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        _fail(name, f"{role} holds non-finite values")
    return t


_BLOCK = 4096  # rows of a "shared" record decoded at a time by check_compact


def check_compact(record: QuantRecord, name: str, out_f: int, K: int) -> QuantRecord:
    """Validate the codebook storage of a codebook record with ``out_f`` rows and K centroids a row; return its
    ``expand``-ed form for "u8", the record itself for "f16" (whose tensors the caller checks) and "shared"."""
    params = record.params if isinstance(record.params, dict) else {}
    st = storage_of(params)
    if not isinstance(st, str) or st not in STORAGES:
        _fail(name, f"codebook storage must be one of {', '.join(STORAGES)}, got {st!r}")
    if st == "f16":
        if "group_rows" in params:
            _fail(name, "group_rows is given for an fp16 codebook")
        return record
    want = {"codes", *ROLES[st]}
    if set(record.tensors) != want:
        _fail(name, f"a {st!r} codebook needs tensors {sorted(want)}, got {sorted(record.tensors)}")
    if st == "u8":
        if "group_rows" in params:
            _fail(name, "group_rows is given for a 'u8' codebook")
        _tensor(record, "codebook_u8", torch.uint8, (out_f, K), name)
        _tensor(record, "codebook_range", torch.float16, (out_f, 2), name)
    else:
        G = params.get("group_rows")
        if not isinstance(G, int) or isinstance(G, bool) or not 1 <= G < 1 << 31:
            _fail(name, f"group_rows must be a positive integer, got {G!r}")
        shared = _tensor(record, "codebook_shared", torch.float16, (-(-out_f // G), K), name)
        scale = _tensor(record, "row_scale", torch.float16, (out_f,), name)
        for r in range(0, out_f, _BLOCK):
            rows = torch.arange(r, min(r + _BLOCK, out_f)) // G
            if not bool(torch.isfinite(decode_shared(shared[rows], scale[r:r + _BLOCK], 1)).all()):
                _fail(name, "the 'shared' codebook decodes to non-finite centroids")
        return record
    full = expand(record)
    if not bool(torch.isfinite(full.tensors["codebook"]).all()):
        _fail(name, f"the {st!r} codebook decodes to non-finite centroids")
    return full
