"""TorchOps: the reference executor of the blocks (models/blocks), plain torch with Hugging Face semantics.

The residual stream is x [B, T, D] in the model's dtype (float32 on the CPU); projections are the schemes'
reference modules (dequantize, then matmul), norms ``RMSNorm`` modules computed in fp32, attention materializes
fp32 scores [B, H, T, S] over the KV cache (``KVCache``, or just the new rows without one).

VERIFY batches (rows of one sequence at start .. start + T - 1) are computed row by row: projections, norms and
attention see one row at a time, each row attending to the cache up to its own position, so row r is bitwise the
DECODE step at start + r (a matrix product over T rows need not round like T products of one row).

RoPE: a pass over positions start .. start + T - 1 rotates with the frequencies of length start + T (a VERIFY row,
as the decode step it equals, with those of its own length): the length-dependent kinds of models/rope.py.
Latent attention caches the latent (models/kv_cache.py) and expands it through kv_b each pass; mixture-of-experts
layers run each chosen expert on its rows (transformers' loop), so calibration hooks on an expert see only the
rows routed to it.
"""
from __future__ import annotations

import torch

from .batch import ForwardBatch, Mode
from .config import ModelConfig
from .blocks.moe import select_experts
from .kv_cache import KVCache
from .layers import Rotary
from .sparsity import DENSE_POSITIONS


def _by_row(fn, x: torch.Tensor, *rest) -> torch.Tensor:
    """fn over each row (dim 1) of x [B, T, ...] (and the same rows of ``rest``), concatenated. Each row is copied
    to a tensor of its own with the strides a decode step's input has: torch calls a [1, 1, D] slice of [1, T, D]
    contiguous but keeps its strides, and a CPU product over it need not round like one over the fresh tensor."""
    return torch.cat([fn(_row(x, r), *(_row(t, r) for t in rest)) for r in range(x.shape[1])], 1)


def _row(x: torch.Tensor, r: int) -> torch.Tensor:
    return x[:, r:r + 1].clone(memory_format=torch.contiguous_format)


