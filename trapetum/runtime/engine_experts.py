"""The engine's experts of one MoE layer stacked for the expert GEMVs (kernels/expert_gemv.py).

``stack_experts(experts)`` builds, once at load, the layer's stacks ([E, ...] tensors in the kernels' layouts, see
kernels/expert_gemv.py) from the per-expert projections, and makes every expert's projection a view of its slice
(no second copy: the per-expert forms still serve PREFILL's dequantize-and-matmul and the torch fallback).
Codebook projections whose codes are all in the tensor-core kernels' tiled layout (4-/8-bit, 64 code bytes per
row | in, CUDA kernels on and built: ``CodebookProjection`` decided it) are stacked tiled and run by the CUDA expert
GEMVs (kernels/expert_gemv_mma.py, ``ExpertStack.tiled``); any other codebook stack keeps canonical codes (the
projections are untiled) and runs the Triton expert kernels. Stacked when every expert is one scheme the kernels
know with the same shapes and no biases:
    "codebook"  InterleavedGateUp + CodebookProjection, one bit width in {2, 4, 8}
    "fp16"      DenseGateUp + DenseProjection
    "2x8"       AQLM 2x8 (kernels/expert_gemv_2x8.py): gate/up one AdditiveProjection of the two parts (packed or
                not), down one part; canonical codes stacked, the experts' packed copies dropped (their gemv then
                runs the unpacked form, and gate/up becomes the SeparateGateUp of that projection)
anything else (1x16 codes, separate gate/up projections, biases, mixed bit widths) gives None: the layer keeps the
all-experts path of runtime/engine_ops.py.

``ExpertSet`` is the list of ExpertWeights the block sees (models/blocks/moe.py hands it to ``ops.experts``) with
the stack beside it.

``prefill_experts`` is PREFILL's form (any scheme): the (token, slot) pairs grouped by expert (a stable sort; the
counts read on the host: prefill is not captured), each expert's projections over its tokens (``ops.project`` /
``ops.gate_up``: dequantize + matmul), its outputs times their weights written to their (token, slot) places, the
k slots summed in slot order: deterministic (no atomics), k / E of the work of every expert over every token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import expert_gemv as xg
from ..kernels import expert_gemv_2x8 as x8
from ..kernels import expert_gemv_mma as xm
from ..schemes.aqlm import AdditiveProjection, PackedGateUp
from ..schemes.base import SeparateGateUp
from ..schemes.codebook import CodebookProjection, InterleavedGateUp
from ..schemes.dense import DenseGateUp, DenseProjection
from ..settings import DEFAULT_KERNELS, KernelOptions


@dataclass
class ExpertStack:
    """One layer's experts as stacks (kernels/expert_gemv.py layouts); ``gu_cb`` / ``dn_cb`` None for fp16."""
    scheme: str
    bits: int
    f: int
    act: str
    gu_w: torch.Tensor
    gu_cb: torch.Tensor | None
    dn_w: torch.Tensor
    dn_cb: torch.Tensor | None
    gu_sc: torch.Tensor | None = None  # 2x8: scales
    dn_sc: torch.Tensor | None = None
    tiled: bool = False  # codebook: codes tiled, run by the CUDA expert GEMVs (kernels/expert_gemv_mma.py)

    def run(self, h: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gather: bool = True,
            kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
        """fp16 [M, D]: sum over the k slots of weights[m, j] * expert_{idx[m, j]}(h[m]), two launches (CUDA: three,
        the last the slot sum)."""
        if self.tiled:
            a = xm.expert_gate_up_mma(h, idx, self.gu_w, self.gu_cb, self.bits, self.f, self.act, tiled=True,
                                      kopts=kopts)
            return xm.expert_down_mma(a, idx, weights, self.dn_w, self.dn_cb, self.bits, tiled=True, kopts=kopts)
        if self.scheme == "2x8":
            a = x8.expert_gate_up_2x8(h, idx, self.gu_w, self.gu_cb, self.gu_sc, self.act)
            return x8.expert_down_2x8(a, idx, weights, self.dn_w, self.dn_cb, self.dn_sc)
        a = xg.expert_gate_up(h, idx, self.gu_w, self.gu_cb, self.bits, self.f, self.act, gather=gather)
        return xg.expert_down(a, idx, weights, self.dn_w, self.dn_cb, self.bits, gather=gather)


class ExpertSet(list):
    """A layer's ExpertWeights, with ``stack`` (ExpertStack or None) beside them."""
    stack: ExpertStack | None = None


def _same(values) -> bool:
    return len(set(values)) == 1


def stack_experts(experts: list) -> ExpertSet:
    """ExpertSet of ``experts`` (ExpertWeights), stacked where the module docstring says."""
    out = ExpertSet(experts)
    if not experts:
        return out
    gus, dns = [e.gate_up for e in experts], [e.down for e in experts]
    if all(isinstance(g, InterleavedGateUp) for g in gus) and all(isinstance(d, CodebookProjection) for d in dns):
        ps = [g.proj for g in gus]
        if not (_same([p.bits for p in ps + dns]) and ps[0].bits in (2, 4, 8)
                and _same([(p.out_features, p.in_features) for p in ps]) and _same([g.f for g in gus])
                and _same([g.act for g in gus]) and _same([(d.out_features, d.in_features) for d in dns])
                and all(p.bias is None for p in ps + dns) and dns[0].in_features == gus[0].f):
            return out
        if ps[0].bits in (4, 8) and all(p.tiled for p in ps + dns):  # the CUDA expert GEMVs' layout: keep it
            gu_w, dn_w = torch.stack([p.codes for p in ps]), torch.stack([d.codes for d in dns])
            gu_cb, dn_cb = torch.stack([p.codebook for p in ps]), torch.stack([d.codebook for d in dns])
            for e, (p, d) in enumerate(zip(ps, dns)):
                p.codes, p.codebook, d.codes, d.codebook = gu_w[e], gu_cb[e], dn_w[e], dn_cb[e]
            out.stack = ExpertStack("codebook", ps[0].bits, gus[0].f, gus[0].act, gu_w, gu_cb, dn_w, dn_cb,
                                    tiled=True)
            return out
        gu_w = torch.stack([p.canonical_codes() for p in ps])
        gu_cb = torch.stack([p.codebook for p in ps])
        dn_w = torch.stack([d.canonical_codes() for d in dns])
        dn_cb = torch.stack([d.codebook for d in dns])
        for e, p in enumerate(ps + dns):
            w, cb = (gu_w, gu_cb) if e < len(ps) else (dn_w, dn_cb)
            p.codes, p.codebook, p.tiled = w[e % len(ps)], cb[e % len(ps)], False
        out.stack = ExpertStack("codebook", ps[0].bits, gus[0].f, gus[0].act, gu_w, gu_cb, dn_w, dn_cb)
    elif all(isinstance(g, DenseGateUp) for g in gus) and all(isinstance(d, DenseProjection) for d in dns):
        js = [g.joint for g in gus]
        if not (_same([tuple(j.w.shape) for j in js]) and _same([g.act for g in gus])
                and _same([tuple(d.w.shape) for d in dns]) and all(p.bias is None for p in js + dns)
                and dns[0].in_features == gus[0].f and js[0].out_features == 2 * gus[0].f):
            return out
        gu_w = torch.stack([j.w for j in js])
        dn_w = torch.stack([d.w for d in dns])
        for e, (j, d) in enumerate(zip(js, dns)):
            j.w, d.w = gu_w[e], dn_w[e]
        out.stack = ExpertStack("fp16", 4, gus[0].f, gus[0].act, gu_w, None, dn_w, None)
    else:
        _stack_2x8(experts, out)
    return out


def _pair(g):
    """The AdditiveProjection of a fused 2x8 gate/up form, or None."""
    if isinstance(g, PackedGateUp):
        return g.proj
    if isinstance(g, SeparateGateUp) and g.up is None and isinstance(g.gate, AdditiveProjection):
        return g.gate
    return None


def _2x8_parts_ok(p: AdditiveProjection, n: int) -> bool:
    return len(p.parts) == n and all(
        tuple(cb.shape) == (2, 256, 1, 8) and b is None and p._codes(i).dtype == torch.int8
        and p._codes(i).shape[-1] == 2 for i, (_, cb, _, b) in enumerate(p.parts))


def _stack_2x8(experts: list, out: ExpertSet) -> None:
    pairs, dns = [_pair(e.gate_up) for e in experts], [e.down for e in experts]
    if not (all(p is not None and _2x8_parts_ok(p, 2) for p in pairs)
            and all(isinstance(d, AdditiveProjection) and _2x8_parts_ok(d, 1) for d in dns)
            and _same([tuple(p._codes(i).shape) for p in pairs for i in (0, 1)])
            and _same([tuple(d._codes(0).shape) for d in dns]) and _same([g.act for g in (e.gate_up for e in experts)])
            and dns[0].in_features == pairs[0].out_features // 2 and pairs[0].in_features % 8 == 0
            and dns[0].in_features % 8 == 0):
        return
    f, act = pairs[0].out_features // 2, experts[0].gate_up.act
    gu_c = torch.stack([torch.stack([p._codes(0), p._codes(1)]) for p in pairs]).contiguous()
    gu_cb = torch.stack([torch.stack([p.parts[i][1].reshape(2, 256, 8) for i in (0, 1)]) for p in pairs]).contiguous()
    gu_sc = torch.stack([torch.stack([p.parts[i][2].reshape(-1) for i in (0, 1)]) for p in pairs]).contiguous()
    dn_c = torch.stack([d._codes(0) for d in dns]).contiguous()
    dn_cb = torch.stack([d.parts[0][1].reshape(2, 256, 8) for d in dns]).contiguous()
    dn_sc = torch.stack([d.parts[0][2].reshape(-1) for d in dns]).contiguous()
    for e, (p, d, ex) in enumerate(zip(pairs, dns, experts)):
        p.parts = [(gu_c[e, i], gu_cb[e, i].view(2, 256, 1, 8), gu_sc[e, i].view(-1, 1, 1, 1), None) for i in (0, 1)]
        d.parts = [(dn_c[e], dn_cb[e].view(2, 256, 1, 8), dn_sc[e].view(-1, 1, 1, 1), None)]
        p.packed = d.packed = None
        ex.gate_up = SeparateGateUp(act, p)
    out.stack = ExpertStack("2x8", 2, f, act, gu_c, gu_cb, dn_c, dn_cb, gu_sc, dn_sc)


def prefill_experts(ops, experts, h: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[T, D] in h's dtype: sum over the k slots of weights[t, j] * expert_{idx[t, j]}(h[t]) (module docstring)."""
    T, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.sort(flat, stable=True)[1]
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    wflat = weights.reshape(-1, 1).float()
    buf = torch.zeros(T * k, ops.cfg.hidden_size, dtype=torch.float32, device=h.device)
    s = 0
    for ex, n in zip(experts, counts):
        if n:
            sel = order[s:s + n]
            y = ops.project(ex.down, ops.gate_up(ex.gate_up, h.index_select(0, sel // k)))
            buf[sel] = y.float() * wflat[sel]
            s += n
    buf = buf.view(T, k, -1)
    out = buf[:, 0]
    for j in range(1, k):
        out = out + buf[:, j]
    return out.to(h.dtype)
