"""``describe(ckpt)``: what ``trapetum info`` and ``Model.info()`` show about a checkpoint (architecture,
parameter count, tensor formats, memory). Light on purpose: it needs the checkpoint's description only, not the
decoder or the kernels, so that ``trapetum info`` starts fast (issue 22)."""
from __future__ import annotations

import math
from collections import Counter
from typing import Any

from .checkpoint import Checkpoint
from .schema import expected_shapes


def describe(ckpt: Checkpoint, decoder: Any = None) -> dict[str, Any]:
    """A JSON-able summary of ``ckpt``; with ``decoder`` (a loaded torch module) also the bytes its weights take."""
    cfg = ckpt.config
    n_params = sum(math.prod(shp) for shp in expected_shapes(cfg).values())
    formats = Counter(ckpt.tensor_formats().values())
    weight_bytes = None
    if decoder is not None:
        seen = set()
        weight_bytes = 0
        for t in list(decoder.parameters()) + list(decoder.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                weight_bytes += t.numel() * t.element_size()
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    info = {
        "source": ckpt.source, "format": ckpt.source_format, "family": cfg.family,
        "parameters": n_params, "layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "heads": f"{cfg.num_heads} q / {cfg.num_kv_heads} kv x {cfg.head_dim}",
        "vocab_size": cfg.vocab_size, "context": cfg.max_position_embeddings,
        "tensor_formats": dict(formats),
        "memory_fp16_weights_bytes": 2 * n_params,
        "kv_cache_fp16_bytes_per_token": 2 * kv_per_token,
    }
    if weight_bytes is not None:
        info["memory_loaded_weights_bytes"] = weight_bytes
    if ckpt.meta:
        info["meta"] = {k: v for k, v in ckpt.meta.items() if k in ("recipe", "provenance", "sizes")}
    return info
