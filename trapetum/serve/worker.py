"""The engine thread: owns the models, runs queued generation jobs in order, one at a time.

A ``trapetum.api.Model`` is not thread-safe, so exactly one thread touches it. HTTP handlers
``submit`` a ``Job``; the worker takes jobs from a bounded FIFO (``QueueFull`` past it) and
streams each job's events back through ``Job.sink``, a callable that is invoked on the worker
thread (the server's sink hops onto the asyncio loop with ``call_soon_threadsafe``).

Cancellation: ``job.cancel`` is a ``threading.Event``. A queued job that is cancelled is
dropped when it reaches the head of the queue; a running one stops at its next token (the
engine checks the event, and so does this loop).

Batching later: ``_take_batch`` returns a list; today it is a list of one and ``_run_batch``
streams it. A batched engine replaces those two methods, nothing else.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import TrapetumError

log = logging.getLogger("trapetum.serve")


class PlainView:
    """A speculative Model seen as a plain one (``NAME:plain`` in the server): its streams decode without the
    drafter; everything else is the model's own."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def stream(self, *a, **kw):
        return self._model.stream(*a, speculative=False, **kw)

    def chat_stream(self, *a, **kw):
        return self._model.chat_stream(*a, speculative=False, **kw)


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"{waiting} requests are already waiting")
        self.waiting = waiting
        self.retry_after_s = retry_after_s


class NotReady(Exception):
    pass


