"""The speculative Runner: draft, verify in one pass, accept, repeat; plugs into runtime/generate.stream_tokens.

    SpeculativeRunner(target, drafter, k=4, adaptive=False, pipelined=None)
        target   Rows over the target model (rows.py: the GPU engine or the CPU reference decoder)
        drafter  a Drafter (drafter.py: draft model, PARD, n-gram, scripted)
        k        drafts per round, 1 .. 15 (the verify pass holds k + 1 <= 16 rows); ``adaptive``: k moves in
                 1 .. ``k_max`` (+2 after a round that accepted every draft, -1 after one that rejected one)
        pipelined  the loop of pipeline.py (round r + 1 queued before round r's verdict is read back) or this
                 module's synchronous one. None (the default) is the synchronous loop for now: on the H200 the
                 synchronous rounds already ran within 3% of their two forwards' device time, and the one
                 comparison so far did not settle which loop is faster (BENCHMARKS.md, issue 16, session 9).
                 ``can_pipeline(target, drafter)`` says where the pipelined loop would pay (the target's rows
                 read positions on a CUDA device and the drafter proposes from device tensors alone: PARD and
                 draft models over the GPU engine, scripted drafters; not n-gram lookup, which needs the
                 sequence on the host, nor the CPU reference rows). True forces it wherever the drafter has
                 ``propose_at`` (on the CPU too: how the tests run it).

``tokens(prompt, settings, max_len)`` (the Runner protocol) yields, in either loop, exactly the tokens plain decoding of the target
yields (greedy: the same tokens; sampling: the same distribution, the accept rule of accept.py): the prompt goes
through the target's own prefill, the first token is sampled from it as the plain runner does, then each round

    1. the drafter proposes k' <= k tokens after the last token at position p (k' also keeps p + k' + 1 < max_len,
       so no draft reaches past the last position the generation may fill);
    2. the target verifies [last, d_1 .. d_k'] at p .. p + k' in one pass (rows bitwise its decode steps);
    3. the longest agreeing prefix plus the target's own next token are emitted (one read-back per round);
       the next round's verify overwrites the rejected rows in place (caches addressed by position).

Tokens of one round are yielded together after the next round has been queued on the device. EOS, stop strings
and max_new_tokens are stream_tokens' business, applied to this token stream exactly as to the plain one (a token
past a stop is produced but never emitted). ``stats`` describes the last generation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from ...models.batch import MAX_VERIFY_ROWS
from ..sampling import GenerationSettings, Sampler
from .accept import judge
from .drafter import DraftContext, Drafter
from .pipeline import pipelined_tokens
from .rows import Rows

MAX_K = MAX_VERIFY_ROWS - 1


@dataclass
class SpecStats:
    drafter: str = ""
    k: int = 0
    rounds: int = 0  # verify passes after the prompt
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    rejected: int = 0  # rounds that rejected a draft (the others accepted all they verified)
    produced: int = 0  # tokens the rounds emitted (accepted drafts + one target token each; not the prefill's)
    accepted_hist: list[int] = field(default_factory=list)  # rounds by accepted count 0 .. k

    @property
    def acceptance(self) -> float:
        """Accepted drafts over drafted ones (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance: accepted drafts over drafts judged (accepted + the first rejected of each round):
        the estimate of the probability that a draft is accepted given the ones before it were."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.produced / self.rounds if self.rounds else 0.0

    def line(self) -> str:
        return (f"{self.drafter} k={self.k}: {self.rounds} rounds, {self.tokens_per_round:.2f} tokens/round, "
                f"acceptance {self.acceptance:.3f} ({self.accepted}/{self.drafted}), per token {self.alpha:.3f}")

    def add(self, other: "SpecStats") -> None:
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.rejected += other.rejected
        self.produced += other.produced
        for i, c in enumerate(other.accepted_hist):
            while len(self.accepted_hist) <= i:
                self.accepted_hist.append(0)
            self.accepted_hist[i] += c


def check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValueError(f"draft k: an integer in 1..{MAX_K} (the verify pass holds k + 1 <= {MAX_VERIFY_ROWS} rows), "
                         f"got {k!r}")
    return k


class SpeculativeRunner:
    def __init__(self, target: Rows, drafter: Drafter, k: int = 4, adaptive: bool = False, k_max: int = MAX_K,
                 pipelined: bool | None = None):
        self.target, self.drafter = target, drafter
        self.k = check_k(k)
        self.k_max = check_k(k_max)
        self.adaptive = adaptive
        if pipelined and not drafter.device_side:
            raise ValueError(f"pipelined: the {drafter.name} drafter proposes from the host sequence only")
        self.pipelined = bool(pipelined)
        self.stats = SpecStats(drafter.name, k)

    @staticmethod
    def can_pipeline(target: Rows, drafter: Drafter) -> bool:
        """Whether the pipelined loop would run without a read-back per round (the docstring's rule)."""
        return bool(target.device_positions and target.device.type == "cuda" and drafter.device_side
                    and drafter.host_free)

    @torch.inference_mode()
    def tokens(self, prompt: list[int], s: GenerationSettings, max_len: int) -> Iterator[int]:
        if self.pipelined:
            yield from pipelined_tokens(self, prompt, s, max_len)
            return
        T, D = self.target, self.drafter
        dev = T.device
        st = self.stats = SpecStats(D.name, self.k, accepted_hist=[0] * (self.k_max + 1))
        sampler = Sampler(s, T.vocab_size, dev, prompt)
        logits = T.prefill(prompt, max_len)
        first = sampler(logits)  # [1] on the device, in the penalty state
        D.begin(list(prompt), s, max_len, T.vocab_size, dev)
        self._max_len = max_len
        seq = list(prompt) + [int(first)]
        pos = len(prompt)  # position of seq[-1]
        k = self.k
        yield seq[-1]
        if pos + 1 >= max_len:
            return
        new = first
        round_ = self._launch(seq, new, pos, k)
        while True:
            d, q, logits, greedy = round_
            v = judge(sampler, logits, greedy, d, q)  # the round's one read-back
            sampler.accept(v.emitted)
            st.rounds += 1
            st.drafted += d.shape[0]
            st.accepted += v.accepted
            st.rejected += v.accepted < d.shape[0]
            st.produced += len(v.tokens)
            st.accepted_hist[v.accepted] += 1
            if self.adaptive:
                if d.shape[0] == k and v.accepted == k:
                    k = min(k + 2, self.k_max)
                elif v.accepted < d.shape[0]:
                    k = max(1, k - 1)
            seq.extend(v.tokens)
            pos += len(v.tokens)
            new = v.emitted
            more = pos + 1 < max_len
            if more:  # queue the next round before handing out this one's tokens
                round_ = self._launch(seq, new, pos, k)
            yield from v.tokens  # the consumer may stop at any of them (EOS, stop string, max tokens)
            if not more:
                return

    def _launch(self, seq: list[int], new: torch.Tensor, pos: int, k: int):
        """Draft and verify one round (queued on the device, nothing read back): (drafts, q, logits, greedy)."""
        T, dev = self.target, self.target.device
        kk = min(k, self._max_len - 2 - pos)  # emitted tokens reach at most position max_len - 1
        draft = self.drafter.propose(DraftContext(seq, new, pos), kk)
        if draft is not None and draft.tokens.shape[0] > 0 and kk > 0:
            d = draft.tokens[:kk].to(device=dev, dtype=torch.long)
            q = draft.q[:kk].to(dev) if draft.q is not None else None
        else:
            d, q = torch.empty(0, dtype=torch.long, device=dev), None
        logits, greedy = T.rows(torch.cat([new[-1:], d]), pos)
        return d, q, logits, greedy
