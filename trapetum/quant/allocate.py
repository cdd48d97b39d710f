"""Sensitivity-based mixed precision: bits per layer and projection under a size target (``quantize
--target-bpw B`` / ``--target-size MB``).

Sensitivity (``measure``): for every layer projection p and every candidate width b of ``Recipe.alloc_bits``
(default 2, 3, 4, 8), the codebook fit the recipe would store (``codebook_fit.fit_rows``, its storage for b) and
its expected output error under the calibration's E[x^2]:

    D_p(b) = sum_r sum_j E[x_j^2] (W[r, j] - Q_b[r, j])^2      (the diagonal part of E || (W - Q_b) x ||^2)

an absolute figure (not relative to the weights), so a projection whose error reaches the residual stream in
large amounts counts more than one whose error is small in absolute terms. Cost: one fit per projection and
width (k-means with at most 20 Lloyd iterations), i.e. a few times the k-means of the plain recipe.

Allocation (``allocate``): every projection starts at the smallest width; the greedy step takes, among all
projections and all wider widths, the upgrade of largest error decrease per added byte that still fits the
budget, until none fits (the marginal-return greedy of multiple-choice knapsack). Bytes are the exact stored
bytes of each choice (codes, codebook storage, bias), from ``quantize.codebook_spec``; the rest of the file
(embedding, head, norms, header with its tokenizer) is fixed. Projections the user pinned (``--layer-bits``,
``--keep-fp16``) keep their setting and count as fixed bytes.

The result is recorded in the recipe (``allocation``: target, widths, chosen bits per projection and the
measured D_p(b)) and carried out as exact-name ``bits_overrides`` placed after the user's own.
"""
from __future__ import annotations

import fnmatch
import json
import math
from typing import Any, Callable

import torch

from ..errors import ConfigError
from ..schemes import registry
from ..schemes.record import QuantRecord
from .codebook_fit import fit_rows

__all__ = ["measure", "allocate", "header_estimate"]


def header_estimate(ckpt, n_alloc: int) -> int:
    """Header bytes that ``quantize.planned_bytes`` leaves out: the tokenizer JSON as it sits in the metadata
    string (escaped twice), the config (2 KiB) and the allocation's own record (~400 bytes per projection: its
    bits override, chosen bits and four measured errors, each name quoted and escaped)."""
    tk = ckpt.tokenizer.to_dict() if ckpt.tokenizer is not None else None
    return len(json.dumps(json.dumps(tk))) + 2048 + 400 * n_alloc


def pinned(recipe, name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in recipe.keep_fp16) or any(
        fnmatch.fnmatchcase(name, p) for p, _ in recipe.bits_overrides)


def measure(ckpt, jobs: list, recipe, stats: dict | None, device: str = "cpu",
            progress: Callable[[int, int], None] | None = None) -> dict[str, dict[int, float]]:
    """{projection: {bits: D_p(bits)}} for the layer jobs of a plan (``quantize._Job``)."""
    out: dict[str, dict[int, float]] = {}
    T = ckpt.tensors
    for k, j in enumerate(jobs):
        x = T[j.src]
        W = (registry.dequantize(x, torch.float32) if isinstance(x, QuantRecord) else x).float()
        imp = None if stats is None or not recipe.weighted else stats.get(j.imp)
        w = torch.ones(W.shape[1], dtype=torch.float64) if imp is None else imp.double()
        row: dict[int, float] = {}
        for b in recipe.alloc_bits:
            book, codes, _, _ = fit_rows(W, b, imp, storage=recipe.storage_for(b), group_rows=recipe.head_group_rows,
                                         iters=min(recipe.iters, 20), starts=recipe.starts, device=device)
            d = W.double() - torch.gather(book.double(), 1, codes.long())
            row[b] = float((d * d * w).sum())
        out[j.out] = row
        if progress is not None:
            progress(k + 1, len(jobs))
    return out


def allocate(sens: dict[str, dict[int, float]], nbytes: dict[str, dict[int, int]], budget: int,
             fixed: int) -> dict[str, int]:
    """Bits per projection (see the module docstring); ``fixed`` bytes are outside the choice. ConfigError when
    even the smallest widths exceed ``budget``."""
    cur = {n: min(c) for n, c in nbytes.items()}
    total = fixed + sum(nbytes[n][b] for n, b in cur.items())
    if total > budget:
        raise ConfigError(f"the size target ({budget / 1e6:.2f} MB) is below the smallest file of these widths "
                          f"({total / 1e6:.2f} MB with every projection at {min(min(c) for c in nbytes.values())} bits)")
    while True:
        best = None
        for n, b in cur.items():
            for b2, nb in nbytes[n].items():
                extra = nb - nbytes[n][b]
                if b2 <= b or total + extra > budget:
                    continue
                gain = sens[n][b] - sens[n][b2]
                ratio = gain / max(extra, 1)
                if gain > 0 and (best is None or ratio > best[0]):
                    best = (ratio, n, b2, extra)
        if best is None:
            return cur
        _, n, b2, extra = best
        cur[n], total = b2, total + extra


