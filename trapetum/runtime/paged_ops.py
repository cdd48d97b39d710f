"""CPU forwards of the batch scheduler over the paged KV cache (runtime/paged_kv.py): the reference decoder's
blocks (models/blocks) run by executors whose every row is computed independently of the other rows.

    CpuBatchRunner.prefill(table, tokens, start)   one prompt chunk of one sequence: its blocks gathered into a
        contiguous scratch cache (a size fixed by that sequence alone), the decoder's own forward over it (the
        CPU executor for chunks of up to 16 rows where it applies, the reference TorchOps otherwise), the new rows
        written back into the blocks; logits fp32 [V] of the chunk's last row.
    CpuBatchRunner.decode(tables, tokens, positions, prev=None, src=None)   one decode row per sequence, S
        sequences in one forward: logits fp32 [S, V]. ``prev`` (int64 tensor, the previous step's sampled tokens)
        and ``src`` (per row an index into it, or -1: the row's token from ``tokens``): the scheduler's overlapped
        steps (runtime/scheduler.py) hand a row's input token that is not yet on the host so; here it is read.
    CpuBatchRunner.replay(table, tokens, start)   up to 16 decode rows of one sequence in one forward, no logits
        (rebuilding a preempted request's cache). Executors (chosen as ``Decoder.forward`` chooses: the host-kernel CPU executor for
        dense models whose projections run the host GEMV, TorchOps otherwise):
          PagedCpuOps    models/cpu_ops.CpuOps with per-row positions (RoPE, sparsity) and attention per sequence
                         over its gathered blocks; its fused host GEMVs are batch-invariant for any M (their
                         contract); projections the host GEMV does not take run row by row (M = 1 products).
          PagedTorchOps  models/torch_ops.TorchOps in its row-by-row mode (each norm, RoPE and activation an M = 1
                         computation on a fresh row; dense fp32 projections on the dense host GEMV over all rows,
                         kernels/dense_host.py, whose rows are independent; other projections row by row) with
                         each row's attention over a fresh contiguous copy of its own sequence's keys and values.

Contract (tests/test_scheduler.py): a sequence's logits are bitwise the same whatever the other rows of the
forward are, and whatever blocks it was given. Chunk boundaries are the scheduler's (multiples of its chunk size
from position 0: a function of the sequence alone). Latent attention (MLA) is not supported (PagedKV says so).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import dense_host as dh
from ..kernels import host_ops as ho
from ..models.batch import MAX_VERIFY_ROWS, ForwardBatch, Mode
from ..models.blocks import layer_forward
from ..models.blocks.attention import row_heads
from ..models.cpu_ops import CpuOps, _Plan
from ..models.kv_cache import KVCache
from ..models.sparsity import DENSE_POSITIONS
from ..models.torch_ops import TorchOps
from ..schemes.dense import Linear
from .paged_kv import PagedKV


@dataclass
class Group:
    """Rows row0 .. row0 + n - 1 of a forward: one sequence's at positions start .. start + n - 1."""
    row0: int
    n: int
    start: int
    table: torch.Tensor  # int64 [blocks]


def _dense_rows(w, x: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] through projection(s) ``w`` (a module or a tuple of modules of one input, outputs side by side) on
    the dense host GEMV, every row independent of the others; None where a module is not a dense fp32 Linear on
    the CPU (or the kernel is unavailable)."""
    mods = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    for m in mods:
        wt = getattr(m, "weight", None)
        if type(m) is not Linear or wt.dtype != torch.float32 or wt.device.type != "cpu" or wt.stride(1) != 1 \
                or (m.bias is not None and m.bias.dtype != torch.float32):
            return None
    if x.dtype != torch.float32 or not dh.available():
        return None
    x = x if x.stride(-1) == 1 else x.contiguous()
    outs = [dh.dense_gemv_host(x, m.weight.detach(), None if m.bias is None else m.bias.detach().contiguous())
            for m in mods]
    return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


def _scratch(kv: PagedKV, table: torch.Tensor, length: int) -> KVCache:
    """A KVCache over fresh copies of the sequence's blocks (every layer), holding positions 0 .. length - 1."""
    cache = KVCache.__new__(KVCache)
    parts = [kv.gather_blocks(layer, table, length) for layer in range(kv.cfg.num_layers)]
    cache.k = [k[None] for k, _ in parts]
    cache.v = [v[None] for _, v in parts]
    cache.batch, cache.max_len = 1, parts[0][0].shape[1]
    return cache


