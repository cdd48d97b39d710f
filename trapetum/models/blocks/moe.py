"""Mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3):

    h = norm(x); weights, experts = route(h)         top-k experts per row and their weights (``select_experts``)
    y = sum_j weights_j * expert_{experts_j}(h)       each expert a gated MLP (SwiGLU) of moe_intermediate_size
    y = y + shared(h)                                 DeepSeek's shared experts / Qwen2-MoE's shared expert, the
                                                      latter scaled by sigmoid(w . h)
    x = x + y                                         (+ post_norm(y) with sandwich norms)

Parameters ``p`` (by role): norm, router (the backend's router: weight [E, D], correction bias or None), experts
(one gate_up / down pair per expert), shared (gate_up / down, or None), shared_gate (or None), post_norm.

``select_experts`` is the routing, written once in torch for every executor (device-side, no host sync: it is
captured in the engine's graphs): scores softmax or sigmoid of the fp32 router logits; the choice over
score (+ correction bias), optionally limited to the topk_group best groups (DeepSeek-V2: a group's best score;
DeepSeek-V3 "noaux_tc": the sum of its two best); the chosen experts' scores (without the bias), renormalized
(norm_topk_prob), times routed_scaling_factor. Ties go to the lower expert index (a stable sort, not ``topk``,
whose tie order is unspecified), so a row's choice does not depend on the other rows of its batch.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row, ties to the lower index (int64 [..., k])."""
    return torch.sort(x, dim=-1, descending=True, stable=True)[1][..., :k]


def select_experts(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits fp32 [..., E] -> (weights fp32 [..., k], expert indices int64 [..., k]) (module docstring)."""
    logits = logits.float()
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    if cfg.router_scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        # in float64, rounded: a CPU elementwise kernel computes its vector body and its scalar tail with different
        # float32 formulas, so a row's sigmoid would depend on where the row falls in the batch
        scores = torch.sigmoid(logits.double()).float()
    choice = scores if bias is None else scores + bias.float()
    if cfg.router_topk != "greedy" and cfg.n_group > 1:
        g = cfg.n_group
        grouped = choice.view(*choice.shape[:-1], g, E // g)
        if cfg.router_topk == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
        else:
            group_scores = grouped.amax(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(-1, _top(group_scores, cfg.topk_group), True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)
        # V2 masks with 0 (softmax scores are positive), V3 with -inf (bias-corrected scores can be negative)
        choice = choice.masked_fill(~keep, float("-inf") if cfg.router_topk == "noaux_tc" else 0.0)
    idx = _top(choice, k)
    w = scores.gather(-1, idx)
    if cfg.norm_topk_prob:
        # the k weights summed left to right, elementwise over rows: a reduction kernel's order may depend on the
        # number of rows, this does not
        total = w[..., 0]
        for j in range(1, k):
            total = total + w[..., j]
        w = w / (total.unsqueeze(-1) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        w = w * cfg.routed_scaling_factor
    return w, idx


def forward(x, batch, ops, p):
    h = ops.norm(x, p.norm)
    weights, experts = ops.route(p.router, h)
    y = ops.experts(p.experts, h, weights, experts)
    if p.shared is not None:
        s = ops.project(p.shared.down, ops.gate_up(p.shared.gate_up, h))
        if p.shared_gate is not None:
            s = ops.sigmoid_gate(p.shared_gate, h, s)
        y = ops.add(y, s)
    if p.post_norm is not None:
        y = ops.norm(y, p.post_norm)
    return ops.add(x, y)
