"""The in-memory description every loader produces: config + named tensors + tokenizer.

Tensor names are canonical (Hugging Face Llama style, fused projections split): ``schema.py`` lists them per block
kind and gives their shapes. Norm weights follow the HF convention (Gemma keeps w and applies offset + w). A tensor
may also be a stored quantized weight (``schemes.record.QuantRecord``) that its scheme (``schemes/``) turns into a
reference module or an engine projection.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping


from .config import ModelConfig


class LazyTensors(Mapping[str, Any]):
    """Name -> tensor mapping whose values are produced on first access (and not cached).

    Loaders give a dict of zero-argument callables so that a model is materialized one
    tensor at a time (bounded memory for large checkpoints).
    """

    def __init__(self, getters: dict[str, Callable[[], Any]], formats: dict[str, str] | None = None,
                 shapes: dict[str, tuple[int, ...]] | None = None,
                 records: dict[str, Callable[[], Any]] | None = None):
        self._getters = getters
        self.formats = formats or {}  # name -> storage format in the source ("F16", "Q4_K", ...)
        self.shapes = shapes or {}  # name -> logical shape, when known without loading
        self._records = records or {}  # name -> the weight as stored (a QuantRecord), where the source offers it

    def record(self, name: str) -> Any:
        """The weight ``name`` as the source stores it (a QuantRecord: GGUF's block-quantized rows, scheme
        "ggml"), or None where the source offers only the dequantized tensor."""
        get = self._records.get(name)
        return None if get is None else get()

    def __getitem__(self, name: str) -> Any:
        return self._getters[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._getters)

    def __len__(self) -> int:
        return len(self._getters)


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: Mapping[str, Any]  # canonical name -> torch.Tensor (or quantized record), lazily
    tokenizer: Any  # trapetum.tokenizer.Tokenizer or None
    source: str  # path it came from
    source_format: str  # "hf" | "gguf" | "cbk"
    generation: dict[str, Any] = field(default_factory=dict)  # default sampling settings
    meta: dict[str, Any] = field(default_factory=dict)  # format-specific extras (recipe, provenance)

    def tensor_formats(self) -> dict[str, str]:
        return dict(getattr(self.tensors, "formats", {}) or {})
