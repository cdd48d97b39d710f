"""Accepting drafts: the target's verify rows against the drafts, on the device; one read-back per round.

The verify pass ran rows [last, d_1 .. d_k] at p .. p + k; row r holds the target's logits for position p + r + 1
as if d_1 .. d_r had been emitted (bitwise the decode step there).

Greedy (temperature 0): c_r = the target's choice of row r (its argmax; with a repetition penalty the argmax of the
penalized row, which sees d_1 .. d_r in the penalty state). n = the longest prefix with d_{r+1} = c_r; emitted:
c_0 .. c_n (the n drafts and the target's own next token), which is token for token what plain greedy decoding emits.

Sampling (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023): p_r = the target's distribution of row r
(Sampler.probs: temperature, top-k, top-p, min-p, repetition penalty, row r seeing d_1 .. d_r), q_r the drafter's
(one-hot at d_{r+1} for a deterministic drafter). Draft r + 1 is accepted when u_r < p_r(d) / q_r(d), u_r uniform;
at the first rejection r the next token is drawn from the residual norm(max(p_r - q_r, 0)); when all k are accepted
the bonus token is drawn from p_k. Every emitted token is then distributed exactly as plain sampling's. Random draws
come from the target sampler's seeded generator (reproducible).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import Sampler


@dataclass
class Verdict:
    tokens: list[int]  # emitted this round, in order (n accepted drafts + one token of the target's)
    accepted: int  # n
    emitted: torch.Tensor  # the same tokens on the device [n + 1]


def judge(sampler: Sampler, logits: torch.Tensor, greedy_rows: torch.Tensor | None, drafts: torch.Tensor,
          q: torch.Tensor | None) -> Verdict:
    """logits fp32 [k + 1, V] (verify rows), greedy_rows [k + 1] their argmax (or None), drafts int64 [k] on the
    logits' device, q [k, V] or None. Reads back one small tensor. Does not update the sampler's penalty state."""
    k = drafts.shape[0]
    if sampler.greedy:
        if sampler.seen is None and greedy_rows is not None:
            c = greedy_rows[:k + 1]
        else:
            c = torch.argmax(sampler.processed(logits, drafts), -1)
        host = torch.cat([c, drafts]).tolist()  # the round's one sync
        choice, d = host[:k + 1], host[k + 1:]
        n = 0
        while n < k and d[n] == choice[n]:
            n += 1
        return Verdict(choice[:n + 1], n, c[:n + 1])
    p = sampler.probs(logits, drafts)  # [k + 1, V]
    dev = p.device
    ar = torch.arange(k, device=dev)
    pd = p[ar, drafts]
    if q is None:
        qd = torch.ones_like(pd)
        resid = p[:k].clone()
        resid[ar, drafts] = 0.0  # max(p - onehot(d), 0)
    else:
        qd = q[ar, drafts]
        resid = (p[:k] - q).clamp_(min=0.0)
    u = torch.rand(k, generator=sampler.gen, device=dev)
    ok = u * qd < pd
    resid = torch.cat([resid, p[k:k + 1]])
    mass = resid.sum(-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp(min=1e-30), p)
    x = torch.multinomial(resid, 1, generator=sampler.gen).view(-1)  # [k + 1]: row r's draw, used when r = n
    host = torch.cat([drafts, x, ok.long()]).tolist()
    d, xs, oks = host[:k], host[k:2 * k + 1], host[2 * k + 1:]
    n = 0
    while n < k and oks[n]:
        n += 1
    emitted = torch.cat([drafts[:n], x[n:n + 1]])
    return Verdict(d[:n] + [xs[n]], n, emitted)