class TorchOps:
    def __init__(self, cfg: ModelConfig, rotaries: tuple[Rotary, Rotary | None], positions: torch.Tensor,
                 cache: KVCache | None, mode: Mode = Mode.PREFILL):
        self.cfg, self.cache = cfg, cache
        self.rowwise = mode is Mode.VERIFY
        self.positions = positions
        g, loc = rotaries
        self.rotaries = {False: g, True: loc if loc is not None else g}
        self._tables: dict = {}

    def _rope(self, sliding: bool, row: int | None = None):
        """(rotary, cos, sin) of the pass (``row`` None: every position, at the pass's length) or of one row (as
        the decode step at its position)."""
        key = (bool(sliding), row)
        if key not in self._tables:
            rope = self.rotaries[bool(sliding)]
            pos = self.positions if row is None else self.positions[row:row + 1]
            self._tables[key] = (rope, *rope.cos_sin(pos))
        return self._tables[key]

    def _rotate(self, x, sliding: bool):
        """RoPE of x [B, H, T, d] at this pass's positions (row by row in VERIFY mode)."""
        if self.rowwise:
            parts = []
            for r in range(x.shape[2]):
                rope, cos, sin = self._rope(sliding, r)
                parts.append(rope.apply(x[:, :, r:r + 1], cos, sin))
            return torch.cat(parts, 2)
        rope, cos, sin = self._rope(sliding)
        return rope.apply(x, cos, sin)

    def norm(self, x, w, eps=None, feeds=None):
        # ``eps``: the reference's norm modules carry their own (built with it, models/decoder.py)
        return _by_row(w, x) if self.rowwise and x.dim() == 3 else w(x)

    def split(self, x, sizes):
        return torch.split(x, list(sizes), dim=-1)

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

    def attend(self, q, k, v, batch: ForwardBatch, p, feeds=None):
        start = int(batch.start)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, hd]
        q, k = self._rotate(q, p.sliding), self._rotate(k, p.sliding)
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

    # -- latent attention (models/blocks/mla.py) --------------------------------------------------
    def latent_attend(self, q, c, k_rot, batch: ForwardBatch, p):
        cfg = self.cfg
        B, T = q.shape[:2]
        H, nope, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        start = int(batch.start)
        q = q.reshape(B, T, H, cfg.head_dim).transpose(1, 2)  # [B, H, T, hd]
        q = torch.cat([q[..., :nope], self._rotate(q[..., nope:], False)], -1)
        kr = self._rotate(k_rot.reshape(B, 1, T, cfg.qk_rope_head_dim), False)
        lat = torch.cat([c.reshape(B, 1, T, r), kr], -1)  # [B, 1, T, r + rope]
        if self.cache is not None:
            lat, _ = self.cache.store(p.layer, start, lat, lat[..., :0])  # [B, 1, S, r + rope]
        if self.rowwise:
            S = lat.shape[2]
            return torch.cat([self._latent_attention(q[:, :, i:i + 1], lat[:, :, :S - T + i + 1], start + i, p)
                              for i in range(T)], 1)
        return self._latent_attention(q, lat, start, p)

    def _latent_attention(self, q, lat, start: int, p):
        """q [B, H, T, hd] (RoPE applied to its last qk_rope features) over the latent lat [B, 1, S, r + rope]
        -> [B, T, H * v_head_dim] (keys and values expanded through kv_b, as transformers)."""
        cfg = self.cfg
        B, H, T = q.shape[:3]
        S = lat.shape[2]
        nope, r, vd = cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
        kv = p.kv_b(lat[:, 0, :, :r]).reshape(B, S, H, nope + vd).transpose(1, 2)  # [B, H, S, nope + v]
        k = torch.cat([kv[..., :nope], lat[:, :, :, r:].expand(B, H, S, cfg.qk_rope_head_dim)], -1)
        qpos = torch.arange(start, start + T, device=q.device)[:, None]
        allowed = torch.arange(S, device=q.device)[None, :] <= qpos
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * cfg.scale
        s = s.masked_fill(~allowed, float("-inf"))
        out = torch.matmul(torch.softmax(s, dim=-1), kv[..., nope:].float()).to(q.dtype)
        return out.transpose(1, 2).reshape(B, T, H * vd)

    # -- mixture of experts (models/blocks/moe.py) ---------------------------------------------
    def route(self, router, h):
        if self.rowwise:
            parts = [self._route(router, _row(h, i)) for i in range(h.shape[1])]
            return torch.cat([w for w, _ in parts], 1), torch.cat([i for _, i in parts], 1)
        return self._route(router, h)

    def _route(self, router, h):
        return select_experts(router(h), self.cfg, router.bias)

    def experts(self, experts, h, weights, idx):
        if self.rowwise:
            return _by_row(lambda hr, wr, ir: self._experts(experts, hr, wr, ir), h, weights, idx)
        return self._experts(experts, h, weights, idx)

    @staticmethod
    def _experts(experts, h, weights, idx):
        """Each chosen expert over the rows routed to it, weighted and summed (transformers' order)."""
        x = h.reshape(-1, h.shape[-1])
        w, ids = weights.reshape(x.shape[0], -1), idx.reshape(x.shape[0], -1)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():  # ascending
            rows, slot = torch.where(ids == e)
            ex = experts[e]
            gate, up, act = ex.gate_up
            xr = x[rows]
            y = ex.down(act(gate(xr)) * up(xr)) * w[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out.view(h.shape)

    def sigmoid_gate(self, w, h, y):
        return torch.sigmoid(self.project(w, h)) * y

    def gate_up(self, w, x, feeds=None):
        gate, up, act = w
        if self.rowwise:
            return _by_row(lambda r: act(gate(r)) * up(r), x)
        return act(gate(x)) * up(x)

    def add(self, x, y):
        return x + y

    def sparsify(self, x, t, batch):
        """x [B, T, F] * (|x| > t); the rows at positions < DENSE_POSITIONS unchanged (models/sparsity.py). An
        elementwise select, so the same bits row by row or over the pass (VERIFY needs no loop)."""
        keep = (x.abs() > t) | (self.positions < DENSE_POSITIONS).view(-1, 1)
        return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))

    def embed(self, table, batch: ForwardBatch):
        x = table(batch.tokens)
        if self.cfg.embed_scale is not None:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def logits(self, head, h):
        logits = (_by_row(head, h) if self.rowwise else head(h)).float()
        cap = self.cfg.final_softcap
        return torch.tanh(logits / cap) * cap if cap is not None else logits
