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
Row groups (``row_group``; default the runner's ``row_group``, 0: no limit): where the batched GEMV's cost
steps by whole groups of rows (the GPU runner's wgmma kernel dequantizes every weight once per 64 rows), a step
folds at most the rows left in the decode rows' last group (all of one group when none are left), so a prompt
arriving beside 63 decoding rows goes in over several 64-row steps instead of one 112-row step that costs two:
more steps to its first token, no step at double cost. Only the split of the prompt over steps changes, not a bit.
Overlapped steps (``overlap``; default the runner's ``overlap``: on for the GPU runner, measured on the H200 in
session 15; off on the CPU, whose forward is the host's own work): step N + 1's
decode forward and sampling are enqueued before the host reads step N's tokens, so that the host's work on them
(TokenStream pushes, the caller's delivery) runs while the device computes N + 1. A row of N + 1 whose input is a
token of N not yet on the host takes it on the device (``runner.decode``'s ``prev``: step N's sampled tensor,
``src``: each row's index into it, -1 for a host token). Then every read enqueued before N + 1's forward lands
(step N's decode tokens, step N + 1's prefill first tokens) and is pushed. A request that step N finished (EOS, a
stop string, cancelled) had a row in N + 1: that row's token is dropped when it lands (its sampler is the finished
request's, never used again); its blocks are freed after N + 1 was enqueued, and whatever uses them next (a decode
row, a prefill chunk and its write-back, a poisoning fill) is enqueued later on the same stream, so it runs after
N + 1. max_new_tokens is known in advance: no row is planned past it (``sampled``). A preempted request keeps its
pending token (it lands before the request can be readmitted: readmission is at a later step's admission, and
every token fed as a row before the preemption was sampled at least two steps earlier, so its rebuild reads only
landed tokens). A request's sampler is called in the same order (its rows are in token order either way), so the
tokens are exactly the sequential scheduler's; its events arrive one step later.
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
    last: int | None = None           # the last sampled token on the host (the next decode row's input)
    pending: tuple | None = None      # (_Read, index): a sampled token not yet on the host (overlapped steps)
    sampled: int = 0                  # tokens sampled so far (landed or pending)
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

    @property
    def has_token(self) -> bool:
        """Whether the request has sampled its first token (landed or pending)."""
        return self.last is not None or self.pending is not None


class Scheduler:
    """Continuous batching over ``runner``: its ``kv`` (a PagedKV), ``prefill(table, tokens, start)`` -> logits [V]
    and ``decode(tables, tokens, positions, prev=None, src=None)`` -> logits [S, V] (runtime/paged_ops.py)."""

    def __init__(self, runner, tokenizer: Tokenizer | None, vocab_size: int, context_size: int, *,
                 max_batch: int = 16, chunk: int = 64, prefill_budget: int | None = None, on_full: str = "queue",
                 device: str | torch.device = "cpu", fold: int | None = None, overlap: bool | None = None,
                 row_group: int | None = None):
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
        self.overlap = bool(getattr(runner, "overlap", False) if overlap is None else overlap)
        self.row_group = int((getattr(runner, "row_group", None) or 0) if row_group is None else row_group)
        if self.row_group < 0:
            raise TrapetumError(f"row group: rows a batched GEMV dequantizes its weights for, 0 for no limit, "
                                f"got {self.row_group}")
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[Request] = []   # admitted, in admission order
        self._ids = itertools.count()
        self.steps = 0
        self.peak_batch = 0               # most requests decoded in one forward
        self.preemptions = 0
        self._inflight: _Read | None = None  # the last decode step's tokens, not yet landed (overlapped steps)
        self._reads: list[_Read] = []        # this step's prefill first tokens, landing after its decode forward
        self._touched: list[Request] = []

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
        self._finish(req, "cancelled")

    def load(self) -> dict:
        return {"running": len(self.active), "queued": len(self.waiting), "free_blocks": self.kv.alloc.num_free,
                "total_blocks": self.kv.num_blocks, "max_batch": self.max_batch, "preemptions": self.preemptions}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active or self._inflight)

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One scheduler step (module docstring); returns the requests that got events."""
        self.steps += 1
        self._touched, self._reads = [], []
        self._admit()
        budget, fresh = self.prefill_budget, []  # fresh: a first token sampled by this step's prefill
        for req in [r for r in self.active if r.state == "prefill" and not self._folded(r)]:
            while budget > 0 and req.state == "prefill":
                budget -= max(self._prefill(req, fresh), self.chunk)  # a forward costs at least a chunk
            if budget <= 0:
                break
        rows = []
        for r in [r for r in self.active if r.state == "decode" and r not in fresh
                  and r.sampled < r.settings.max_new_tokens]:  # (overlapped: the last one may be pending)
            if r.state == "decode" and self._grow(r):  # (an earlier _grow may have preempted r)
                rows.append(r)
        rows = [r for r in rows if r.state == "decode"]
        prev = self._inflight
        src = [-1 if r.pending is None else r.pending[1] for r in rows]  # a pending token: the last step's
        assert all(r.pending is None or r.pending[0] is prev for r in rows)
        tables, pos = [r.table for r in rows], [r.computed for r in rows]
        toks = [0 if r.pending is not None else r.last for r in rows]
        folds, left = [], self._fold_rows(len(rows))  # (request, rows) of the folded prompts, after the decode rows
        for r in [r for r in self.active if r.state == "prefill" and self._folded(r)]:
            if left <= 0:
                break
            n = min(len(r.prompt) - r.computed, left)
            left -= n
            folds.append((r, n))
            tables += [r.table] * n
            toks += r.prompt[r.computed:r.computed + n]
            pos += range(r.computed, r.computed + n)
        read = None
        if rows or folds:
            self.peak_batch = max(self.peak_batch, len(rows))
            if any(i >= 0 for i in src):
                logits = self.runner.decode(tables, toks, pos, prev.toks, src + [-1] * (len(toks) - len(rows)))
            else:
                logits = self.runner.decode(tables, toks, pos)
            sample, at = list(rows), list(range(len(rows)))  # the sampled requests, each one's logits row
            for r in rows:
                r.computed += 1
            row = len(rows)
            for r, n in folds:
                row += n
                r.computed += n
                if r.computed == len(r.prompt) and not r.has_token:  # a first token (a rebuilt request has one)
                    r.state = "decode"
                    sample.append(r)
                    at.append(row - 1)
                elif r.has_token and r.computed >= max(len(r.prompt), r.target):
                    r.state, r.target = "decode", 0
            if sample:  # the step's one host read
                read = self._sampled(sample, self._sample_rows(sample, logits, at), at)
        # land what was enqueued before this step's decode forward (overlapped), else everything now
        landing = ([prev] if prev is not None else []) + self._reads
        self._inflight = read if self.overlap else None
        if not self.overlap and read is not None:
            landing.append(read)
        for rd in landing:
            self._land(rd)
        return self._touched

    def run(self) -> None:
        """Steps until nothing is waiting or running."""
        while self.has_work:
            self.step()

    def _fold_rows(self, decode_rows: int) -> int:
        """Prompt rows this step may fold beside ``decode_rows`` decode rows (module docstring, row groups)."""
        g = self.row_group
        if not g:
            return self.prefill_budget
        room = -decode_rows % g  # rows left in the last group the decode rows open
        return min(self.prefill_budget, room or g)

    def _folded(self, req: Request) -> bool:
        """Whether ``req``'s remaining prompt positions go into the decode forward (module docstring)."""
        return len(req.prompt) <= self.fold and req.computed < len(req.prompt)

    def _prefill(self, req: Request, fresh: list) -> int:
        """One prompt chunk of ``req`` (or, rebuilding, up to MAX_VERIFY_ROWS of its fed tokens); positions done."""
        P = len(req.prompt)
        if req.computed < P:
            n = min(self.chunk - req.computed % self.chunk, P - req.computed)
            logits = self.runner.prefill(req.table, req.prompt[req.computed:req.computed + n], req.computed)
            req.computed += n
            if req.computed == P and not req.has_token:
                req.state = "decode"
                self._take(req, logits)
                fresh.append(req)
        else:
            fed = req.stream.out[req.computed - P:req.target - P]
            n = min(len(fed), MAX_VERIFY_ROWS)
            self.runner.replay(req.table, fed[:n], req.computed)
            req.computed += n
        if req.has_token and req.computed >= max(P, req.target):
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
        req.target = max(req.target, req.computed) if req.has_token else 0
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
        """Sample ``req``'s next token from its logits row [V]; it lands (``_land``) now, or overlapped after this
        step's decode forward was enqueued."""
        read = self._sampled([req], self._sample_rows([req], logits.reshape(1, -1)))
        if self.overlap:
            self._reads.append(read)
        else:
            self._land(read)

    def _sampled(self, reqs: list[Request], toks: torch.Tensor, at: list[int] | None = None) -> _Read:
        """``reqs``' new tokens (entry ``at[i]`` of ``toks``) on their way to the host, pending until they land."""
        read = _Read(toks, list(zip(reqs, range(len(reqs)) if at is None else at)))
        for r, i in read.entries:
            r.sampled += 1
            r.pending = (read, i)
        return read

    def _land(self, read: _Read) -> None:
        """Read tokens on the host and push them; a request already done (finished by an earlier token, or
        cancelled) drops its token."""
        toks = read.tokens()
        for r, i in read.entries:
            if r.pending is not None and r.pending[0] is read:
                r.pending = None
            if not r.done:
                self._push(r, toks[i])
                self._touched.append(r)

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
        elif req.state == "waiting" and req in self.waiting:  # (a preempted request whose pending token ends it)
            self.waiting.remove(req)
        if req.blocks:
            self.kv.free(req.blocks)
            req.blocks = []
        events = req.stream.close(finish)
        req.completion = events[-1].completion
        req.events.extend(events)
        req.state = "done"


class _Read:
    """Sampled tokens ``toks`` (int64 [R], on the logits' device) on their way to the host, ``entries`` (request,
    index into toks). On CUDA an asynchronous copy into page-locked memory and an event after it are enqueued at
    once, so that ``tokens()`` later waits for these tokens alone, not for forwards enqueued since; the wait is a
    CUDA event's, which releases the GIL (the server's event-loop thread formats and sends tokens meanwhile)."""

    def __init__(self, toks: torch.Tensor, entries: list):
        self.toks, self.entries, self.done = toks, entries, None
        self.host = toks
        if toks.is_cuda:
            self.host = torch.empty(toks.shape, dtype=toks.dtype, pin_memory=True)
            self.host.copy_(toks, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def tokens(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def drain(req: Request) -> list[StreamEvent]:
    """The events ``req`` has collected since the last drain."""
    out = []
    while req.events:
        out.append(req.events.popleft())
    return out