def summary(target: dict[str, Any], bits: dict[str, int], sens: dict[str, dict[int, float]]) -> dict[str, Any]:
    """The recipe's ``allocation`` record (errors to 4 significant digits)."""
    def r4(v: float) -> float:
        return float(f"{v:.4g}") if math.isfinite(v) else 0.0
    hist: dict[str, int] = {}
    for b in bits.values():
        hist[str(b)] = hist.get(str(b), 0) + 1
    return {**target, "projections_at": hist, "bits": dict(bits),
            "sensitivity": {n: {str(b): r4(v) for b, v in row.items()} for n, row in sens.items()}}


def plan_bits(ckpt, recipe, plan, stats: dict | None, device: str = "cpu",
              log: Callable[[str], None] | None = None):
    """The recipe with its ``target_bpw`` / ``target_mb`` carried out: measured, allocated, and returned as a new
    Recipe whose ``bits_overrides`` end with one exact-name entry per allocated projection and whose
    ``allocation`` records it (``plan``: ``plan_quantization`` of ``recipe``)."""
    from dataclasses import replace

    from .quantize import codebook_spec, planned_bytes

    log = log or (lambda s: None)
    jobs = [j for j in plan.jobs if j.kind == "proj" and j.layer is not None and not pinned(recipe, j.out)]
    if not jobs:
        raise ConfigError("--target-bpw / --target-size: every projection is pinned by --layer-bits / --keep-fp16")

    def spec_bytes(j, b: int) -> int:
        q = codebook_spec(j.shape, b, j.bias_src is not None or j.record_bias, recipe.storage_for(b),
                          recipe.head_group_rows)
        return sum(t.nbytes for t in q.tensors.values()) + (q.bias.nbytes if q.bias is not None else 0)

    nbytes = {j.out: {b: spec_bytes(j, b) for b in recipe.alloc_bits} for j in jobs}
    planned = {j.out: spec_bytes(j, j.bits) if j.bits is not None else 0 for j in jobs}
    whole = planned_bytes(plan) + header_estimate(ckpt, len(jobs))
    fixed = whole - sum(planned.values())
    if recipe.target_mb is not None:
        budget, target = int(recipe.target_mb * 1e6), {"target_size_mb": recipe.target_mb}
    else:  # bits per weight of the layer projections, codebooks included
        q_all = {n: s for n, s in plan.quantized.items() if n.startswith("model.layers.")}
        dense_projs = {n: t for n, t in plan.dense.items() if n.startswith("model.layers.") and n.endswith("_proj.weight")}
        weights = sum(math.prod(s.shape) for s in q_all.values()) + sum(math.prod(t.shape) for t in dense_projs.values())
        other = sum(sum(t.nbytes for t in s.tensors.values()) for n, s in q_all.items()
                    if n[:-len(".weight")] not in planned)
        other += sum(t.nbytes for t in dense_projs.values())
        budget, fixed = int(recipe.target_bpw * weights / 8), other
        target = {"target_bpw": recipe.target_bpw}
    log(f"mixed precision: measuring {len(jobs)} projections at {', '.join(map(str, recipe.alloc_bits))} bits ...")
    sens = measure(ckpt, jobs, recipe, stats, device)
    bits = allocate(sens, nbytes, budget, fixed)
    got = fixed + sum(nbytes[n][b] for n, b in bits.items())
    hist = ", ".join(f"{sum(1 for b in bits.values() if b == k)} at {k}" for k in sorted(set(bits.values())))
    log(f"mixed precision: {hist} bits; planned {got / 1e6:.2f} MB against the budget {budget / 1e6:.2f} MB"
        + (" (layer projections)" if recipe.target_mb is None else ""))
    return replace(recipe, bits_overrides=list(recipe.bits_overrides) + [(n, b) for n, b in bits.items()],
                   allocation=summary({**target, "alloc_bits": list(recipe.alloc_bits),
                                       "planned_bytes": got, "budget_bytes": budget}, bits, sens))
