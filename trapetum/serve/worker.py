"""The engine thread: owns the models, runs queued generation jobs in order, one at a time.

A ``trapetum.api.Model`` is not thread-safe, so exactly one thread touches it. HTTP handlers
``submit`` a ``Job``; the worker takes jobs from a bounded FIFO (``QueueFull`` past it) and
streams each job's events back through ``Job.sink``, a callable that is invoked on the worker
thread (the server's sink hops onto the asyncio loop with ``call_soon_threadsafe``).

Cancellation: ``job.cancel`` is a ``threading.Event``. A queued job that is cancelled is
dropped when it reaches the head of the queue; a running one stops at its next token (the
engine checks the event, and so does this loop).

Batching (``batch``: the options of ``Model.batch_scheduler``, or None): each model that can (the CPU
reference path, no drafter) gets a Scheduler (runtime/scheduler.py); its jobs join it at step boundaries and are
decoded together, each streamed as alone (the same tokens). The loop takes every waiting job of a batched model
at once, steps the schedulers, hands each job its events and cancels a job's request at the next step after
``job.cancel`` is set (its KV blocks freed). Jobs of other models (the GPU engine, speculative models, their
``:plain`` views, test fakes) run one at a time as before, the batch pausing while one runs.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import TrapetumError, UnsupportedError

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


@dataclass(eq=False)
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
                 init: Callable[[], None] | None = None, batch: dict | None = None):
        """``loaders`` return ``(preferred_name or None, model)``; ``claim(name)`` makes a name unique
        across workers (default: unique within this one); ``init()`` runs first on the engine thread
        (per-thread settings such as torch's CPU thread count); ``batch``: keyword arguments of
        ``Model.batch_scheduler`` (None: one job at a time)."""
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
        self.batch = batch
        self.schedulers: dict[str, Any] = {}     # model name -> Scheduler (engine thread only)
        self._active: dict[Job, Any] = {}        # batched jobs submitted to a scheduler -> their Request
        self._loads: dict[str, dict] = {}        # model name -> Scheduler.load(), after the last step
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
            for j in list(self._waiting) + list(self._active):
                j.cancel.set()
            if self._running is not None:
                self._running.cancel.set()
            self._cv.notify_all()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self.state != "ready":
                raise NotReady(self.state)
            live = sum(1 for j in self._waiting if not j.cancel.is_set()) + self._queued()
            if live >= self.max_waiting:
                self.stats["rejected"] += 1
                busy = live + self._busy()
                lanes = max(1, sum(d["max_batch"] for d in self._loads.values()))  # jobs that run at once
                raise QueueFull(live, max(1, round(busy * self._avg_job_s / lanes)))
            self._waiting.append(job)
            self._cv.notify()

    def _queued(self) -> int:
        return sum(d["queued"] for d in self._loads.values())

    def _busy(self) -> int:
        return int(self._running is not None) + sum(d["running"] for d in self._loads.values())

    def snapshot(self) -> dict:
        """State and load: ``running`` jobs (batched ones included), ``waiting`` ones (in the queue or a
        scheduler's), the job counters, and per batched model its scheduler's load (running, queued, free KV
        blocks of the total, max_batch, preemptions)."""
        with self._cv:
            snap = {"state": self.state, "models": list(self.models), "running": self._busy(),
                    "waiting": sum(1 for j in self._waiting if not j.cancel.is_set()) + self._queued(),
                    "max_waiting": self.max_waiting, **self.stats}
            if self._loads:
                snap["batch"] = {name: dict(d) for name, d in self._loads.items()}
            return snap

    def check_fits(self, model: str, prompt_tokens: int, max_new_tokens: int) -> str | None:
        """Why a request of this size can never run on ``model``'s KV cache (None: it can); any thread."""
        sched = self.schedulers.get(model)
        if sched is None:
            return None
        kv = sched.kv
        need = kv.blocks_needed(prompt_tokens + max(max_new_tokens, 1) - 1)
        if need <= kv.num_blocks:
            return None
        return (f"The request needs {need} KV blocks ({prompt_tokens} prompt + {max_new_tokens} new tokens), more "
                f"than the server's whole KV cache of {kv.num_blocks} blocks of {kv.block_size}: lower max_tokens, "
                "or restart the server with a larger --kv-blocks / --kv-mem.")

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
            self._make_schedulers()
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
            jobs = self._take_batch()
            if jobs is None:
                break
            for job in jobs:
                if job.model in self.schedulers:
                    self._admit(job)
                else:
                    self._run_batch([job])
            if self._active:
                self._step()
        for job in list(self._active):  # stopping: every batched job ends ("cancelled")
            job.cancel.set()
        if self._active:
            self._step()
        with self._cv:
            self.state = "stopped"

    def _make_schedulers(self) -> None:
        if self.batch is None:
            return
        for name, m in self.models.items():
            if isinstance(m, PlainView) or getattr(m, "speculative", None) is not None \
                    or not hasattr(m, "batch_scheduler"):
                continue
            try:
                self.schedulers[name] = sched = m.batch_scheduler(**self.batch)
            except UnsupportedError as e:
                log.info("model %s decodes one request at a time: %s", name, e)
                continue
            self._loads[name] = sched.load()

    def _take_batch(self) -> list[Job] | None:
        """The jobs to start now: every waiting job of a batched model up to the first other one, or that other
        one alone (``_running``); [] when only the schedulers have work; None when stopping."""
        with self._cv:
            while True:
                if self._stop:
                    return None
                jobs: list[Job] = []
                while self._waiting:
                    j = self._waiting[0]
                    if j.cancel.is_set():
                        self._waiting.popleft()
                        self.stats["cancelled"] += 1
                        _safe_sink(j, "done", _Cancelled())
                    elif j.model in self.schedulers:
                        jobs.append(self._waiting.popleft())
                    elif not jobs:
                        self._running = self._waiting.popleft()
                        return [self._running]
                    else:
                        break
                if jobs or self._active:
                    return jobs
                self._cv.wait()

    # ------------------------------------------------------------------ batched jobs (engine thread)
    def _admit(self, job: Job) -> None:
        model, sched = self.models[job.model], self.schedulers[job.model]
        try:
            if job.kind == "chat":
                ids = model.encode_chat(job.inputs)
            else:
                ids = model.encode(job.inputs) if isinstance(job.inputs, str) else list(job.inputs)
            req = sched.submit(ids, model._settings(None, job.settings))
        except BaseException as e:  # noqa: BLE001 -- a bad job must not stop the others
            self.stats["failed"] += 1
            if not isinstance(e, TrapetumError):
                log.error("generation failed:\n%s", traceback.format_exc())
            job.started_at = job.finished_at = time.perf_counter()
            _safe_sink(job, "error", e)
            return
        with self._cv:
            self._active[job] = req
        self._load(job.model)

    def _step(self) -> None:
        """Cancel what was cancelled, one step of every scheduler with work, then every job's new events."""
        for job, req in list(self._active.items()):
            if job.cancel.is_set() and not req.done:
                self.schedulers[job.model].cancel(req)
        for name, sched in self.schedulers.items():
            if not sched.has_work:
                self._load(name)
                continue
            try:
                sched.step()
            except BaseException as e:  # noqa: BLE001 -- fail this model's jobs, keep the engine thread
                log.error("batched generation failed:\n%s", traceback.format_exc())
                for job, req in list(self._active.items()):
                    if job.model == name:
                        sched.cancel(req)
                        self._end(job, error=e)
            self._load(name)
        for job, req in list(self._active.items()):
            self._deliver(job, req)

    def _deliver(self, job: Job, req) -> None:
        from ..runtime.scheduler import drain
        if job.started_at is None and (req.state != "waiting" or req.done):
            job.started_at = time.perf_counter()
            _safe_sink(job, "start", None)
        completion = None
        for ev in drain(req):
            if ev.done:
                completion = ev.completion
            else:
                _safe_sink(job, "token", ev)
        if completion is not None:
            self.stats["tokens"] += int(completion.completion_tokens or 0)
            if job.cancel.is_set() or completion.finish_reason == "cancelled":
                self.stats["cancelled"] += 1
            else:
                self.stats["completed"] += 1
            self._end(job, completion=completion)

    def _end(self, job: Job, completion=None, error: BaseException | None = None) -> None:
        job.finished_at = time.perf_counter()
        if error is not None:
            self.stats["failed"] += 1
            _safe_sink(job, "error", error)
        else:
            _safe_sink(job, "done", completion)
        dt = job.finished_at - (job.started_at or job.finished_at)
        self._avg_job_s = 0.8 * self._avg_job_s + 0.2 * dt
        with self._cv:
            self._active.pop(job, None)

    def _load(self, name: str) -> None:
        load = self.schedulers[name].load()
        with self._cv:
            self._loads[name] = load

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
