"""The engine's KV cache: one contiguous sequence, k and v fp16 [L, Hkv, T_max, hd] (a paged cache for batched
serving comes beside it)."""
from __future__ import annotations

import torch

from ..models.config import ModelConfig


class ContiguousKV:
    def __init__(self, cfg: ModelConfig, max_len: int, device: torch.device, head_dim: int | None = None):
        # head_dim: the engine's (latent attention caches per-head keys and values zero-padded to one size)
        shape = (cfg.num_layers, cfg.num_kv_heads, max_len, head_dim or cfg.head_dim)
        self.k = torch.zeros(shape, dtype=torch.float16, device=device)
        self.v = torch.zeros(shape, dtype=torch.float16, device=device)
        self.max_len = max_len

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
