"""Drafters that do not predict: scripted proposals (the benchmark's modeled acceptance) and adversarial ones (tests).

    ScriptedDrafter(script)     proposes script[p + 1 .. p + k] at position p (a device tensor: no host work); past
                                the script's end, token 0. ``modeled(truth, alpha, ...)`` builds the script from the
                                target's own output ``truth`` (prompt + plain greedy continuation), each position kept
                                with probability ``alpha`` and otherwise replaced by another token, independently: the
                                drafts then agree with the target with per-token probability alpha ("modeled
                                acceptance"). ``inner``: a real drafter run for its cost every round (its proposals
                                discarded), so the measured time is that drafter's with the scripted acceptance.
    RandomDrafter(vocab, seed)  k uniformly random tokens
    ConstantDrafter(token)      k copies of one token (an EOS, a stop string's token)
    OverlongDrafter(inner, extra)  the inner drafter's tokens plus ``extra`` more than asked for (the loop cuts them)
"""
from __future__ import annotations

import torch

from ..sampling import GenerationSettings
from .drafter import Draft, DeviceContext, DraftContext, Drafter


class ScriptedDrafter(Drafter):
    name = "scripted"

    def __init__(self, script: torch.Tensor, inner: Drafter | None = None):
        self.script = script.to(torch.long)
        self.inner = inner
        self.zeros = torch.zeros(16, dtype=torch.long, device=script.device)
        self.padded = torch.cat([self.script, self.zeros])  # propose_at gathers; past the end: token 0
        self.ar = torch.arange(16, device=script.device)

    @property
    def device_side(self) -> bool:
        return self.inner is None or self.inner.device_side

    @property
    def host_free(self) -> bool:
        return self.inner is None or self.inner.host_free

    @classmethod
    def modeled(cls, truth: list[int], alpha: float, vocab: int, seed: int = 0, device="cpu",
                inner: Drafter | None = None) -> "ScriptedDrafter":
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha: a probability, got {alpha}")
        g = torch.Generator().manual_seed(seed)
        t = torch.tensor(truth, dtype=torch.long)
        wrong = torch.rand(t.shape, generator=g) >= alpha
        shift = torch.randint(1, max(vocab, 2), t.shape, generator=g)
        script = torch.where(wrong, (t + shift) % vocab, t)
        return cls(script.to(device), inner)

    def begin(self, prompt: list[int], s: GenerationSettings, max_len: int, target_vocab: int, device) -> None:
        super().begin(prompt, s, max_len, target_vocab, device)
        if self.inner is not None:
            self.inner.begin(prompt, s, max_len, target_vocab, device)

    def propose(self, ctx: DraftContext, k: int) -> Draft | None:
        if self.inner is not None:
            self.inner.propose(ctx, k)
        if k <= 0:
            return None
        j = ctx.pos + 1
        got = self.script[j:j + k]
        if got.shape[0] < k:
            got = torch.cat([got, self.zeros[:k - got.shape[0]]])
        return Draft(got)

    def propose_at(self, ctx: DeviceContext, k: int) -> Draft | None:
        if self.inner is not None:
            self.inner.propose_at(ctx, k)
        if k <= 0:
            return None
        idx = (ctx.at.to(self.padded.device) + 1 + self.ar[:k]).clamp_(max=self.padded.shape[0] - 1)
        return Draft(self.padded.index_select(0, idx))


class RandomDrafter(Drafter):
    name = "random"

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, ctx, k):
        if k <= 0:
            return None
        return Draft(torch.randint(0, self.vocab, (k,), generator=self.gen))

    def propose_at(self, ctx, k):
        return self.propose(None, k)


class ConstantDrafter(Drafter):
    name = "constant"

    def __init__(self, token: int):
        self.token = token

    def propose(self, ctx, k):
        return Draft(torch.full((k,), self.token, dtype=torch.long)) if k > 0 else None

    def propose_at(self, ctx, k):
        return self.propose(None, k)


class OverlongDrafter(Drafter):
    name = "overlong"

    def __init__(self, inner: Drafter, extra: int = 5):
        self.inner, self.extra = inner, extra

    def begin(self, prompt, s, max_len, target_vocab, device):
        super().begin(prompt, s, max_len, target_vocab, device)
        self.inner.begin(prompt, s, max_len, target_vocab, device)

    @property
    def device_side(self) -> bool:
        return self.inner.device_side

    @property
    def host_free(self) -> bool:
        return self.inner.host_free

    def propose(self, ctx, k):
        d = self.inner.propose(ctx, k + self.extra)
        return d

    def propose_at(self, ctx, k):
        return self.inner.propose_at(ctx, k + self.extra)
