"""Request validation, response shapes and the engine worker, in process (no HTTP, no model)."""
from __future__ import annotations

import threading
import time

import pytest
# Imported here, at collection: importing it inside a test made pytest's assertion rewriter parse
# anyio (a pytest plugin) deep in the test's call stack, where CPython 3.11.7's AST recursion
# check fails intermittently ("AST constructor recursion depth mismatch").
from starlette.testclient import TestClient

import serve_fixtures as F
from trapetum.serve import protocol as P
from trapetum.serve.worker import Job, NotReady, QueueFull, Worker

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return P.parse_chat_request({"model": "m", "messages": MSG, **kw})


def rejects(fn, param, status=400):
    with pytest.raises(P.APIError) as ei:
        fn()
    e = ei.value
    assert e.status == status
    assert e.param == param, (e.param, e.message)
    body = e.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return e


def test_chat_fields_parsed():
    r = chat(max_tokens=7, temperature=0, top_p=0.5, seed=3, stop="END", stream=True,
             stream_options={"include_usage": True}, top_k=4, min_p=0.1, repetition_penalty=1.1)
    assert r.max_tokens == 7 and r.stream and r.include_usage
    assert r.settings == {"temperature": 0.0, "top_p": 0.5, "seed": 3, "stop": ["END"], "top_k": 4,
                          "min_p": 0.1, "repetition_penalty": 1.1}
    assert chat(max_completion_tokens=9).max_tokens == 9
    assert chat().max_tokens is None and "temperature" not in chat().settings  # the server's default (serve/defaults.py)
    parts = P.parse_chat_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                                 {"type": "text", "text": "b"}]}]})
    assert parts.messages == [{"role": "system", "content": "ab"}] and parts.model is None


@pytest.mark.parametrize("kw,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 2}, "n"),
    ({"n": "1"}, "n"),
    ({"seed": "x"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"model": 7}, "model"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"stop": ["\udfff"]}, "stop"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
])
def test_chat_rejections(kw, param):
    rejects(lambda: P.parse_chat_request({"model": "m", "messages": MSG, **kw}), param)