class PagedTorchOps(TorchOps):
    def __init__(self, cfg, rotaries, positions: torch.Tensor, kv: PagedKV, groups: list[Group]):
        super().__init__(cfg, rotaries, positions, None, Mode.VERIFY)  # VERIFY: every op row by row
        self.kv, self.groups = kv, groups

    def attend(self, q, k, v, batch: ForwardBatch, p, feeds=None):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, H, N, hd]
        q, k = self._rotate(q, p.sliding), self._rotate(k, p.sliding)
        outs = []
        for g in self.groups:
            self.kv.write(p.layer, g.table, g.start, k[0, :, g.row0:g.row0 + g.n], v[0, :, g.row0:g.row0 + g.n])
            for r in range(g.n):
                kk, vv = self.kv.gather(p.layer, g.table, g.start + r + 1)
                i = g.row0 + r
                outs.append(self._attention(q[:, :, i:i + 1].contiguous(), kk[None], vv[None], g.start + r, p))
        return torch.cat(outs, 1)

    def project(self, w, x, residual=None):
        y = _dense_rows(w, x[0])
        if y is None:
            return super().project(w, x, residual)  # row by row
        return y[None] if residual is None else residual + y[None]

    def gate_up(self, w, x, feeds=None):
        gate, up, act = w
        g, u = _dense_rows(gate, x[0]), _dense_rows(up, x[0])
        if g is None or u is None:
            return super().gate_up(w, x)
        return torch.cat([act(g[i:i + 1].clone()) * u[i:i + 1] for i in range(g.shape[0])])[None]

    def logits(self, head, h):
        y = _dense_rows(head, h[0])
        if y is None:
            return super().logits(head, h)
        cap = self.cfg.final_softcap
        if cap is not None:  # row by row, as the one-row pass (a transcendental over the batch need not)
            y = torch.cat([torch.tanh(y[i:i + 1].clone() / cap) * cap for i in range(y.shape[0])])
        return y[None]

    def latent_attend(self, q, c, k_rot, batch, p):  # PagedKV refuses MLA models before a forward gets here
        raise NotImplementedError("batched serving of latent attention")


