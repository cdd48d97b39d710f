"""The serve worker's batched loop in-process (serve/worker.py): jobs of a batched model decoded together, each
job's events in order (start, tokens, done); a failing scheduler step fails that step's jobs only and the engine
thread keeps serving; a job cancelled while its request waits in the scheduler ends "cancelled"."""
from __future__ import annotations

import threading
import time

import pytest

import trapetum
from tests.tiny_models import build
from trapetum.serve.worker import Job, Worker


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama3")
    build("llama3", d, tokenizer=True)
    return trapetum.load(str(d))


class Sink:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, kind, payload):
        self.events.append((kind, payload))
        if kind in ("done", "error"):
            self.done.set()


def _worker(model, **batch):
    w = Worker([lambda: ("tiny", model)], batch={"max_batch": 4, "kv_blocks": 40, **batch})
    w.start()
    t0 = time.time()
    while w.state != "ready":
        assert time.time() - t0 < 60 and w.state != "failed", w.error
        time.sleep(0.01)
    return w


def _job(sink, prompt="the king", **settings):
    return Job(model="tiny", kind="text", inputs=prompt, settings={"max_new_tokens": 8, "ignore_eos": True,
                                                                   **settings}, sink=sink)


def test_jobs_stream_in_order_and_a_failing_step_fails_only_its_jobs(model):
    w = _worker(model)
    try:
        sinks = [Sink() for _ in range(3)]
        for s in sinks:
            w.submit(_job(s))
        for s in sinks:
            assert s.done.wait(60)
            kinds = [k for k, _ in s.events]
            assert kinds[0] == "start" and kinds[-1] == "done" and set(kinds[1:-1]) == {"token"}
            assert s.events[-1][1].completion_tokens == 8
        texts = {s.events[-1][1].text for s in sinks}
        assert len(texts) == 1  # the same greedy request, batched: the same text
        sched = w.schedulers["tiny"]
        real = sched.runner.decode
        calls = []

        def broken(*a, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("boom")
            return real(*a, **kw)
        sched.runner.decode = broken
        bad = Sink()
        w.submit(_job(bad))
        assert bad.done.wait(60) and bad.events[-1][0] == "error" and "boom" in str(bad.events[-1][1])
        sched.runner.decode = real
        good = Sink()
        w.submit(_job(good))
        assert good.done.wait(60) and good.events[-1][0] == "done"
        assert good.events[-1][1].text == texts.pop()
        snap = w.snapshot()
        assert snap["failed"] == 1 and snap["running"] == 0 and snap["batch"]["tiny"]["free_blocks"] == 40
    finally:
        w.stop()


def test_cancel_while_queued_in_the_scheduler(model):
    w = _worker(model, max_batch=1)
    try:
        first, second = Sink(), Sink()
        w.submit(_job(first, max_new_tokens=60))
        job = _job(second)
        w.submit(job)
        t0 = time.time()
        while not any(k == "token" for k, _ in first.events):
            assert time.time() - t0 < 30
            time.sleep(0.005)
        job.cancel.set()
        assert second.done.wait(5)
        assert second.events[-1][0] == "done" and second.events[-1][1].finish_reason == "cancelled"
        assert first.done.wait(60) and first.events[-1][1].finish_reason == "length"
    finally:
        w.stop()
