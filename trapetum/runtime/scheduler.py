"""The batch scheduler: continuous batching of many requests over a paged KV cache (runtime/paged_kv.py).

A request waits (FIFO) until ``max_batch`` leaves room and the allocator has the KV blocks its whole length needs
(prompt + max_new_tokens - 1 positions, reserved at admission, so a running request never runs out of blocks and
nothing is preempted). ``on_full``: "queue" (wait for blocks) or "reject" (``KVExhausted`` at submit when they are
not free now: the server's 429). A request longer than the whole cache is refused at submit (TrapetumError).

``step()`` is one scheduler step:
    1. admit waiting requests (their blocks allocated, their sampler made: per-request settings and seed);
    2. prefill: prompt chunks of ``chunk`` positions (boundaries at multiples of ``chunk`` from position 0) of the
       requests still prefilling, oldest first, up to ``prefill_budget`` positions per step (at least one chunk);
       a request whose prompt is done samples its first token;
    3. decode: one forward over every request in the decode phase (one row each: its last token at its position),
       each row's token sampled by that request's own sampler;
    4. every new token goes through the request's TokenStream (runtime/generate.py: EOS, stop strings,
       max_new_tokens); a finished request frees its blocks at once.
``cancel(req)`` ends a request at once (blocks freed, "cancelled"). Each request's StreamEvents collect in
``req.events`` (the caller drains them); ``req.done`` is set with the last one.

Batch invariance (the guarantee, tests/test_scheduler.py): the runner's forwards compute every row independently
of the other rows, a prompt's chunks are fixed by the prompt alone and sampling is per request, so a request
produces exactly the tokens it produces alone, whatever else is running, queued or cancelled and whichever blocks
it is given.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

import torch

from ..errors import TrapetumError
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


class Scheduler:
    """Continuous batching over ``runner``: its ``kv`` (a PagedKV), ``prefill(table, tokens, start)`` -> logits [V]
    and ``decode(tables, tokens, positions)`` -> logits [S, V] (runtime/paged_ops.py)."""

    def __init__(self, runner, tokenizer: Tokenizer | None, vocab_size: int, context_size: int, *,
                 max_batch: int = 16, chunk: int = 64, prefill_budget: int | None = None, on_full: str = "queue",
                 device: str | torch.device = "cpu"):
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
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[Request] = []   # admitted, in admission order
        self._ids = itertools.count()
        self.steps = 0
        self.peak_batch = 0               # most requests decoded in one forward

    # -- requests ------------------------------------------------------------------------------
    def submit(self, prompt: list[int], settings: GenerationSettings, t0: float | None = None) -> Request:
        prompt = list(prompt)
        check_request(prompt, settings, self.context_size)
        req = Request(next(self._ids), prompt, settings, TokenStream(self.tokenizer, prompt, settings, t0))
        need = self.kv.blocks_needed(req.positions)
        if need > self.kv.num_blocks:
            raise TrapetumError(f"the request needs {need} KV blocks ({req.positions} positions), more than the "
                                f"whole cache of {self.kv.num_blocks} (--kv-blocks / --kv-mem)")
        if self.on_full == "reject" and (self.waiting or need > self.kv.alloc.num_free
                                         or len(self.active) >= self.max_batch):
            raise KVExhausted(need, self.kv.alloc.num_free, self.kv.num_blocks)
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
                "total_blocks": self.kv.num_blocks, "max_batch": self.max_batch}

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
        for req in [r for r in self.active if r.state == "prefill"]:
            if budget <= 0:
                break
            while budget > 0 and req.state == "prefill":
                n = min(self.chunk - req.computed % self.chunk, len(req.prompt) - req.computed)
                logits = self.runner.prefill(req.table, req.prompt[req.computed:req.computed + n], req.computed)
                req.computed += n
                budget -= n
                if req.computed == len(req.prompt):
                    req.state = "decode"
                    self._take(req, logits)
                    touched.append(req)
        rows = [r for r in self.active if r.state == "decode" and r not in touched]
        if rows:
            self.peak_batch = max(self.peak_batch, len(rows))
            logits = self.runner.decode([r.table for r in rows], [r.last for r in rows], [r.computed for r in rows])
            for r, row in zip(rows, logits):
                r.computed += 1
                self._take(r, row)
                touched.append(r)
        return touched

    def run(self) -> None:
        """Steps until nothing is waiting or running."""
        while self.has_work:
            self.step()

    def _admit(self) -> None:
        while self.waiting and len(self.active) < self.max_batch:
            req = self.waiting[0]
            need = self.kv.blocks_needed(req.positions)
            if need > self.kv.alloc.num_free:
                return  # FIFO: the head waits for blocks (no overtaking, so no starvation)
            self.waiting.popleft()
            req.blocks = self.kv.alloc.allocate(need)
            req.table = torch.tensor(req.blocks, dtype=torch.long)
            req.sampler = Sampler(req.settings, self.vocab_size, self.device, req.prompt)
            req.state = "prefill"
            self.active.append(req)

    def _take(self, req: Request, logits: torch.Tensor) -> None:
        """Sample ``req``'s next token from its logits row [V]; stream it; finish the request if it is done."""
        tok = int(req.sampler(logits)[0])
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


def drain(req: Request) -> list[StreamEvent]:
    """The events ``req`` has collected since the last drain."""
    out = []
    while req.events:
        out.append(req.events.popleft())
    return out
