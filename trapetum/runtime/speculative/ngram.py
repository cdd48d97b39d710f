"""N-gram / prompt lookup drafting (llama.cpp's and vLLM's ngram drafters): no model. The longest suffix of the
sequence (prompt + output) of n tokens, n from ``max_n`` down to ``min_n``, is looked up earlier in the sequence,
and the up to K tokens that followed its most recent earlier occurrence are proposed. Deterministic (q one-hot).

Host work per round: one vectorized pass over the sequence (numpy), O(length x max_n).
"""
from __future__ import annotations

import numpy as np
import torch

from ..sampling import GenerationSettings
from .drafter import Draft, DraftContext, Drafter


def lookup(seq: np.ndarray, k: int, max_n: int = 4, min_n: int = 2) -> np.ndarray:
    """The continuation (at most k tokens) of the most recent earlier occurrence of the longest suffix of ``seq``
    with min_n <= n <= max_n tokens; empty when none occurs."""
    L = len(seq)
    if k <= 0 or L < min_n + 1:
        return seq[:0]
    cand = np.flatnonzero(seq[:L - 1] == seq[L - 1])  # earlier ends of a match, each with a continuation
    if cand.size == 0:
        return seq[:0]
    length = np.ones(cand.size, dtype=np.int64)
    alive = np.ones(cand.size, dtype=bool)
    for j in range(1, min(max_n, L - 1)):
        idx = cand - j
        ok = alive & (idx >= 0)
        ok[ok] = seq[idx[ok]] == seq[L - 1 - j]
        length += ok
        alive = ok
        if not alive.any():
            break
    best = int(length.max())
    if best < min_n:
        return seq[:0]
    i = int(cand[length == best][-1])
    return seq[i + 1:i + 1 + k]


class NgramDrafter(Drafter):
    name = "ngram"
    device_side = host_free = False  # the lookup runs over the host sequence: the synchronous loop

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def begin(self, prompt: list[int], s: GenerationSettings, max_len: int, target_vocab: int, device) -> None:
        super().begin(prompt, s, max_len, target_vocab, device)
        self.buf = np.zeros(max_len, dtype=np.int64)
        self.buf[:len(prompt)] = prompt
        self.n = len(prompt)

    def propose(self, ctx: DraftContext, k: int) -> Draft | None:
        L = len(ctx.seq)
        if L > self.n:
            self.buf[self.n:L] = ctx.seq[self.n:L]
            self.n = L
        cont = lookup(self.buf[:L], k, self.max_n, self.min_n)
        bad = np.flatnonzero(cont >= self.target_vocab)
        if bad.size:
            cont = cont[:bad[0]]
        if cont.size == 0:
            return None
        return Draft(torch.from_numpy(cont.copy()))
