"""The engine's KV cache: one contiguous sequence, k and v fp16 [L, Hkv, T_max, hd] (a paged cache for batched
serving comes beside it)."""
from __future__ import annotations

import torch

from ..models.config import ModelConfig


class ContiguousKV:
    def __init__(self, cfg: ModelConfig, max_len: int, device: torch.device, head_dim: int | None = None,
                 heads: int | None = None, v_dim: int | None = None):
        # head_dim: the engine's (latent attention caches per-head keys and values zero-padded to one size);
        # heads / v_dim: the absorbed latent attention's cache is one "head" of kv_lora_rank + qk_rope values in k
        # and nothing in v (v_dim 0)
        shape = (cfg.num_layers, heads or cfg.num_kv_heads, max_len, head_dim or cfg.head_dim)
        self.k = torch.zeros(shape, dtype=torch.float16, device=device)
        self.v = torch.zeros(shape[:3] + (shape[3] if v_dim is None else v_dim,), dtype=torch.float16, device=device)
        self.max_len = max_len

    def nbytes(self) -> int:
        return (self.k.numel() + self.v.numel()) * self.k.element_size()
