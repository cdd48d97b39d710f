"""Router scores and top-k of a mixture-of-experts layer in one launch, for DECODE / VERIFY rows (M = 1..16).

    route(logits [M, E], k, scoring, norm_topk, scale, bias=None) -> (weights fp32 [M, k], idx int32 [M, k])

What ``models/blocks/moe.select_experts`` computes without group limits (Mixtral, Qwen2/3-MoE, DeepSeek-V2 "greedy"):
scores = softmax(logits) or sigmoid(logits) in fp32; the k best of scores (+ bias: DeepSeek-V3's correction,
used for the choice only), ties to the lower expert index, in descending order; the chosen scores, divided by their
sum (summed in slot order 0..k-1) with ``norm_topk``, times ``scale``. One program per row (E up to 1,024 in
registers): a row's result does not depend on the other rows (tested), no host sync (capturable). Group-limited
routing (DeepSeek-V3's n_group / topk_group) stays with select_experts (``applies`` says which configs this
kernel serves). The reference is select_experts itself; the scores differ from its by fp32 rounding (its sigmoid
is computed in float64), so a choice can differ from it only between experts whose scores tie to within that.
"""
from __future__ import annotations

import torch

from .triton_util import HAVE_TRITON, triton_ok

if HAVE_TRITON:
    import triton
    import triton.language as tl

MAX_EXPERTS = 1024


def applies(cfg) -> bool:
    """True if the kernel computes this config's routing (no group limits, E <= MAX_EXPERTS)."""
    grouped = cfg.router_topk != "greedy" and cfg.n_group > 1
    return not grouped and cfg.num_experts <= MAX_EXPERTS and cfg.router_scoring in ("softmax", "sigmoid")


def available(device: torch.device) -> bool:
    return triton_ok(device)


if HAVE_TRITON:

    @triton.jit(do_not_specialize=("x_ptr", "w_ptr", "i_ptr"))
    def _route_kernel(x_ptr, b_ptr, w_ptr, i_ptr, E, scale, K: tl.constexpr, SIGMOID: tl.constexpr,
                      HAS_BIAS: tl.constexpr, NORM: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr):
        m = tl.program_id(0)
        ar = tl.arange(0, EP)
        emask = ar < E
        x = tl.load(x_ptr + m * E + ar, mask=emask, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            s = 1.0 / (1.0 + tl.exp(-x))
        else:
            e = tl.exp(x - tl.max(x, 0))
            e = tl.where(emask, e, 0.0)
            s = e / tl.sum(e, 0)
        choice = s
        if HAS_BIAS:
            choice = s + tl.load(b_ptr + ar, mask=emask, other=0.0)
        choice = tl.where(emask, choice, float("-inf"))
        kr = tl.arange(0, KP)
        wv = tl.zeros([KP], dtype=tl.float32)
        iv = tl.zeros([KP], dtype=tl.int32)
        total = 0.0
        for j in tl.static_range(K):
            best = tl.max(choice, 0)
            i = tl.min(tl.where(choice == best, ar, EP), 0)
            wj = tl.sum(tl.where(ar == i, s, 0.0), 0)
            total = total + wj
            wv = tl.where(kr == j, wj, wv)
            iv = tl.where(kr == j, i, iv)
            choice = tl.where(ar == i, float("-inf"), choice)
        if NORM:
            wv = wv / (total + 1e-20)
        wv = wv * scale
        tl.store(w_ptr + m * K + kr, wv, mask=kr < K)
        tl.store(i_ptr + m * K + kr, iv, mask=kr < K)


def route(logits: torch.Tensor, k: int, scoring: str, norm_topk: bool, scale: float = 1.0,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [M, k], expert ids int32 [M, k]) for router logits [M, E] (module docstring)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating [M, E] tensor, got {tuple(getattr(logits, 'shape', ()))}")
    M, E = logits.shape
    if not (isinstance(k, int) and 1 <= k <= E):
        raise ValueError(f"k: must be 1..{E}, got {k!r}")
    if E > MAX_EXPERTS:
        raise ValueError(f"logits: {E} experts, the kernel takes at most {MAX_EXPERTS}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring: must be 'softmax' or 'sigmoid', got {scoring!r}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.numel() != E):
        raise ValueError(f"bias: expected [{E}] values")
    if not triton_ok(logits.device):
        raise ValueError("device: the routing kernel needs a CUDA device or TRITON_INTERPRET=1")
    x = logits.contiguous()
    w = torch.empty(M, k, dtype=torch.float32, device=x.device)
    i = torch.empty(M, k, dtype=torch.int32, device=x.device)
    b = bias.float().contiguous() if bias is not None else w
    _route_kernel[(M,)](x, b, w, i, E, float(scale), K=k, SIGMOID=scoring == "sigmoid", HAS_BIAS=bias is not None,
                        NORM=bool(norm_topk), EP=max(16, triton.next_power_of_2(E)),
                        KP=max(2, triton.next_power_of_2(k)), num_warps=4)
    return w, i
