"""Hostile model files and requests against ``trapetum serve`` (issue 21: findings 1, 2, 5, 6, 7, 8).

Servers run in subprocesses (tests/serve_fixtures.py): the fake model for everything about templates and the
network (its chat template rendered by trapetum's real renderer), the embedded model where sampling matters.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from argparse import Namespace

import httpx
import pytest

import serve_fixtures as F

MSG = [{"role": "user", "content": "hi"}]
SLOW = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE = {
    "power": "{{ (9**(9**8)) % 7 }}",
    "repeat": "{{ ('A' * 2000000000) | length }}",
    "zero": "{{ 1/0 }}",
    "format": "{{ '%d' | format('x') }}",
    "macro": "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}",
    "range": "{{ range(10**9) | list | length }}",
    "ljust": "{{ 'x'.ljust(2000000000) }}",
    "syntax": "{% for %}",
}
TEMPLATES = [None, SLOW, "{{ raise_exception('Conversation roles must alternate') }}", *HOSTILE.values()]


def err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture(scope="module")
def fake():
    srv = F.start_fake(templates=TEMPLATES, extra=["--template-timeout", "3", "--header-timeout", "2",
                                                     "--body-timeout", "2"])
    yield srv
    srv.stop()


def chat(srv, model: str, client=None, timeout: float = 30.0, **kw) -> httpx.Response:
    body = {"model": model, "messages": MSG, "max_tokens": 2, **kw}
    return (client or httpx).post(srv.url + "/v1/chat/completions", json=body, timeout=timeout)


def test_slow_template_stalls_nothing_else(fake):
    """Finding 1: while model b's template runs (until its 3 s timeout), /health and model a answer in < 1 s."""
    result: dict = {}

    def hostile():
        t0 = time.perf_counter()
        result["r"] = chat(fake, "fake-b")
        result["s"] = time.perf_counter() - t0
    t = threading.Thread(target=hostile)
    t.start()
    time.sleep(0.3)
    worst = 0.0
    while t.is_alive():
        t0 = time.perf_counter()
        assert fake.health(timeout=5)[0] == 200
        assert chat(fake, "fake-a", timeout=5).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.1)
    t.join()
    assert worst < 1.0, f"/health + a chat to the healthy model took {worst:.2f} s during the hostile render"
    e = err(result["r"], 422)
    assert e["code"] == "chat_template_error" and e["type"] == "server_error" and e["param"] is None
    assert "chat template of model 'fake-b'" in e["message"] and "3 s" in e["message"]
    assert 2.5 < result["s"] < 10


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_answer_422_naming_the_template(fake, name):
    """Findings 1-2: every gadget is a 422 naming the model's template, fast, never a 500; the server lives."""
    model = f"fake-{chr(ord('a') + 3 + list(HOSTILE).index(name))}"
    rss0 = fake.rss_bytes()
    t0 = time.perf_counter()
    e = err(chat(fake, model), 422)
    assert time.perf_counter() - t0 < 5
    assert e["code"] == "chat_template_error" and f"model '{model}'" in e["message"], e
    assert fake.rss_bytes() - rss0 < 64 << 20      # the 2 GB allocation happens (and fails) in the child
    assert fake.health()[0] == 200


def test_template_refusal_is_the_clients_400(fake):
    e = err(chat(fake, "fake-c"), 400)
    assert e["param"] == "messages" and e["code"] == "chat_template_rejected"
    assert "roles must alternate" in e["message"]