class PagedCpuOps(CpuOps):
    def __init__(self, step, kv: PagedKV, groups: list[Group], positions: torch.Tensor, threads: int):
        self.step, self.cfg, self.threads = step, step.cfg, threads
        self.kv, self.groups, self.positions = kv, groups, positions
        self.start, self.m = 0, int(positions.numel())
        self._tables: dict = {}

    def norm(self, x, w, eps=None, feeds=None):  # a tensor: this executor's project / gate_up read rows of it
        return super().norm(x, w, eps)

    def heads(self, qkv):  # views: attend below splits the rows per sequence
        return row_heads(self.cfg, qkv)

    def _rope(self, sliding: bool):
        """cos, sin fp32 [N, rd]: row r as the decode step at its own position computes it."""
        key = bool(sliding)
        if key not in self._tables:
            rope = self.step.rotaries[key]
            rows = [rope.cos_sin(self.positions[r:r + 1]) for r in range(self.m)]
            cos = torch.cat([c for c, _ in rows]).float().contiguous()
            sin = torch.cat([s for _, s in rows]).float().contiguous()
            self._tables[key] = (cos, sin, rope.interleave)
        return self._tables[key]

    def sparsify(self, x, t, batch):
        dense = (self.positions < DENSE_POSITIONS).view(-1, 1)
        return torch.where((x.abs() > t) | dense, x, torch.zeros((), dtype=x.dtype))

    def project(self, w, x, residual=None):
        f = self.step.fused(w)
        if not f or x.dtype != torch.float32 or (residual is not None and residual.dtype != torch.float32):
            y = _dense_rows(w, x)
            if y is None:  # M = 1 products
                y = torch.cat([self._row_project(w, x[i:i + 1].clone()) for i in range(x.shape[0])])
            return y if residual is None else residual + y
        return super().project(w, x, residual)

    @staticmethod
    def _row_project(w, x):
        mods = tuple(w) if isinstance(w, (tuple, list)) else (w,)
        return torch.cat([m(x) for m in mods], -1) if len(mods) > 1 else mods[0](x)

    def gate_up(self, w, x, feeds=None):
        f = self.step.fused(w, self.cfg.hidden_act)
        if not f or x.dtype != torch.float32:
            gate, up, act = w
            return torch.cat([act(gate(r)) * up(r) for r in (x[i:i + 1].clone() for i in range(x.shape[0]))])
        return super().gate_up(w, x)

    def attend(self, q, k, v, batch: ForwardBatch, p, feeds=None):
        cfg = self.cfg
        cos, sin, inter = self._rope(p.sliding)
        q, k, v = q.float(), k.float(), v.float()
        hd = cfg.head_dim
        q, k, v = (t if t.stride(1) == hd and t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
        outs = []
        for g in self.groups:
            a, b = g.row0, g.row0 + g.n
            kc, vc = self.kv.gather_blocks(p.layer, g.table, g.start + g.n)  # [Hkv, capacity, hd]
            outs.append(ho.attend(q[a:b], k[a:b], v[a:b], cos[a:b], sin[a:b], kc, vc, g.start, cfg.scale, inter,
                                  cfg.sliding_window if p.sliding else None, cfg.attn_softcap, checked=False))
            self.kv.write(p.layer, g.table, g.start, kc[:, g.start:g.start + g.n], vc[:, g.start:g.start + g.n])
        return torch.cat(outs)


class CpuBatchRunner:
    """The scheduler's forwards (module docstring) over a reference ``Decoder`` on the CPU. ``fold_prompt`` 0: the
    scheduler folds no prompt into the decode forward by default (``Scheduler(fold=)`` does; the rows are each
    row's own decode computation here, so a fold is exact but runs a prompt row by row)."""

    fold_prompt = 0
    overlap = False  # the scheduler's default: overlapped steps buy nothing where the forward is the host's

    def __init__(self, decoder, kv: PagedKV):
        self.decoder, self.kv, self.cfg = decoder, kv, decoder.config
        self.rotaries = (decoder.rope_global, decoder.rope_local)
        self.device = next(decoder.parameters()).device
        step = decoder.cpu_step
        self.step = step if step is not None and step.dense and self.kv.k[0].dtype == torch.float32 else None

    @torch.inference_mode()
    def prefill(self, table: torch.Tensor, tokens: list[int], start: int) -> torch.Tensor:
        n = len(tokens)
        cache = _scratch(self.kv, table, start + n)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        logits = self.decoder(ids, cache, start, last_only=True)[0, -1].float()
        for layer in range(self.cfg.num_layers):
            self.kv.write(layer, table, start, cache.k[layer][0, :, start:start + n],
                          cache.v[layer][0, :, start:start + n])
        return logits

    @torch.inference_mode()
    def decode(self, tables: list[torch.Tensor], tokens: list[int], positions: list[int],
               prev: torch.Tensor | None = None, src: list[int] | None = None) -> torch.Tensor:
        if prev is not None:
            got = prev.tolist()
            tokens = [got[j] if j >= 0 else t for t, j in zip(tokens, src)]
        groups = [Group(i, 1, int(positions[i]), tables[i]) for i in range(len(tokens))]
        return self._rows(Mode.DECODE, groups, tokens, [int(p) for p in positions], True)

    @torch.inference_mode()
    def replay(self, table: torch.Tensor, tokens: list[int], start: int) -> None:
        """Decode rows ``tokens`` (at most MAX_VERIFY_ROWS) of one sequence at start .. start + n - 1 in one
        forward, without logits: their K/V rows bitwise those of n decode steps (each row computed alone; the
        host attention's M-row contract), so a preempted request is rebuilt exactly."""
        n = len(tokens)
        if not 1 <= n <= MAX_VERIFY_ROWS:
            raise ValueError(f"replay: 1 to {MAX_VERIFY_ROWS} rows, got {n}")
        self._rows(Mode.PREFILL, [Group(0, n, start, table)], tokens, list(range(start, start + n)), False)

    def _rows(self, mode, groups, tokens, positions, logits: bool):
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        slots = torch.tensor([i for i, g in enumerate(groups) for _ in range(g.n)], dtype=torch.int32)
        lens = torch.tensor([g.start + g.n for g in groups], dtype=torch.int32)
        batch = ForwardBatch(mode, torch.tensor([tokens], dtype=torch.long, device=self.device), 0, len(tokens),
                             seq_slots=slots, seq_lens=lens, positions=pos)
        if self.step is None:
            ops = PagedTorchOps(self.cfg, self.rotaries, pos, self.kv, groups)
            out = self._forward(batch, ops, self.decoder, logits)
            return None if out is None else out[0]
        step = self.step
        if step._plan is None:
            step._plan = _Plan(self.decoder)
        nt = torch.get_num_threads()
        ops = PagedCpuOps(step, self.kv, groups, pos, nt if step.threads is None else step.threads)
        torch.set_num_threads(1)
        try:
            return self._forward(batch, ops, step._plan, logits)
        finally:
            torch.set_num_threads(nt)

    @staticmethod
    def _forward(batch, ops, model, logits: bool = True):
        """blocks.decoder_forward with every row's logits (or none)."""
        x = ops.embed(model.embed, batch)
        for layer in model.layers:
            x = layer_forward(x, batch, ops, layer)
        return ops.logits(model.head, ops.norm(x, model.final_norm)) if logits else None
