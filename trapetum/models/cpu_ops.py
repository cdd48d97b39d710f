"""CpuOps: the CPU decode step's executor of the model's blocks (models/blocks), on the host kernels.

Used by ``Decoder.forward`` (after ``Decoder.use_host_kernels``) for passes of one sequence of M = 1..16 rows at
positions start .. start + M - 1 over a KVCache of fp32 on the CPU (decode steps, VERIFY rows, short prompts) of
dense models (attention + MLP blocks) whose projections are 4/8-bit codebooks; other passes run TorchOps.

Layouts: the residual stream is fp32 [M, D] (the reference's [1, M, D] without its batch dim); a layer is a
handful of calls into C (kernels/host_ops.py): RMSNorm + one GEMV over the fused q/k/v rows (+ bias), in one call;
RoPE of q and k with the k / v append into the cache, and attention; o GEMV + residual; RMSNorm + one gate/up GEMV
with act(gate) * up, in one call; down GEMV + residual. A norm that feeds a projection (the blocks' ``feeds=``) is
left pending (``_Normed``) and run by that projection's C call. Where the family has no q/k norms, ``heads``
returns the fused q/k/v rows themselves (q) and None for k and v: attention reads the three parts by offsets.
Attention is C over the cache's own storage (RoPE, the append, then each row's scores, softmax and weighted
values: row r over positions up to start + r, its sliding window, softcap). The block parameters are built once
(``_Plan``), the outputs allocated per call (torch's CPU allocator caches them). Few Python ops per layer on
purpose: between two GEMVs the interpreter runs cold (NOTES-engine.md, session 13, second part).

Contracts (tests/test_cpu_ops.py): every op works row by row with one fixed sequence per row, so row r of an M-row
pass is bitwise the decode step at start + r (VERIFY rows equal decode steps), and the results are the same for
every thread count (the GEMV's contract; torch runs at one thread during the pass, the host pool uses
``threads``). Against the float64 reference decoder: fp32 rounding (logits within 1e-4 relative).
Projections that the host GEMV does not take (other schemes, bit widths) run their own modules (torch).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ..errors import TrapetumError
from ..kernels import host_ops as ho
from ..kernels import ggml_host as gh
from ..schemes.ggml import GgmlLinear
from .batch import MAX_VERIFY_ROWS, ForwardBatch
from .blocks import layer_forward
from .blocks.attention import row_heads
from .config import ModelConfig
from .sparsity import DENSE_POSITIONS


def _host_parts(mods) -> tuple | None:
    """(parts, bits, in_features) of modules that all run the host GEMV with one bit width and input, else None."""
    parts, bits, k = [], None, None
    for m in mods:
        host = getattr(m, "host", None)
        if host is None or not m.host_current():
            return None
        mb = gh.BITS if isinstance(m, GgmlLinear) else m.bits  # a GGUF's blocks: any legacy types together
        if bits is not None and (mb != bits or m.in_features != k):
            return None
        bits, k = mb, m.in_features
        b = m.bias
        if b is not None and b.dtype != torch.float32:
            return None
        if isinstance(m, GgmlLinear):
            parts.append((m.blocks, host.weight, b))
        else:
            parts.append((m.codes, host.tables, b))  # either storage: the shared tables stay as stored
    return parts, bits, k


class _Normed:
    """RMSNorm(x) not run yet: x fp32 [M, D] (unit column stride), the norm module ``w``; ``args`` (weight
    pointer, eps, offset) for the GEMV call that runs it; ``value()`` runs it alone (ho.rmsnorm, the same C)."""
    __slots__ = ("x", "w", "args")

    def __init__(self, x, w, args):
        self.x, self.w, self.args = x, w, args

    def value(self) -> torch.Tensor:
        w = self.w
        return ho.rmsnorm(self.x, w.weight.detach(), w.eps, w.offset)


class _Plan:
    """The model as decoder_forward reads it (embed, layers with their ``blocks``, final_norm, head), its block
    parameters built once (the reference decoder's ``Block.blocks`` builds them at every pass)."""

    def __init__(self, model):
        self.embed, self.final_norm, self.head = model.embed, model.final_norm, model.head
        self.layers = [SimpleNamespace(blocks=layer.blocks) for layer in model.layers]


class CpuStep:
    """One decoder's CPU step state: its block parameters, fused host weights and whole-layer calls (built on
    first use; modules replaced afterwards are not seen: call ``Decoder.use_host_kernels`` again) and the host
    thread count (None: ``torch.get_num_threads()`` when a pass starts)."""

    def __init__(self, cfg: ModelConfig, rotaries, threads: int | None = None):
        self.cfg, self.threads = cfg, threads
        g, loc = rotaries
        self.rotaries = {False: g, True: loc if loc is not None else g}
        self._fused: dict = {}
        self._norms: dict = {}
        self._layers: list | None = None  # per plan layer: its ho.DenseLayer, or None (the blocks run it)
        self._plan: _Plan | None = None
        self.dense = all(cfg.block_kinds(i) == ("attention", "mlp") for i in range(cfg.num_layers))

    def invalidate(self) -> None:
        """Forget the plan and the fused weights (keyed by the plan's objects): the next pass rebuilds them from
        the decoder as it is then (Decoder.set_sparsity changes the blocks' parameters)."""
        self._plan = self._layers = None
        self._fused.clear()
        self._norms.clear()

    def fused(self, w, act: str | None = None):
        """The FusedGemv of projection ``w`` (a module, or a tuple of modules of one input, codebooks of one
        width or GGUF blocks, schemes/ggml.py; the plan's objects, so their ids are stable), or False where the
        host GEMV does not take it."""
        f = self._fused.get(id(w))
        if f is None:
            mods = tuple(w[:2]) if act is not None else tuple(w) if isinstance(w, (tuple, list)) else (w,)
            spec = _host_parts(mods)
            ok = spec is not None and (act is None or act in ho.ACTS)
            f = self._fused[id(w)] = ho.FusedGemv(*spec, act=act) if ok else False
        return f

    def _norm_args(self, w):
        return (w.weight.detach(), float(w.eps), float(w.offset))

    def dense_layer(self, layer):
        """The plan layer's ho.DenseLayer (one C call for the whole layer), or None where the blocks run it: a
        layer of attention (no q/k norms, no sandwich norm, no sparsity) then MLP (the same) whose four GEMVs and
        two fp32 norms the host kernels take."""
        if [k for k, _ in layer.blocks] != ["attention", "mlp"] or self.cfg.qk_norm:
            return None
        (_, pa), (_, pm) = layer.blocks
        if pa.sparsity is not None or pm.sparsity is not None or pa.post_norm is not None or pm.post_norm is not None:
            return None
        if pa.q_norm is not None or any(w.weight.dtype != torch.float32 for w in (pa.input_norm, pm.norm)):
            return None
        fs = self.fused(pa.qkv), self.fused(pa.o), self.fused(pm.gate_up, self.cfg.hidden_act), self.fused(pm.down)
        if not all(fs):
            return None
        cfg = self.cfg
        try:
            return ho.DenseLayer(*fs, self._norm_args(pa.input_norm), self._norm_args(pm.norm), cfg.num_heads,
                                 cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window if pa.sliding else None,
                                 cfg.scale, cfg.attn_softcap)
        except ValueError:  # shapes that do not chain: the blocks run the layer
            return None

    def forward(self, forward, batch: ForwardBatch, ops: "CpuOps"):
        """``forward`` (blocks.decoder_forward) over the plan, each layer that ``dense_layer`` takes in one C call
        (the same ops in the same order: the same bits)."""
        plan = self._plan
        if self._layers is None:
            self._layers = [self.dense_layer(layer) for layer in plan.layers]
        if not any(self._layers):
            return forward(batch, ops, plan)
        whole = {id(layer): dl for layer, dl in zip(plan.layers, self._layers)}

        def run(x, batch, ops, layer):
            dl = whole[id(layer)]
            if dl is not None and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1:
                return ops.dense_layer(dl, x, layer.blocks[0][1])
            return layer_forward(x, batch, ops, layer)
        return forward(batch, ops, plan, run_layer=run)

    def applies(self, tokens: torch.Tensor, cache) -> bool:
        """Whether a pass of ``tokens`` [B, T] over ``cache`` runs here."""
        if not self.dense or cache is None or tokens.dim() != 2 or tokens.shape[0] != 1:
            return False
        if not 1 <= tokens.shape[1] <= MAX_VERIFY_ROWS or tokens.device.type != "cpu":
            return False
        k = cache.k[0]
        return k.dtype == torch.float32 and k.device.type == "cpu" and k.shape[0] == 1 and k.stride(3) == 1

    def run(self, forward, batch: ForwardBatch, cache, model) -> torch.Tensor:
        """``forward(batch, ops, model)`` (blocks.decoder_forward) with torch at one thread; logits [M', V]."""
        if self._plan is None:
            self._plan = _Plan(model)
        nt = torch.get_num_threads()
        ops = CpuOps(self, cache, batch, nt if self.threads is None else self.threads)
        if nt == 1:
            return self.forward(forward, batch, ops)
        torch.set_num_threads(1)
        try:
            return self.forward(forward, batch, ops)
        finally:
            torch.set_num_threads(nt)


class CpuOps:
    def __init__(self, step: CpuStep, cache, batch: ForwardBatch, threads: int):
        self.step, self.cfg, self.cache, self.threads = step, step.cfg, cache, threads
        self.start, self.m = int(batch.start), int(batch.n)
        if self.start + self.m > cache.max_len:
            raise TrapetumError(f"context overflow: position {self.start + self.m} exceeds the KV cache size "
                                f"{cache.max_len}")
        self._tables: dict = {}
        self._qo = None

    def _rope(self, sliding: bool):
        """cos, sin fp32 [M, rd]: row r as the decode step at start + r computes it (alone: its own length)."""
        key = bool(sliding)
        if key not in self._tables:
            rope = self.step.rotaries[key]
            rows = [rope.cos_sin(torch.tensor([self.start + r])) for r in range(self.m)]
            cos = torch.cat([c for c, _ in rows]).float().contiguous()
            sin = torch.cat([s for _, s in rows]).float().contiguous()
            self._tables[key] = (cos, sin, rope.interleave)
        return self._tables[key]

    # -- norms, adds, heads --------------------------------------------------------------------
    def norm(self, x, w, eps=None, feeds=None):
        wt = w.weight
        if wt.dtype != torch.float32 or x.dtype != torch.float32:
            return w(x)
        if feeds is not None and eps is None and x.dim() == 2 and x.stride(1) == 1:
            a = self.step._norms.get(id(w))
            if a is None:
                a = self.step._norms[id(w)] = (w, (wt.data_ptr(), float(w.eps), float(w.offset)))
            return _Normed(x, w, a[1])
        shape = x.shape
        if x.dim() != 2 or x.stride(1) != 1:
            x = x.reshape(-1, shape[-1]).contiguous()
        return ho.rmsnorm(x, wt.detach(), w.eps, w.offset).view(shape)

    def split(self, x, sizes):
        return torch.split(x, list(sizes), dim=-1)

    def add(self, x, y):
        return x + y

    def heads(self, qkv):
        if not self.cfg.qk_norm and qkv.dtype == torch.float32 and qkv.dim() == 2 and qkv.stride(1) == 1:
            return qkv, None, None  # attend reads q, k, v out of the fused rows
        return row_heads(self.cfg, qkv)

    def sparsify(self, x, t, batch):
        """x * (|x| > t) with the rows at positions < DENSE_POSITIONS unchanged: TorchOps.sparsify's rule, an
        elementwise select (the same bits row by row or over the pass)."""
        if self.start >= DENSE_POSITIONS:  # no dense row in this pass (every decode step past the sink)
            return torch.where(x.abs() > t, x, torch.zeros((), dtype=x.dtype))
        dense = (torch.arange(self.start, self.start + self.m) < DENSE_POSITIONS).view(-1, 1)
        return torch.where((x.abs() > t) | dense, x, torch.zeros((), dtype=x.dtype))

    # -- projections -------------------------------------------------------------------------
    def project(self, w, x, residual=None):
        f = self.step.fused(w)
        if type(x) is _Normed:
            if f and (residual is None or residual.dtype == torch.float32) and x.x.shape[1] == f.in_features:
                if residual is not None and residual.stride(-1) != 1:
                    residual = residual.contiguous()
                return f.run(x.x, torch.empty(x.x.shape[0], f.out_features), residual, self.threads, x.args)
            x = x.value()
        if not f or x.dtype != torch.float32 or (residual is not None and residual.dtype != torch.float32):
            mods = tuple(w) if isinstance(w, (tuple, list)) else (w,)
            y = torch.cat([m(x) for m in mods], -1) if len(mods) > 1 else mods[0](x)
            return y if residual is None else residual + y
        x = x if x.stride(-1) == 1 else x.contiguous()
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        return f.run(x, torch.empty(x.shape[0], f.out_features), residual, self.threads)

    def gate_up(self, w, x, feeds=None):
        f = self.step.fused(w, self.cfg.hidden_act)
        if type(x) is _Normed:
            if f and x.x.shape[1] == f.in_features:
                return f.run(x.x, torch.empty(x.x.shape[0], f.out_features), None, self.threads, x.args)
            x = x.value()
        if not f or x.dtype != torch.float32:
            gate, up, act = w
            return act(gate(x)) * up(x)
        x = x if x.stride(-1) == 1 else x.contiguous()
        return f.run(x, torch.empty(x.shape[0], f.out_features), None, self.threads)

    # -- embedding and logits ----------------------------------------------------------------
    def embed(self, table, batch: ForwardBatch):
        x = table(batch.tokens.reshape(-1))
        if self.cfg.embed_scale is not None:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def logits(self, head, h):
        logits = self.project(head, h).float()
        cap = self.cfg.final_softcap
        return torch.tanh(logits / cap) * cap if cap is not None else logits

    def dense_layer(self, dl, x, p):
        """A whole layer in one call (CpuStep.dense_layer): x fp32 [M, D]; ``p`` its attention parameters."""
        cos, sin, inter = self._rope(p.sliding)
        return dl(x, cos, sin, inter, self.cache.k[p.layer], self.cache.v[p.layer], self.start, self.threads)

    # -- attention ---------------------------------------------------------------------------
    def attend(self, q, k, v, batch: ForwardBatch, p, feeds=None):
        cfg = self.cfg
        kc, vc = self.cache.k[p.layer][0], self.cache.v[p.layer][0]  # [Hkv, max_len, hd]
        cos, sin, inter = self._rope(p.sliding)
        if k is None:  # q: the fused q/k/v rows fp32 [M, (Hq + 2 Hkv) hd] (heads)
            if self._qo is None or self._qo.shape[0] != q.shape[0]:
                self._qo = torch.empty(q.shape[0], cfg.num_heads, cfg.head_dim)
            return ho.attend_fused(q, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cos, sin, kc, vc, self.start,
                                   cfg.scale, inter, cfg.sliding_window if p.sliding else None, cfg.attn_softcap,
                                   self._qo)
        if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
            q, k, v = q.float(), k.float(), v.float()
        hd = cfg.head_dim
        q, k, v = (t if t.stride(1) == hd and t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
        return ho.attend(q, k, v, cos, sin, kc, vc, self.start, cfg.scale, inter,
                         cfg.sliding_window if p.sliding else None, cfg.attn_softcap, checked=False)
