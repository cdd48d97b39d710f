"""The pipelined speculative loop: round r + 1 is queued on the device before round r's verdict is read back, so
the device never waits for the host between rounds (SpeculativeRunner runs it when ``pipelined``, loop.py).

Round r, with its last token at position p_r (on the device: ``at``), is queued as
    1. the target sampler's penalty state takes round r - 1's emitted tokens (accept.accept_emitted);
    2. the drafter proposes kk <= k tokens from a DeviceContext (drafter.py): round r - 1's emitted tokens padded
       to a fixed length, their count and p_r on the device, the host bounds p_{r-1} + 1 <= p_r <= hi;
    3. the target verifies [its last token, drafts] at p_r (EngineRows.rows_at: the graphs read p_r from a device
       tensor), and accept.device_verdict computes the emitted tokens em [kk + 1] and the count n on the device;
       p_{r+1} = p_r + n + 1 stays there;
    4. em and n are copied into a pinned host buffer (non-blocking) and a CUDA event is recorded.
The host then waits for round r - 1's event only (round r runs meanwhile), reads its n and tokens, updates the
stats and adaptive k, and yields them. kk bounds every row by the host's upper bound hi of p_r: kk <= room - 2 -
hi, where room is the positions the target's KV cache holds (the engine's whole cache, which may pass max_len;
the reference rows' cache is max_len), so no row of any queued round reaches past room - 1; tokens a round emits
past position max_len - 1 are neither yielded nor counted in the stats (the synchronous loop, which knows p_r,
stops its drafts there; the pipelined one would otherwise draft short near the end). A round queued after the one
that reaches the end (or after the consumer stops: EOS, stop string, max tokens) is never read, and the cache rows
it wrote lie past the sequence.

Exactness: every round's verdict is the synchronous loop's (the same accept rule, accept.device_verdict, over the
same verify rows: VERIFY rows are bitwise their decode steps at any grouping), so greedy output is token for
token plain greedy decoding's; sampled output has the target's distribution, and with a fixed k it is the same
tokens under the same seed as the synchronous loop away from the end of the cache (where the two loops bound k
differently): the same draws in the same order, k uniforms and one (k + 1)-row multinomial per round from the
target's generator, the drafter's own draws per proposal from its generator. Adaptive k
is decided one round later than in the synchronous loop (round r's verdict sets round r + 2's k), so adaptive
sampling matches it in distribution, not draw for draw.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ..sampling import GenerationSettings, Sampler
from .accept import accept_emitted, device_verdict
from .drafter import DeviceContext


class Reader:
    """Non-blocking read-backs: ``send(t)`` queues a copy of int64 ``t`` into a pinned host buffer and records an
    event; ``recv(ticket)`` waits for that event only and returns the values (a plain copy on the CPU)."""

    SLOTS = 3  # at most two read-backs are in flight (a round and the next one)

    def __init__(self, device: torch.device, size: int):
        self.cuda = device.type == "cuda"
        self.bufs = [torch.zeros(size, dtype=torch.long, pin_memory=self.cuda) for _ in range(self.SLOTS)]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(self.SLOTS)]
        self.i = 0

    def send(self, t: torch.Tensor):
        j = self.i % self.SLOTS
        self.i += 1
        buf = self.bufs[j][:t.numel()]
        buf.copy_(t.view(-1), non_blocking=self.cuda)
        if self.events[j] is not None:
            self.events[j].record()
        return buf, self.events[j]

    @staticmethod
    def recv(ticket) -> list[int]:
        buf, ev = ticket
        if ev is not None:
            ev.synchronize()
        return buf.tolist()


@dataclass
class Queued:
    em: torch.Tensor  # [kk + 1] the emitted tokens, valid through n (device)
    n: torch.Tensor  # [1] accepted drafts (device)
    k: int  # the k the round was queued with
    kk: int  # drafts verified
    ticket: tuple


def pipelined_tokens(runner, prompt: list[int], s: GenerationSettings, max_len: int) -> Iterator[int]:
    """The Runner protocol's tokens (module docstring); ``runner`` a SpeculativeRunner (its target, drafter, k,
    adaptive, k_max; its ``stats`` is set)."""
    from .loop import MAX_K, SpecStats
    T, D = runner.target, runner.drafter
    dev = T.device
    st = runner.stats = SpecStats(D.name, runner.k, accepted_hist=[0] * (runner.k_max + 1))
    reader = Reader(dev, MAX_K + 2)  # before any forward: a pinned allocation may synchronize
    sampler = Sampler(s, T.vocab_size, dev, prompt)
    logits = T.prefill(prompt, max_len)
    room = max(T.max_len, max_len) if T.device_positions else max_len  # positions the target's cache holds
    first = sampler(logits)  # [1] on the device, in the penalty state
    D.begin(list(prompt), s, room, T.vocab_size, dev)
    first_ticket = reader.send(first)
    k = runner.k

    def queue(ctx: DeviceContext, k: int, accept: bool) -> Queued:
        if accept:
            accept_emitted(sampler, ctx.new, ctx.n)
        kk = max(0, min(k, room - 2 - ctx.hi))  # verify rows reach at most hi + kk <= room - 2
        draft = D.propose_at(ctx, kk)
        if draft is not None and draft.tokens.shape[0] > 0 and kk > 0:
            d = draft.tokens[:kk].to(device=dev, dtype=torch.long)
            q = draft.q[:kk].to(dev) if draft.q is not None else None
        else:
            d, q = torch.empty(0, dtype=torch.long, device=dev), None
        last = ctx.new.index_select(0, ctx.n)
        logits, greedy = T.rows_at(torch.cat([last, d]), ctx.at)
        em, n = device_verdict(sampler, logits, greedy, d, q)
        em = em.clone()  # may be a view of the target's argmax rows, which the next verify overwrites
        return Queued(em, n, k, int(d.shape[0]), reader.send(torch.cat([em, n])))

    p = len(prompt)  # position of the last token read back so far
    cur = None
    if p + 1 < max_len:
        at = torch.full((1,), p, dtype=torch.long, device=dev)
        cur = queue(DeviceContext(first, torch.zeros(1, dtype=torch.long, device=dev), p, at, p), k, False)
    yield reader.recv(first_ticket)[0]
    if cur is None:
        return
    while True:
        nxt = None
        if p + 2 < max_len:  # the next round may be needed (its last token is at p + 1 or later)
            nxt = queue(DeviceContext(cur.em, cur.n, p + 1, cur.n + (p + 1), p + 1 + cur.kk), k, True)
        host = reader.recv(cur.ticket)
        n = host[-1]
        kd = min(cur.kk, max_len - 2 - p)  # drafts at positions the generation may fill (p <= max_len - 2 here)
        a = min(n, kd)  # the round as the synchronous loop would count it; a + 1 tokens within max_len
        st.rounds += 1
        st.drafted += kd
        st.accepted += a
        st.rejected += a < kd
        st.produced += a + 1
        st.accepted_hist[a] += 1
        if runner.adaptive:  # round r's verdict sets the k of the round queued next (r + 2)
            if cur.kk == cur.k and n == cur.k:
                k = min(k + 2, runner.k_max)
            elif n < cur.kk:
                k = max(1, k - 1)
        p += n + 1
        more = p + 1 < max_len
        yield from host[:a + 1]  # the consumer may stop at any of them (EOS, stop string, max tokens)
        if not more:
            return
        cur = nxt
