"""The batch scheduler: continuous batching of many requests over a paged KV cache (runtime/paged_kv.py).

A request waits (FIFO) until ``max_batch`` leaves room and the allocator has the blocks of its prompt plus one
spare; it then takes blocks as it grows. When a decode row needs a block and none is free, the most recently
admitted request is preempted: its blocks are freed and it goes back to the head of the queue, keeping its
tokens and sampler; readmitted, it is rebuilt exactly (its prompt through the same chunks, its fed tokens as
decode rows: ``runner.replay``) and continues as if never stopped. ``on_full``: "queue" (wait for blocks) or
"reject" (``KVExhausted`` at submit when a request cannot start now: the server's 429). A request longer than
the whole cache is refused at submit (TrapetumError).

``step()`` is one scheduler step:
    1. admit waiting requests (their prompt's blocks allocated, their sampler made: per-request settings, seed);
    2. prefill: prompt chunks of ``chunk`` positions (boundaries at multiples of ``chunk`` from position 0) of the
       requests still prefilling whose prompt is not folded (below), oldest first, up to ``prefill_budget``
       positions per step, each forward counted as at least ``chunk`` positions (a short prompt's forward costs
       about what a chunk's does: the weights are read either way), so the default budget (one chunk) runs one
       prefill forward per step and a decode step waits for at most one; a request whose prompt is done samples
       its first token (a rebuilt one replays its fed tokens instead);
    3. decode: one forward over every request in the decode phase (one row each: its last token at its position)
       and the folded prompt rows, the tokens chosen on the device (``_sample_rows``: one argmax for all plain
       greedy rows, each other row by its request's own sampler), then one host copy for all rows;
    4. every new token goes through the request's TokenStream (runtime/generate.py: EOS, stop strings,
       max_new_tokens); a finished request frees its blocks at once.
Folded prompts (``fold``: prompts of at most ``fold`` tokens; default the runner's ``fold_prompt``, 0 on the CPU
runner): their positions go into step 3's forward as decode rows of their own sequence at consecutive positions
(each row's K/V written before any row attends, a row seeing only positions below its own + 1: the runners'
``decode`` contract, the one ``replay`` rests on), up to ``prefill_budget`` rows per step over the folded
requests, oldest first; the last prompt row's logits give the first token in the same read as the decode rows'.
A row's bits are then those of a decode step at its position whatever the split of the prompt over steps, so a
short prompt costs a few row groups of the batched GEMVs (about what 16 more decode rows cost per 16 prompt
tokens) instead of a prefill forward that dequantizes every weight. Whether a prompt folds depends on its length
alone, so a request still takes the same path alone and in any batch.
``cancel(req)`` ends a request at once (blocks freed, "cancelled"). Each request's StreamEvents collect in
``req.events`` (the caller drains them); ``req.done`` is set with the last one.

Batch invariance (the guarantee, tests/test_scheduler.py): the runner's forwards compute every row independently
of the other rows, a prompt's chunks are fixed by the prompt alone and sampling is per request, so a request
produces exactly the tokens it produces alone, whatever else is running, queued, preempted or cancelled and
whichever blocks it is given.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

import torch

from ..errors import TrapetumError
from ..models.batch import MAX_VERIFY_ROWS
from ..tokenizer import Tokenizer
from .generate import StreamEvent, TokenStream, check_request
from .paged_kv import KVExhausted
from .sampling import GenerationSettings, Sampler

ON_FULL = ("queue", "reject")


@dataclass(eq=False)
class Request:
    rid: int
    prompt: list[int]
    settings: GenerationSettings
    stream: TokenStream
    state: str = "waiting"            # waiting | prefill | decode | done
    blocks: list[int] = field(default_factory=list)
    table: torch.Tensor | None = None
    computed: int = 0                 # positions in the KV cache
    target: int = 0                   # positions to rebuild before decoding again (a preempted request)
    last: int | None = None           # the last sampled token (the next decode row's input)
    sampler: Sampler | None = None
    events: collections.deque = field(default_factory=collections.deque)
    completion: object = None
    error: Exception | None = None

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def positions(self) -> int:
        """KV positions the request can use: its prompt and every fed token (the last sampled one is not fed)."""
        return len(self.prompt) + max(self.settings.max_new_tokens, 1) - 1

    def _table(self) -> None:
        self.table = torch.tensor(self.blocks, dtype=torch.long)


class Scheduler:
    """Continuous batching over ``runner``: its ``kv`` (a PagedKV), ``prefill(table, tokens, start)`` -> logits [V]
    and ``decode(tables, tokens, positions)`` -> logits [S, V] (runtime/paged_ops.py)."""

    def __init__(self, runner, tokenizer: Tokenizer | None, vocab_size: int, context_size: int, *,
                 max_batch: int = 16, chunk: int = 64, prefill_budget: int | None = None, on_full: str = "queue",
                 device: str | torch.device = "cpu", fold: int | None = None):
        if max_batch < 1:
            raise TrapetumError(f"max batch: at least 1, got {max_batch}")
        if chunk < 1:
            raise TrapetumError(f"prefill chunk: at least 1, got {chunk}")
        if on_full not in ON_FULL:
            raise TrapetumError(f"on_full: one of {', '.join(ON_FULL)}, got {on_full!r}")
        self.runner, self.kv, self.tokenizer = runner, runner.kv, tokenizer
        self.vocab_size, self.context_size, self.device = vocab_size, context_size, device
        self.max_batch, self.chunk, self.on_full = max_batch, chunk, on_full
        self.prefill_budget = chunk if prefill_budget is None else max(1, prefill_budget)
        self.fold = int(getattr(runner, "fold_prompt", 0) if fold is None else fold)
        if self.fold < 0:
            raise TrapetumError(f"fold: prompts of at most this many tokens fold into the decode forward, at least 0, "
                                f"got {self.fold}")
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[Request] = []   # admitted, in admission order
        self._ids = itertools.count()
        self.steps = 0
        self.peak_batch = 0               # most requests decoded in one forward
        self.preemptions = 0

    # -- requests ------------------------------------------------------------------------------
    def submit(self, prompt: list[int], settings: GenerationSettings, t0: float | None = None) -> Request:
        prompt = list(prompt)
        check_request(prompt, settings, self.context_size)
        req = Request(next(self._ids), prompt, settings, TokenStream(self.tokenizer, prompt, settings, t0))
        need = self.kv.blocks_needed(req.positions)
        if need > self.kv.num_blocks:
            raise TrapetumError(f"the request needs {need} KV blocks ({req.positions} positions), more than the "
                                f"whole cache of {self.kv.num_blocks} (--kv-blocks / --kv-mem)")
        start = self.kv.blocks_needed(len(prompt)) + 1
        if self.on_full == "reject" and (self.waiting or start > self.kv.alloc.num_free
                                         or len(self.active) >= self.max_batch):
            raise KVExhausted(start, self.kv.alloc.num_free, self.kv.num_blocks)
        if settings.max_new_tokens == 0:
            self._finish(req, None)
            return req
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """End ``req`` now ("cancelled"; its blocks freed). A finished request is left as it is."""
        if req.done:
            return
        if req.state == "waiting":
            self.waiting.remove(req)
        self._finish(req, "cancelled")

    def load(self) -> dict:
        return {"running": len(self.active), "queued": len(self.waiting), "free_blocks": self.kv.alloc.num_free,
                "total_blocks": self.kv.num_blocks, "max_batch": self.max_batch, "preemptions": self.preemptions}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One scheduler step (module docstring); returns the requests that got events."""
        self.steps += 1
        touched: list[Request] = []
        self._admit()
        budget = self.prefill_budget
        for req in [r for r in self.active if r.state == "prefill" and not self._folded(r)]:
            while budget > 0 and req.state == "prefill":
                budget -= max(self._prefill(req, touched), self.chunk)  # a forward costs at least a chunk
            if budget <= 0:
                break
        rows = []
        for r in [r for r in self.active if r.state == "decode" and r not in touched]:
            if r.state == "decode" and self._grow(r):  # (an earlier _grow may have preempted r)
                rows.append(r)
        rows = [r for r in rows if r.state == "decode"]
        tables, toks, pos = [r.table for r in rows], [r.last for r in rows], [r.computed for r in rows]
        folds, left = [], self.prefill_budget  # (request, rows) of the folded prompts, after the decode rows
        for r in [r for r in self.active if r.state == "prefill" and self._folded(r)]:
            if left <= 0:
                break
            n = min(len(r.prompt) - r.computed, left)
            left -= n
            folds.append((r, n))
            tables += [r.table] * n
            toks += r.prompt[r.computed:r.computed + n]
            pos += range(r.computed, r.computed + n)
        if rows or folds:
            self.peak_batch = max(self.peak_batch, len(rows))
            logits = self.runner.decode(tables, toks, pos)
            sample, at = list(rows), list(range(len(rows)))  # the sampled requests, each one's logits row
            row = len(rows)
            for r, n in folds:
                row += n
                r.computed += n
                if r.computed == len(r.prompt) and r.last is None:  # a first token (a rebuilt request has one)
                    r.state = "decode"
                    sample.append(r)
                    at.append(row - 1)
                elif r.last is not None and r.computed >= max(len(r.prompt), r.target):
                    r.state, r.target = "decode", 0
            toks = _read(self._sample_rows(sample, logits, at))  # the step's one host read
            for r, i in zip(sample[:len(rows)], at):
                r.computed += 1
                self._push(r, toks[i])
            for r, i in zip(sample[len(rows):], at[len(rows):]):
                self._push(r, toks[i])
            touched += sample
        return touched

    def run(self) -> None:
        """Steps until nothing is waiting or running."""
        while self.has_work:
            self.step()

    def _folded(self, req: Request) -> bool:
        """Whether ``req``'s remaining prompt positions go into the decode forward (module docstring)."""
        return len(req.prompt) <= self.fold and req.computed < len(req.prompt)

    def _prefill(self, req: Request, touched: list) -> int:
        """One prompt chunk of ``req`` (or, rebuilding, up to MAX_VERIFY_ROWS of its fed tokens); positions done."""
        P = len(req.prompt)
        if req.computed < P:
            n = min(self.chunk - req.computed % self.chunk, P - req.computed)
            logits = self.runner.prefill(req.table, req.prompt[req.computed:req.computed + n], req.computed)
            req.computed += n
            if req.computed == P and req.last is None:
                req.state = "decode"
                self._take(req, logits)
                touched.append(req)
        else:
            fed = req.stream.out[req.computed - P:req.target - P]
            n = min(len(fed), MAX_VERIFY_ROWS)
            self.runner.replay(req.table, fed[:n], req.computed)
            req.computed += n
        if req.last is not None and req.computed >= max(P, req.target):
            req.state, req.target = "decode", 0
        return n

    def _grow(self, req: Request) -> bool:
        """Make sure ``req`` has the block of its next row, preempting the newest requests if none is free;
        False if ``req`` itself was preempted."""
        while len(req.blocks) < self.kv.blocks_needed(req.computed + 1):
            if self.kv.alloc.num_free == 0:
                victim = self.active[-1]
                self._preempt(victim)
                if victim is req:
                    return False
                continue
            req.blocks += self.kv.alloc.allocate(1)
            req._table()
        return True

    def _preempt(self, req: Request) -> None:
        self.preemptions += 1
        self.active.remove(req)
        self.kv.free(req.blocks)
        req.blocks, req.table = [], None
        req.target = max(req.target, req.computed) if req.last is not None else 0
        req.computed, req.state = 0, "waiting"
        self.waiting.appendleft(req)

    def _admit(self) -> None:
        while self.waiting and len(self.active) < self.max_batch:
            req = self.waiting[0]
            need = self.kv.blocks_needed(max(len(req.prompt), req.target))
            if need + (1 if self.active else 0) > self.kv.alloc.num_free:  # a spare block to grow into
                return  # FIFO: the head waits for blocks (no overtaking, so no starvation)
            self.waiting.popleft()
            req.blocks = self.kv.alloc.allocate(need)
            req._table()
            if req.sampler is None:
                req.sampler = Sampler(req.settings, self.vocab_size, self.device, req.prompt)
            req.state = "prefill"
            self.active.append(req)

    def _sample_rows(self, reqs: list[Request], logits: torch.Tensor, at: list[int] | None = None) -> torch.Tensor:
        """The next token of ``reqs[i]`` from logits row ``at[i]`` (default i) of logits [R, V] -> int64 [R], left
        on the logits' device; entry ``at[i]`` is reqs[i]'s token, the other entries are not tokens of anyone.

        The rows of plain greedy requests (temperature 0, no repetition penalty: a sampler that only takes the
        argmax) get theirs from one argmax over all rows, the others from their own sampler, row by row (written
        over their row's entry). The same token either way: a row's argmax (the first index of its maximum) does
        not depend on the rows beside it, and a plain greedy sampler has no state (no generator draw, no penalty
        mask). No host sync: every row is picked by a host index."""
        at = list(range(len(reqs))) if at is None else at
        plain = [r.sampler.greedy and r.sampler.seen is None for r in reqs]
        if all(plain):
            return torch.argmax(logits, -1)
        if not any(plain) and at == list(range(logits.shape[0])):
            return torch.cat([r.sampler(logits[i]) for r, i in zip(reqs, at)])
        out = torch.argmax(logits, -1) if any(plain) else \
            torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        for r, i, p in zip(reqs, at, plain):
            if not p:
                out[i:i + 1] = r.sampler(logits[i])
        return out

    def _take(self, req: Request, logits: torch.Tensor) -> None:
        """Sample ``req``'s next token from its logits row [V] and push it (``_push``)."""
        self._push(req, _read(self._sample_rows([req], logits.reshape(1, -1)))[0])

    def _push(self, req: Request, tok: int) -> None:
        """Stream ``req``'s new token; finish the request if it is done."""
        req.events.extend(req.stream.push(tok))
        if req.stream.finish is not None:
            self._finish(req, None)
        else:
            req.last = tok

    def _finish(self, req: Request, finish: str | None) -> None:
        if req in self.active:
            self.active.remove(req)
        if req.blocks:
            self.kv.free(req.blocks)
            req.blocks = []
        events = req.stream.close(finish)
        req.completion = events[-1].completion
        req.events.extend(events)
        req.state = "done"


def _read(toks: torch.Tensor) -> list[int]:
    """``toks`` on the host. On CUDA the wait for the step's kernels is a CUDA event's, which releases the GIL
    (the server's event-loop thread formats and sends the previous step's tokens meanwhile), then the copy."""
    if toks.is_cuda:
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
    return toks.tolist()


def drain(req: Request) -> list[StreamEvent]:
    """The events ``req`` has collected since the last drain."""
    out = []
    while req.events:
        out.append(req.events.popleft())
    return out
