"""Static KV cache: one preallocated [B, n_kv_heads, max_len, head_dim] pair per layer.

Latent attention (MLA) caches the latent instead: ``k`` [B, 1, max_len, kv_lora_rank + qk_rope_head_dim] holds
[kv_a_norm(c), RoPE(k_rot)] per position (one "head" shared by every query head, as transformers and llama.cpp
cache it) and ``v`` is empty ([B, 1, max_len, 0]): the values are the latent's first kv_lora_rank features.
"""
from __future__ import annotations

import math

import torch

from ..errors import TrapetumError
from .config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int = 1, max_len: int = 2048,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if cfg.mla:
            shape_k = (batch, 1, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            shape_v = (batch, 1, max_len, 0)
        else:
            shape_k = shape_v = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        # Uninitialized: positions are written before they are read (attention reads [0, end) only),
        # and a large cache is then allocated without touching its pages.
        self.k = [torch.empty(shape_k, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.empty(shape_v, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.batch = batch
        self.max_len = max_len

    def nbytes(self) -> int:
        return sum(math.prod(t.shape) * t.element_size() for t in self.k + self.v)

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [B, Hkv, T, hd] at positions start..start+T; return the filled prefix [B, Hkv, start+T, hd]."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise TrapetumError(f"context overflow: position {end} exceeds the KV cache size {self.max_len}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
