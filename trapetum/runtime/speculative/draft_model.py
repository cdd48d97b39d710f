"""A draft model: any model with the target's tokenizer (a smaller one of the family, or a lower-bit copy of the
target itself), drafting K tokens autoregressively in its own KV cache (the GPU engine's CUDA graphs, or the CPU
reference decoder).

Per round, with the sequence's last token at position p and the drafter's cache valid for positions < ``valid``:
one multi-row pass over the tokens at valid .. p (the catch-up: one token, or two when the previous round accepted
every draft, since the last draft itself never went through the drafter), whose last row gives draft 1, then K - 1
decode steps (greedy: the engine's argmax feeds the next step on the GPU; sampling: drawn from the drafter's own
distribution, which the loop receives as q). The drafts stay on the device. After the round the drafter's rows
p .. p + min(n, K - 1) hold the accepted tokens, so ``valid`` follows from the next round's position alone.

Pipelined (``propose_at``, pipeline.py): the catch-up pass runs over all L = k_prev + 1 rows of the previous
round's emitted tokens (n + 1 real, the rest padding) at the previous p + 1 (host-known), draft 1 is row n's
(gathered on the device), and the K - 1 steps start at p + 1 from the device position. Accepted drafts are
rewritten with the bits they had (VERIFY rows are bitwise decode steps); the padding rows past p are rewritten by
the steps, or by the next round's pass, before anything reads them.
"""
from __future__ import annotations

import torch

from ..sampling import GenerationSettings
from .drafter import Draft, DeviceContext, DraftContext, Drafter, draft_sampler, sample_rows
from .rows import Rows


def pending_tokens(ctx: DraftContext, valid: int) -> torch.Tensor:
    """The sequence's tokens at positions valid .. ctx.pos (on ctx.new's device when they are all in ``new``)."""
    c = ctx.pos + 1 - valid
    if 0 < c <= ctx.new.shape[0]:
        return ctx.new[-c:]
    return torch.tensor(ctx.seq[valid:ctx.pos + 1], dtype=torch.long, device=ctx.new.device)


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, rows: Rows, label: str = "draft model"):
        self.rows = rows
        self.label = label

    @property
    def host_free(self) -> bool:
        return self.rows.device_positions

    def begin(self, prompt: list[int], s: GenerationSettings, max_len: int, target_vocab: int, device) -> None:
        super().begin(prompt, s, max_len, target_vocab, device)
        self.cap = min(max_len, self.rows.max_len)
        self.off = len(prompt) >= self.cap  # a prompt the drafter cannot hold: no drafts (plain decoding)
        self.sampler = draft_sampler(s, target_vocab, self.rows.device)
        self.valid = len(prompt)
        self.last = None  # (p, k) of the previous round that drafted
        if not self.off:
            self.rows.prefill(prompt, self.cap)

    def _catch_up(self, ctx: DraftContext) -> None:
        if self.last is not None:
            p, k = self.last
            n = ctx.pos - p - 1  # drafts the target accepted
            self.valid = p + 1 + min(n, k - 1)
        self.last = None

    def propose(self, ctx: DraftContext, k: int) -> Draft | None:
        if self.off:
            return None
        self._catch_up(ctx)
        p = ctx.pos
        k = min(k, self.cap - p)  # draft rows reach p + k - 1
        if k <= 0:
            return None
        pend = pending_tokens(ctx, self.valid).to(self.rows.device)
        logits, greedy = self.rows.rows(pend, self.valid)
        self.last = (p, k)
        if self.sampler is None:
            out = torch.empty(k, dtype=torch.long, device=self.rows.device)
            out[:1].copy_(greedy[-1:])
            self.rows.greedy_steps(out[:1], p + 1, k - 1, out[1:])
            return Draft(out.clamp_(max=self.target_vocab - 1))
        toks, qs = [], []
        t, q = sample_rows(self.sampler, logits[-1:], self.target_vocab)
        toks.append(t)
        qs.append(q)
        for i in range(1, k):
            t, q = sample_rows(self.sampler, self.rows.step(t, p + i)[None], self.target_vocab)
            toks.append(t)
            qs.append(q)
        return Draft(torch.cat(toks), torch.cat(qs))

    def propose_at(self, ctx: DeviceContext, k: int) -> Draft | None:
        if self.off:
            return None
        if ctx.hi >= self.cap:  # the catch-up would pass the drafter's cache: no drafts from here on
            self.off = True
            return None
        k = max(0, min(k, self.cap - ctx.hi))  # the steps reach at + k - 1 <= hi + k - 1
        dev = self.rows.device
        n, at = ctx.n.to(dev), ctx.at.to(dev)
        logits, greedy = self.rows.rows_all(ctx.new.to(dev), ctx.base, logits=self.sampler is not None)
        if k == 0:
            return None
        if self.sampler is None:
            out = torch.empty(k, dtype=torch.long, device=dev)
            out[:1].copy_(greedy.index_select(0, n))
            self.rows.greedy_steps_at(out[:1], at + 1, k - 1, out[1:])
            return Draft(out.clamp_(max=self.target_vocab - 1))
        toks, qs = [], []
        t, q = sample_rows(self.sampler, logits.index_select(0, n), self.target_vocab)
        toks.append(t)
        qs.append(q)
        for i in range(1, k):
            t, q = sample_rows(self.sampler, self.rows.step_at(t, at + i)[None], self.target_vocab)
            toks.append(t)
            qs.append(q)
        return Draft(torch.cat(toks), torch.cat(qs))
