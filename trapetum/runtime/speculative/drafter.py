"""The drafter interface: what every kind of drafter (draft model, PARD, n-gram lookup, scripted) gives the loop.

    begin(prompt, settings, max_len, target_vocab, device)
                        a new sequence; a model drafter prefills its own KV cache here
    propose(ctx, k) -> Draft | None
                        at most k tokens that may follow ctx.seq (ctx.pos = position of its last token);
                        called once per round, k = 0 included (a drafter that keeps a cache tracks it by position)

``DraftContext``: ``seq`` the host list of every token so far (prompt + output, the last one not yet in the target's
cache), ``new`` the same tokens' tail on the target's device (the tokens emitted by the previous round, its last one
at ``pos``; the first token after the prompt on the first call), ``pos`` = len(seq) - 1.

The pipelined loop (pipeline.py) asks drafters whose ``device_side`` is true for ``propose_at(dctx, k)`` instead:
the same proposal from device tensors alone, queued before the previous round's verdict is read back.
``DeviceContext``: ``new`` [L] the previous round's emitted tokens on the device, of which the first n + 1 are real
(the rest padding, any ids), ``n`` int64 [1] on the device, ``base`` the host position of ``new[0]``, ``at`` int64
[1] on the device = base + n, the position of the last real token (the ``pos`` of propose), ``hi`` = base + L - 1
on the host, the highest position ``at`` can hold. A drafter's pass over ``new`` may write cache rows up to ``hi``:
rows past ``at`` are rewritten before anything reads them (a forward reads positions up to its own only).

``Draft``: ``tokens`` int64 [k'] (k' <= k) on any device (model drafters keep theirs on the target's device, so
nothing is read back per drafter step), ids < the target's vocabulary; ``q`` fp32 [k', V_target] the distribution
each token was drawn from, or None for a deterministic proposal (q one-hot at the token). Exactness never depends
on the drafter: the loop verifies every token.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..sampling import GenerationSettings, Sampler


@dataclass
class DraftContext:
    seq: list[int]
    new: torch.Tensor
    pos: int


@dataclass
class DeviceContext:
    new: torch.Tensor
    n: torch.Tensor
    base: int
    at: torch.Tensor
    hi: int


@dataclass
class Draft:
    tokens: torch.Tensor
    q: torch.Tensor | None = None


class Drafter:
    """Base class: a drafter that proposes nothing (every round is one verify row: plain decoding)."""

    name = "none"
    device_side = True  # propose_at exists: the pipelined loop can run this drafter
    host_free = True  # propose_at reads nothing back (the pipelined loop is chosen for it automatically)

    def begin(self, prompt: list[int], s: GenerationSettings, max_len: int, target_vocab: int,
              device: torch.device) -> None:
        self.target_vocab = target_vocab
        self.device = device

    def propose(self, ctx: DraftContext, k: int) -> Draft | None:
        return None

    def propose_at(self, ctx: DeviceContext, k: int) -> Draft | None:
        return None


DRAFT_SEED_OFFSET = 0x5EED  # the drafter's generator: the user's seed plus this (reproducible, not the target's)


def draft_sampler(s: GenerationSettings, vocab: int, device) -> Sampler | None:
    """The sampler a model drafter draws its tokens from: None for greedy settings (drafts are argmaxes), else the
    user's temperature / top-k / top-p / min-p without the repetition penalty (any q keeps the output exact; this
    one is close to the target's), seeded from the user's seed."""
    if s.temperature == 0:
        return None
    ds = replace(s, repetition_penalty=1.0, seed=None if s.seed is None else s.seed + DRAFT_SEED_OFFSET, stop=[])
    return Sampler(ds, vocab, device)


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Drafter logits [m, V_d] cut or padded (with -inf) to the target's vocabulary [m, vocab]."""
    vd = logits.shape[-1]
    if vd == vocab:
        return logits
    if vd > vocab:
        return logits[..., :vocab]
    pad = torch.full((*logits.shape[:-1], vocab - vd), float("-inf"), dtype=logits.dtype, device=logits.device)
    return torch.cat([logits, pad], -1)


def sample_rows(sampler: Sampler, logits: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [m], q [m, vocab]) drawn from the drafter's logits [m, V_d] restricted to the target's vocabulary."""
    q = sampler.probs(fit_vocab(logits.float(), vocab))
    return sampler.sample(q), q
