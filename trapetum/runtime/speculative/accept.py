"""Accepting drafts: the target's verify rows against the drafts, on the device. ``device_verdict`` computes the
round's accepted count n and emitted tokens without reading anything back (n from a cumulative product over the
accept flags); the synchronous loop reads them back at once (``judge``), the pipelined one a round later.

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


def device_verdict(sampler: Sampler, logits: torch.Tensor, greedy_rows: torch.Tensor | None, drafts: torch.Tensor,
                   q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The round's verdict on the device, nothing read back: (em int64 [k + 1], n int64 [1]); em[:n + 1] are the
    emitted tokens (the n accepted drafts, then the target's own), em[n + 1:] meaningless. logits fp32 [k + 1, V]
    (verify rows), greedy_rows [k + 1] their argmax (or None), drafts int64 [k] on the logits' device, q [k, V] or
    None. The random draws (sampling) are k uniforms then one multinomial over k + 1 rows, whatever n turns out:
    a fixed consumption of the sampler's generator per round. Does not update the sampler's penalty state."""
    k = drafts.shape[0]
    if sampler.greedy:
        if sampler.seen is None and greedy_rows is not None:
            c = greedy_rows[:k + 1]
        else:
            c = torch.argmax(sampler.processed(logits, drafts), -1)
        ok = c[:k] == drafts
        return c, ok.long().cumprod(0).sum().view(1)  # c[i] = d_{i+1} for i < n
    p = sampler.probs(logits, drafts)  # [k + 1, V]
    dev = p.device
    ar = torch.arange(k, device=dev)
    pd = p[ar, drafts]
    if q is None:
        qd = torch.ones_like(pd)
        # max(p - onehot(d), 0); a scatter, not an indexed assignment (index_put_ may synchronize on CUDA)
        resid = p[:k].scatter(1, drafts.view(-1, 1), 0.0)
    else:
        qd = q[ar, drafts]
        resid = (p[:k] - q).clamp_(min=0.0)
    u = torch.rand(k, generator=sampler.gen, device=dev)
    ok = u * qd < pd
    resid = torch.cat([resid, p[k:k + 1]])
    mass = resid.sum(-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp(min=1e-30), p)
    x = torch.multinomial(resid, 1, generator=sampler.gen).view(-1)  # [k + 1]: row r's draw, used when r = n
    n = ok.long().cumprod(0).sum().view(1)
    em = torch.where(torch.arange(k + 1, device=dev) < n, torch.cat([drafts, x[k:]]), x)
    return em, n


def judge(sampler: Sampler, logits: torch.Tensor, greedy_rows: torch.Tensor | None, drafts: torch.Tensor,
          q: torch.Tensor | None) -> Verdict:
    """device_verdict, read back (the synchronous loop's one sync per round)."""
    em, n = device_verdict(sampler, logits, greedy_rows, drafts, q)
    host = torch.cat([em, n]).tolist()
    acc = host[-1]
    return Verdict(host[:acc + 1], acc, em[:acc + 1])


def accept_emitted(sampler: Sampler, em: torch.Tensor, n: torch.Tensor) -> None:
    """sampler.accept(em[:n + 1]) without reading n back (the entries past n repeat em[n])."""
    if sampler.seen is not None:
        idx = torch.minimum(torch.arange(em.shape[0], device=em.device), n)
        sampler.accept(em.gather(0, idx))