@dataclass
class Job:
    """One generation request. ``kind`` is "chat" (inputs = messages) or "text" (inputs = prompt).

    ``sink(kind, payload)`` receives, on the worker thread:
      ("start", None) when the engine picks the job up,
      ("token", StreamEvent) per generated token,
      ("done", Completion) once, at the end (finish_reason may be "cancelled"),
      ("error", Exception) instead of "done" if generation failed.
    """
    model: str
    kind: str
    inputs: Any
    settings: dict
    sink: Callable[[str, Any], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def queue_s(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.enqueued_at


@dataclass
class _Cancelled:
    """Stand-in Completion for a job dropped before it started."""
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: str = "cancelled"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    tokens_per_s: float | None = None


class Worker:
    """One engine thread serving ``models`` (loaded on that thread by ``loaders``)."""

    def __init__(self, loaders: list[Callable[[], tuple[str | None, Any]]], *, max_waiting: int = 64,
                 name: str = "engine", claim: Callable[[str], str] | None = None,
                 init: Callable[[], None] | None = None):
        """``loaders`` return ``(preferred_name or None, model)``; ``claim(name)`` makes a name unique
        across workers (default: unique within this one); ``init()`` runs first on the engine thread
        (per-thread settings such as torch's CPU thread count)."""
        self.init = init
        self.loaders = loaders
        self.claim = claim
        self.max_waiting = max_waiting
        self.name = name
        self.models: dict[str, Any] = {}
        self.state = "loading"          # loading | ready | failed | stopped
        self.error: str | None = None
        self.load_s = 0.0               # seconds spent loading models
        self.on_ready: Callable[["Worker"], None] | None = None
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._running: Job | None = None
        self._stop = False
        self._avg_job_s = 1.0
        self.stats = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0, "tokens": 0}
        self._thread = threading.Thread(target=self._main, name=f"trapetum-{name}", daemon=True)

    # ------------------------------------------------------------------ control (any thread)
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
        self.cancel_all()
        self._thread.join(timeout)

    def cancel_all(self) -> None:
        """Cancel every waiting and running job (the engine keeps running)."""
        with self._cv:
            for j in self._waiting:
                j.cancel.set()
            if self._running is not None:
                self._running.cancel.set()
            self._cv.notify_all()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self.state != "ready":
                raise NotReady(self.state)
            live = sum(1 for j in self._waiting if not j.cancel.is_set())
            if live >= self.max_waiting:
                self.stats["rejected"] += 1
                busy = live + (1 if self._running is not None else 0)
                raise QueueFull(live, max(1, round(busy * self._avg_job_s)))
            self._waiting.append(job)
            self._cv.notify()

    def snapshot(self) -> dict:
        with self._cv:
            return {"state": self.state, "models": list(self.models), "running": int(self._running is not None),
                    "waiting": sum(1 for j in self._waiting if not j.cancel.is_set()),
                    "max_waiting": self.max_waiting, **self.stats}

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        try:
            if self.init is not None:
                self.init()
            for load in self.loaders:
                t0 = time.perf_counter()
                alias, m = load()
                self.load_s += time.perf_counter() - t0
                want = alias or getattr(m, "name", None) or "model"
                name = self.claim(want) if self.claim else _unique(want, self.models)
                self.models[name] = m
                if getattr(m, "speculative", None) is not None:  # the same weights decoded plainly, to compare
                    plain = f"{name}:plain"
                    plain = self.claim(plain) if self.claim else _unique(plain, self.models)
                    self.models[plain] = PlainView(m)
            if self.on_ready:         # e.g. register the models; before "ready", so /health waits for it
                self.on_ready(self)
        except BaseException as e:  # noqa: BLE001 -- reported through /health, never raised into the loop
            self.error = f"{type(e).__name__}: {e}"
            self.state = "failed"
            log.error("model loading failed: %s", self.error)
            if not isinstance(e, TrapetumError):
                log.error("%s", traceback.format_exc())
            return
        with self._cv:
            self.state = "ready"
        while True:
            batch = self._take_batch()
            if batch is None:
                break
            self._run_batch(batch)
        with self._cv:
            self.state = "stopped"

    def _take_batch(self) -> list[Job] | None:
        with self._cv:
            while True:
                if self._stop:
                    return None
                while self._waiting and self._waiting[0].cancel.is_set():
                    j = self._waiting.popleft()
                    self.stats["cancelled"] += 1
                    _safe_sink(j, "done", _Cancelled())
                if self._waiting:
                    job = self._waiting.popleft()
                    self._running = job
                    return [job]
                self._cv.wait()

    def _run_batch(self, batch: list[Job]) -> None:
        (job,) = batch
        job.started_at = time.perf_counter()
        try:
            _safe_sink(job, "start", None)
            model = self.models[job.model]
            if job.kind == "chat":
                it = model.chat_stream(job.inputs, cancel=job.cancel, **job.settings)
            else:
                it = model.stream(job.inputs, cancel=job.cancel, **job.settings)
            completion = None
            try:
                for ev in it:
                    if ev.done:
                        completion = ev.completion
                        break
                    _safe_sink(job, "token", ev)
                    if job.cancel.is_set():
                        break
            finally:
                close = getattr(it, "close", None)
                if close:
                    close()
            if completion is None:       # we broke out on cancel before the engine's last event
                completion = _Cancelled()
            self.stats["tokens"] += int(completion.completion_tokens or 0)
            if job.cancel.is_set() or completion.finish_reason == "cancelled":
                self.stats["cancelled"] += 1
            else:
                self.stats["completed"] += 1
            job.finished_at = time.perf_counter()
            _safe_sink(job, "done", completion)
        except BaseException as e:  # noqa: BLE001 -- one bad job must not kill the engine thread
            self.stats["failed"] += 1
            if not isinstance(e, TrapetumError):
                log.error("generation failed:\n%s", traceback.format_exc())
            job.finished_at = time.perf_counter()
            _safe_sink(job, "error", e)
        finally:
            dt = (job.finished_at or time.perf_counter()) - job.started_at
            self._avg_job_s = 0.8 * self._avg_job_s + 0.2 * dt
            with self._cv:
                self._running = None


def _safe_sink(job: Job, kind: str, payload: Any) -> None:
    try:
        job.sink(kind, payload)
    except Exception:  # noqa: BLE001 -- e.g. the event loop closed under a late job
        job.cancel.set()


def _unique(name: str, taken: dict) -> str:
    if name not in taken:
        return name
    i = 2
    while f"{name}-{i}" in taken:
        i += 1
    return f"{name}-{i}"
