"""TorchOps: the reference executor of the blocks (models/blocks), plain torch with Hugging Face semantics.

The residual stream is x [B, T, D] in the model's dtype (float32 on the CPU); projections are the schemes'
reference modules (dequantize, then matmul), norms ``RMSNorm`` modules computed in fp32, attention materializes
fp32 scores [B, H, T, S] over the KV cache (``KVCache``, or just the new rows without one).

VERIFY batches (rows of one sequence at start .. start + T - 1) are computed row by row: projections, norms and
attention see one row at a time, each row attending to the cache up to its own position, so row r is bitwise the
DECODE step at start + r (a matrix product over T rows need not round like T products of one row).
"""
from __future__ import annotations

import torch

from .batch import ForwardBatch, Mode
from .config import ModelConfig
from .kv_cache import KVCache
from .layers import Rotary


def _by_row(fn, x: torch.Tensor, *rest) -> torch.Tensor:
    """fn over each row (dim 1) of x [B, T, ...] (and the same rows of ``rest``), concatenated."""
    return torch.cat([fn(x[:, r:r + 1], *(t[:, r:r + 1] for t in rest)) for r in range(x.shape[1])], 1)


class TorchOps:
    def __init__(self, cfg: ModelConfig, rotaries: tuple[Rotary, Rotary | None], positions: torch.Tensor,
                 cache: KVCache | None, mode: Mode = Mode.PREFILL):
        self.cfg, self.cache = cfg, cache
        self.rowwise = mode is Mode.VERIFY
        g, loc = rotaries
        self.ropes = {False: (g, *g.cos_sin(positions)),
                      True: (loc, *loc.cos_sin(positions)) if loc is not None else (g, *g.cos_sin(positions))}

    def norm(self, x, w):
        return _by_row(w, x) if self.rowwise and x.dim() == 3 else w(x)

    def project(self, w, x, residual=None):
        if self.rowwise:
            y = _by_row(lambda r: self._project(w, r), x)
        else:
            y = self._project(w, x)
        return y if residual is None else residual + y

    @staticmethod
    def _project(w, x):
        return torch.cat([m(x) for m in w], -1) if isinstance(w, (tuple, list)) else w(x)

    def heads(self, qkv):
        cfg = self.cfg
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shp = qkv.shape[:-1]
        return (qkv[..., :qd].reshape(*shp, cfg.num_heads, cfg.head_dim),
                qkv[..., qd:qd + kd].reshape(*shp, cfg.num_kv_heads, cfg.head_dim),
                qkv[..., qd + kd:].reshape(*shp, cfg.num_kv_heads, cfg.head_dim))

    def attend(self, q, k, v, batch: ForwardBatch, p):
        start = int(batch.start)
        rope, cos, sin = self.ropes[bool(p.sliding)]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, hd]
        if self.rowwise:
            q = torch.cat([rope.apply(q[:, :, r:r + 1], cos[r:r + 1], sin[r:r + 1]) for r in range(q.shape[2])], 2)
            k = torch.cat([rope.apply(k[:, :, r:r + 1], cos[r:r + 1], sin[r:r + 1]) for r in range(k.shape[2])], 2)
        else:
            q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        if self.cache is not None:
            k, v = self.cache.store(p.layer, start, k, v)  # [B, Hkv, S, hd], S = start + T
        if self.rowwise:  # row r: its own query over the cache up to start + r
            T = q.shape[2]
            return torch.cat([self._attention(q[:, :, r:r + 1], k[:, :, :k.shape[2] - T + r + 1],
                                              v[:, :, :v.shape[2] - T + r + 1], start + r, p) for r in range(T)], 1)
        return self._attention(q, k, v, start, p)

    def _attention(self, q, k, v, start: int, p):
        """q [B, H, T, hd] at positions start .. start + T - 1 over k, v [B, Hkv, S, hd] -> [B, T, H * hd]."""
        cfg = self.cfg
        B, T = q.shape[0], q.shape[2]
        S = k.shape[2]
        rep = cfg.num_heads // cfg.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        qpos = torch.arange(start, start + T, device=q.device)[:, None]
        kpos = torch.arange(S, device=q.device)[None, :]
        allowed = kpos <= qpos  # [T, S]
        if p.sliding:
            allowed = allowed & (qpos - kpos < cfg.sliding_window)
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * cfg.scale  # [B, H, T, S]
        if cfg.attn_softcap is not None:
            s = torch.tanh(s / cfg.attn_softcap) * cfg.attn_softcap
        s = s.masked_fill(~allowed, float("-inf"))
        out = torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
        return out.transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.head_dim)

    def gate_up(self, w, x):
        gate, up, act = w
        if self.rowwise:
            return _by_row(lambda r: act(gate(r)) * up(r), x)
        return act(gate(x)) * up(x)

    def add(self, x, y):
        return x + y

    def embed(self, table, batch: ForwardBatch):
        x = table(batch.tokens)
        if self.cfg.embed_scale is not None:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def logits(self, head, h):
        logits = (_by_row(head, h) if self.rowwise else head(h)).float()
        cap = self.cfg.final_softcap
        return torch.tanh(logits / cap) * cap if cap is not None else logits