def _raw(port: int, requests: list[bytes]) -> list[bytes]:
    """Send requests one after another on ONE connection; the raw responses (b'' once it is closed)."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for req in requests:
            try:
                s.sendall(req)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, rest = data.partition(b"\r\n\r\n")
                n = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(
                    b"content-length")), b"0"))
                while len(rest) < n:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    rest += chunk
                out.append(head + b"\r\n\r\n" + rest)
            except OSError:
                out.append(b"")
    return out


def _post(port: int, body: bytes, ctype: bytes = b"application/json", host: bytes = b"127.0.0.1") -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: " + ctype +
            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def test_lone_surrogate_in_model_is_400_and_keeps_the_connection(fake):
    """Finding 5: "\\ud800" in "model" was a 500 that made uvicorn drop the keep-alive connection."""
    bad = _post(fake.port, b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}')
    good = _post(fake.port, json.dumps({"model": "fake-a", "messages": MSG, "max_tokens": 1}).encode())
    r1, r2 = _raw(fake.port, [bad, good])
    assert r1.startswith(b"HTTP/1.1 400") and b'"param":"model"' in r1, r1[:300]
    assert r2.startswith(b"HTTP/1.1 200"), r2[:300]


def test_host_origin_and_content_type_guards(fake):
    """Finding 6: DNS rebinding (foreign Host), cross-site pages (foreign Origin) and text/plain POSTs."""
    url = fake.url + "/v1/chat/completions"
    body = json.dumps({"model": "fake-a", "messages": MSG, "max_tokens": 1})
    e = err(httpx.post(url, content=body, headers={"Host": "evil.example", "Content-Type": "application/json"}), 403)
    assert e["code"] == "host_not_allowed"
    assert err(httpx.get(fake.url + "/health", headers={"Host": "rebind.evil.example:80"}), 403)
    for host in (f"localhost:{fake.port}", f"127.0.0.1:{fake.port}", f"[::1]:{fake.port}"):
        assert httpx.post(url, content=body, headers={"Host": host, "Content-Type": "application/json"}
                          ).status_code == 200, host
    for origin in ("http://evil.example", "null", f"http://localhost:{fake.port + 1}"):
        r = httpx.post(url, content=body, headers={"Origin": origin, "Content-Type": "application/json"})
        assert err(r, 403)["code"] == "origin_not_allowed", origin
    r = httpx.post(url, content=body, headers={"Origin": fake.url, "Content-Type": "application/json"})
    assert r.status_code == 200                  # the page at / itself (same origin)
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        r = httpx.post(url, content=body, headers={"Content-Type": ctype} if ctype else {})
        assert err(r, 415)["code"] == "unsupported_media_type", ctype


def test_allowed_host_option():
    srv = F.start_fake(extra=["--allowed-host", "box.lan"])
    try:
        assert httpx.get(srv.url + "/health", headers={"Host": f"box.lan:{srv.port}"}).status_code == 200
        assert httpx.get(srv.url + "/health", headers={"Host": "other.lan"}).status_code == 403
    finally:
        srv.stop()


def test_slowloris_connections_are_closed(fake):
    """Finding 7: 300 connections trickling their headers are all closed after the 2 s header timeout; the
    server answers throughout; a body that does not arrive gets 408."""
    socks = []
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", fake.port), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        socks.append(s)
    t0 = time.perf_counter()
    assert fake.health(timeout=2)[0] == 200
    for s in socks:
        try:
            s.sendall(b"X-a: b\r\n")          # keep trickling
        except OSError:
            pass
    time.sleep(3.0)
    closed = 0
    for s in socks:
        s.settimeout(5)
        try:
            closed += s.recv(1) == b""
        except OSError:
            closed += 1
        s.close()
    assert closed == len(socks), f"{len(socks) - closed} of {len(socks)} slow connections still open"
    assert time.perf_counter() - t0 < 15
    partial = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: 100\r\n\r\n{\"prompt\"")
    (r,) = _raw(fake.port, [partial])
    assert r.startswith(b"HTTP/1.1 408"), r[:200]


def test_models_list_shows_no_paths():
    srv = F.shared_server(["--api-key", "sk-trapetum-test", "--queue", "128", "--threads", "1"])
    data = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer sk-trapetum-test"}).json()

    def strings(x):
        if isinstance(x, dict):
            for v in x.values():
                yield from strings(v)
        elif isinstance(x, list):
            for v in x:
                yield from strings(v)
        elif isinstance(x, str):
            yield x
    found = list(strings(data))
    assert any(s.endswith(".gguf") for s in found), found      # the file name stays
    assert not [s for s in found if s.startswith("/") or "/" in s and s.endswith((".gguf", ".cbk"))], found


@pytest.mark.parametrize("field,value,status", [
    ("temperature", 1e-300, 200), ("temperature", 5e-324, 200), ("temperature", 1e-45, 200),
    ("repetition_penalty", 1e-300, 400), ("repetition_penalty", 0.001, 400), ("repetition_penalty", 0.5, 200),
])
def test_tiny_sampling_values(field, value, status):
    """Finding 5: these were "probability tensor contains inf/nan" 500s on the real model."""
    srv = F.shared_server(["--api-key", "sk-trapetum-test", "--queue", "128", "--threads", "1"])
    body = {"messages": MSG, "max_tokens": 3, "temperature": 0.7, field: value, "seed": 1}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": "Bearer sk-trapetum-test"})
    if status == 200:
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    else:
        assert err(r, status)["param"] == field


def test_api_key_from_file_or_environment(tmp_path, monkeypatch, capsys):
    """Finding 8: the key need not be on the command line (ps); bad key files are one-line errors."""
    from trapetum.commands.serve import _api_key
    from trapetum.errors import TrapetumError

    def args(**kw):
        return Namespace(**{"api_key": None, "api_key_file": None, **kw})
    monkeypatch.delenv("TRAPETUM_API_KEY", raising=False)
    assert _api_key(args()) is None
    monkeypatch.setenv("TRAPETUM_API_KEY", "sk-env")
    assert _api_key(args()) == "sk-env"
    f = tmp_path / "key"
    f.write_text("sk-file\n")
    assert _api_key(args(api_key_file=str(f))) == "sk-file"
    assert _api_key(args(api_key="sk-argv")) == "sk-argv" and "visible" in capsys.readouterr().err
    for content, match in (("", "empty"), ("a b\n", "printable"), ("x" * 5000, "larger")):
        f.write_text(content)
        with pytest.raises(TrapetumError, match=match):
            _api_key(args(api_key_file=str(f)))
    with pytest.raises(TrapetumError, match="cannot read"):
        _api_key(args(api_key_file=str(tmp_path / "missing")))
    with pytest.raises(TrapetumError, match="not both"):
        _api_key(args(api_key="a", api_key_file=str(f)))


def _random_json(rng, depth=0):
    pick = rng.randrange(10 if depth < 3 else 7)
    if pick == 0:
        return rng.choice([None, True, False])
    if pick == 1:
        return rng.choice([0, 1, -1, 2**31, 2**64, -2**70, 10**400 if rng.random() < 0.1 else 7])
    if pick == 2:
        return rng.choice([0.0, 1e-300, 5e-324, -1e-45, 1e308, 0.5, 2.0000001])
    if pick in (3, 4):
        return rng.choice(["", "x", "user", "system", "assistant", "text", "\u0000", "fake-a", "\ud800",
                           "<|im_start|>", "a" * 5000])
    if pick == 5:
        return rng.randint(-3, 300)
    if pick == 6:
        return rng.uniform(-3, 3)
    if pick in (7, 8):
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["role", "content", "type", "text", "include_usage", "x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "repetition_penalty", "seed", "stop", "stream", "stream_options", "n", "ignore_eos", "user",
          "response_format", "logprobs", "echo", "presence_penalty", "tools"]


def test_random_bodies_never_500():
    """Finding 5, in process over the fake model (with a real chat template): random JSON in every field, a
    few seconds' worth; every answer is a 200 or an OpenAI-shaped 4xx, never a 500. By hand, longer:
    ``python3 -c "import test_hostile_serve as T; print(T.fuzz_bodies(120, seed=7))"`` (from tests/)."""
    n, seen = fuzz_bodies(4.0)
    print(f"{n} random bodies: {seen}")
    assert n > 100 and 200 in seen and 400 in seen


def fuzz_bodies(seconds: float, seed: int = 21) -> tuple[int, dict[int, int]]:
    import random

    from starlette.testclient import TestClient

    from trapetum.serve.server import ModelSpec, create_app
    from trapetum.tokenizer import Tokenizer
    from tokenizers import Tokenizer as HF
    from tokenizers.models import WordLevel

    tk = Tokenizer(HF(WordLevel({"<unk>": 0}, unk_token="<unk>")), bos_token=None, eos_tokens=[],
                   chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    app = create_app([ModelSpec(alias="fake-a", loader=lambda: F.FakeModel(name="m", token_delay=0.0, tokenizer=tk))])
    rng = random.Random(seed)
    seen: dict[int, int] = {}
    with TestClient(app) as c:
        while c.get("/health").status_code != 200:
            time.sleep(0.02)
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < seconds:
            body = {"messages": MSG, "prompt": "hi", "max_tokens": 2}
            for f in rng.sample(FIELDS, rng.randint(1, 3)):
                body[f] = _random_json(rng)
            path = rng.choice(["/v1/chat/completions", "/v1/completions"])
            try:
                raw = json.dumps(body).encode()
            except ValueError:
                continue
            r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            n += 1
            if r.status_code != 200:
                assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
                err(r, r.status_code)
    return n, seen


@pytest.mark.parametrize("settings", [
    {"top_p": 5e-324}, {"top_p": 1e-300, "temperature": 2}, {"min_p": 1.0, "temperature": 2},
    {"top_k": 2**62}, {"top_k": 1, "temperature": 2}, {"repetition_penalty": 0.01, "temperature": 2},
    {"repetition_penalty": 10, "temperature": 1e-5}, {"seed": -2**63}, {"seed": 2**64 - 1},
    {"temperature": 2, "top_p": 1, "min_p": 0, "top_k": 0, "repetition_penalty": 0.01, "seed": 0},
])
def test_extreme_valid_sampling_settings_generate(settings):
    """Every value the API accepts generates on the real model (float32 sampler), none is a 500."""
    srv = F.shared_server(["--api-key", "sk-trapetum-test", "--queue", "128", "--threads", "1"])
    body = {"prompt": "The capital of France is", "max_tokens": 4, **settings}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60,
                   headers={"Authorization": "Bearer sk-trapetum-test"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
