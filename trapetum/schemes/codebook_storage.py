"""The names of the compact codebook storages (``codebook_store.py`` decodes and checks them), without torch: the
.cbk header reader (``formats/cbk_header.py``) needs them to tell a file's version before any tensor is read."""
from __future__ import annotations

STORAGES = ("f16", "u8", "shared")
ROLES = {"f16": ("codebook",), "u8": ("codebook_u8", "codebook_range"), "shared": ("codebook_shared", "row_scale")}


def storage_of(params: dict) -> object:
    """The record's codebook storage: "f16" when ``params`` has no "codebook" key (what version 1 wrote)."""
    return params.get("codebook", "f16") if isinstance(params, dict) else "f16"


def needs_v2(scheme: str, params: dict) -> bool:
    """Whether a layer needs .cbk version 2 (a compact codebook storage)."""
    return scheme == "codebook" and storage_of(params) != "f16"