def test_completion_prompt_forms():
    assert P.parse_completion_request({"prompt": "x"}).max_tokens == 16     # OpenAI's default
    assert P.parse_completion_request({"prompt": ["x"]}).prompt == "x"
    assert P.parse_completion_request({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert P.parse_completion_request({"prompt": [[1, 2]]}).prompt == [1, 2]
    rejects(lambda: P.parse_completion_request({}), "prompt")
    rejects(lambda: P.parse_completion_request({"prompt": ["a", "b"]}), "prompt")
    rejects(lambda: P.parse_completion_request({"prompt": [1, -2]}), "prompt")
    rejects(lambda: P.parse_completion_request({"prompt": {"a": 1}}), "prompt")
    rejects(lambda: P.parse_completion_request({"prompt": "x", "echo": True}), "echo")
    rejects(lambda: P.parse_completion_request(P.parse_json_body(b'{"prompt": "\\ud800"}')), "prompt")


@pytest.mark.parametrize("raw", [b"", b"{", b"[1,2]", b"\xff\xfe", b'{"a": NaN}', b"null", b"[" * 100000])
def test_bad_json(raw):
    e = rejects(lambda: P.parse_json_body(raw), None)
    assert e.code == "invalid_json"


def test_context_error_names_both_counts():
    e = P.context_error(8192, 8000, 500, where="messages")
    assert e.status == 400 and e.code == "context_length_exceeded"
    assert "8192" in e.message and "8000" in e.message and "500" in e.message and "8500" in e.message


# ----------------------------------------------------------------------------- worker

class Collect:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, kind, payload):
        self.events.append((kind, payload))
        if kind in ("done", "error"):
            self.done.set()


def make_worker(max_waiting=2, token_delay=0.005, gate: threading.Event | None = None):
    def load():
        if gate is not None:
            gate.wait(10)
        return None, F.FakeModel(name="fake", token_delay=token_delay)
    w = Worker([load], max_waiting=max_waiting)
    w.start()
    return w


def wait_state(w, state, timeout=5):
    t0 = time.time()
    while w.state != state and time.time() - t0 < timeout:
        time.sleep(0.01)
    assert w.state == state


def test_worker_runs_in_order_and_bounds_the_queue():
    gate = threading.Event()
    w = make_worker(max_waiting=2, token_delay=0.02, gate=gate)
    with pytest.raises(NotReady):
        w.submit(Job("fake", "text", "a b", {"max_new_tokens": 2}, Collect()))
    gate.set()
    wait_state(w, "ready")
    sinks = [Collect() for _ in range(3)]
    order = []
    for i, s in enumerate(sinks):
        def sink(kind, payload, s=s, i=i):
            if kind == "start":
                order.append(i)
            s(kind, payload)
        w.submit(Job("fake", "text", "a b", {"max_new_tokens": 5}, sink))
        if i == 0:
            t0 = time.time()
            while w.snapshot()["running"] == 0 and time.time() - t0 < 2:
                time.sleep(0.005)
    with pytest.raises(QueueFull) as ei:                 # 1 running + 2 waiting: the 4th is refused
        w.submit(Job("fake", "text", "a b", {"max_new_tokens": 5}, Collect()))
    assert ei.value.retry_after_s >= 1
    for s in sinks:
        assert s.done.wait(5)
        kinds = [k for k, _ in s.events]
        assert kinds[0] == "start" and kinds[-1] == "done" and kinds.count("token") == 5
    assert order == [0, 1, 2]
    snap = w.snapshot()
    assert snap["completed"] == 3 and snap["rejected"] == 1 and snap["running"] == 0
    w.stop()


def test_worker_cancel_running_and_queued():
    w = make_worker(max_waiting=4, token_delay=0.02)
    wait_state(w, "ready")
    a, b = Collect(), Collect()
    ja = Job("fake", "text", "a", {"max_new_tokens": 200}, a)
    jb = Job("fake", "text", "b", {"max_new_tokens": 200}, b)
    w.submit(ja)
    w.submit(jb)
    jb.cancel.set()                      # cancelled while waiting: never starts
    time.sleep(0.1)
    t0 = time.perf_counter()
    ja.cancel.set()                      # cancelled while running: stops at the next token
    assert a.done.wait(1.0) and b.done.wait(1.0)
    assert time.perf_counter() - t0 < 0.5
    assert a.events[-1][1].finish_reason == "cancelled"
    assert [k for k, _ in b.events] == ["done"] and b.events[0][1].finish_reason == "cancelled"
    assert w.snapshot()["cancelled"] == 2
    # A failing job reports an error and the engine keeps going.
    c = Collect()
    w.submit(Job("fake", "text", "x " * 300, {"max_new_tokens": 10}, c))
    assert c.done.wait(2) and c.events[-1][0] == "error"
    d = Collect()
    w.submit(Job("fake", "text", "ok", {"max_new_tokens": 2}, d))
    assert d.done.wait(2) and d.events[-1][0] == "done"
    w.stop()


def test_worker_load_failure_is_reported():
    def boom():
        raise RuntimeError("no such model")
    w = Worker([boom])
    w.start()
    wait_state(w, "failed")
    assert "no such model" in w.error


def test_models_on_two_devices_get_two_engines():

    from trapetum.serve.server import ModelSpec, create_app

    specs = [ModelSpec(alias="a", device="dev0", loader=lambda: F.FakeModel(name="x", token_delay=0.01)),
             ModelSpec(alias="b", device="dev1", loader=lambda: F.FakeModel(name="x", token_delay=0.01)),
             ModelSpec(alias="a", device="dev0", loader=lambda: F.FakeModel(name="x", token_delay=0.01))]
    with TestClient(create_app(specs)) as c:
        t0 = time.time()
        while c.get("/health").status_code != 200:
            assert time.time() - t0 < 10
            time.sleep(0.02)
        h = c.get("/health").json()
        assert len(h["engines"]) == 2 and h["models"] == ["a", "b", "a-2"]
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["a", "b", "a-2"]
        for name in ("a", "b", "a-2"):
            r = c.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["model"] == name
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})      # no model: the first
        assert r.json()["model"] == "a"


def test_cors_origins_and_api_key_in_process():

    from trapetum.serve.server import ModelSpec, create_app

    app = create_app([ModelSpec(loader=lambda: F.FakeModel(name="m"))], api_key="k",
                     cors_origins=["http://ui.example"])
    with TestClient(app) as c:
        pre = c.options("/v1/chat/completions", headers={"Origin": "http://ui.example",
                                                         "Access-Control-Request-Method": "POST",
                                                         "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.example"
        r = c.get("/v1/models", headers={"Origin": "http://ui.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://ui.example"
        r = c.get("/v1/models", headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
        assert r.status_code == 200
        # another web origin is refused outright (issue 21: a page must not drive the API), with no CORS grant
        r = c.get("/v1/models", headers={"Origin": "http://evil.example", "Authorization": "Bearer k"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in r.headers


def test_sse_keepalive_while_waiting(monkeypatch):

    from trapetum.serve import server as S

    monkeypatch.setattr(S, "KEEPALIVE_S", 0.05)
    app = S.create_app([S.ModelSpec(loader=lambda: F.FakeModel(name="m", token_delay=0.3))])
    with TestClient(app) as c:
        while c.get("/health").status_code != 200:
            time.sleep(0.02)
        body = {"messages": MSG, "max_tokens": 2, "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
    assert lines[0] == "data: " + lines[0][6:] and ": keep-alive" in lines
    events = F.sse_events(lines)
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["delta"].get("content") or ""
                                              for e in events[:-1]) == " w0 w1"
