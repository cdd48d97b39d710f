"""Servers for the serve tests, each in a real subprocess on a free loopback port.

    srv = shared_server(["--queue", "128"])      # `trapetum serve` (embedded default model), cached
    srv = start_fake(queue=2, token_delay=0.05)  # the same server over FakeModel (fast, deterministic)
    srv.url, srv.pid, srv.rss_bytes(), srv.health(), srv.stop()

Servers started through ``shared_server`` live until the test process exits (atexit), so test
modules share one model load. ``python tests/serve_fixtures.py fake --port N ...`` runs the fake
server itself (that is what ``start_fake`` spawns).
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCREENSHOTS = REPO / "out" / "screenshots"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM if the test process dies (a killed run leaves no server)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ServerProcess:
    def __init__(self, argv: list[str], port: int, api_key: str | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="trapetum-serve-", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_die_with_parent)
        self.pid = self.proc.pid

    def log_text(self) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")
        except OSError:
            return ""

    def health(self, timeout: float = 5.0) -> tuple[int, dict]:
        import httpx
        r = httpx.get(self.url + "/health", timeout=timeout)
        return r.status_code, r.json()

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        import httpx
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                code, body = self.health(timeout=2)
                if code == 200:
                    return self
                if body.get("status") == "error":
                    raise RuntimeError(f"server failed to load: {body}\n{self.log_text()[-4000:]}")
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_text()[-4000:]}")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def start_serve(args: list[str] = (), *, wait: bool = True) -> ServerProcess:
    """``trapetum serve ARGS`` on a free port (the real CLI, the real model)."""
    port = free_port()
    argv = [sys.executable, "-m", "trapetum.cli", "serve", *args, "--port", str(port), "--no-access-log"]
    key = args[list(args).index("--api-key") + 1] if "--api-key" in args else None
    srv = ServerProcess(argv, port, key)
    return srv.wait_ready() if wait else srv


_shared: dict[tuple, ServerProcess] = {}
_lock = threading.Lock()


def shared_server(args: list[str] = ()) -> ServerProcess:
    """One ``trapetum serve ARGS`` per distinct ARGS for the whole test run."""
    key = tuple(args)
    with _lock:
        srv = _shared.get(key)
        if srv is None or srv.proc.poll() is not None:
            srv = _shared[key] = start_serve(list(args))
        return srv


@atexit.register
def _stop_all() -> None:
    for srv in _shared.values():
        srv.stop()


def start_fake(*, queue: int = 64, token_delay: float = 0.01, load_delay: float = 0.0, models: int = 1,
               context: int = 256, api_key: str | None = None, wait: bool = True,
               templates: list[str | None] | None = None, extra: list[str] = ()) -> ServerProcess:
    """``templates[i]``: a chat template that model i renders (through trapetum's renderer) before answering;
    ``extra``: more arguments (--template-timeout S, --header-timeout S, --body-timeout S, --allowed-host H)."""
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), "fake", "--port", str(port), "--queue", str(queue),
            "--token-delay", str(token_delay), "--load-delay", str(load_delay), "--models", str(models),
            "--context", str(context), *extra]
    if api_key:
        argv += ["--api-key", api_key]
    if templates:
        f = tempfile.NamedTemporaryFile("w", prefix="trapetum-templates-", suffix=".json", delete=False)
        json.dump(templates, f)
        f.close()
        argv += ["--templates", f.name]
    srv = ServerProcess(argv, port, api_key)
    return srv.wait_ready() if wait else srv


# ----------------------------------------------------------------------------- a fake model

@dataclass
class _Completion:
    text: str
    token_ids: list
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float = 0.0
    tokens_per_s: float = 0.0


@dataclass
class _Event:
    text: str
    token_id: int | None = None
    done: bool = False
    completion: _Completion | None = None


@dataclass
class FakeModel:
    """Follows trapetum.api.Model's serving surface. Tokens are words; output is " w0 w1 ...",
    one word every ``token_delay`` seconds; a prompt containing "STOPNOW" makes it stop at once."""
    name: str = "fake"
    token_delay: float = 0.01
    context_size: int = 256
    path: str = "fake://model"
    config: dict = field(default_factory=dict)
    tokenizer: object = None        # a trapetum Tokenizer with a chat template: encode_chat renders it

    def info(self) -> dict:
        return {"family": "fake", "parameters": 0, "context": self.context_size}

    def count_tokens(self, prompt: str) -> int:
        return len(prompt.split()) + 1

    def encode_chat(self, messages) -> list[int]:
        if self.tokenizer is not None:
            text = self.tokenizer.apply_chat_template(messages)
        else:
            text = " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"
        return list(range(self.count_tokens(text)))

    def stream(self, prompt, settings=None, *, cancel=None, **kw):
        n_prompt = len(prompt) if isinstance(prompt, list) else self.count_tokens(prompt)
        max_new = kw.get("max_new_tokens", 16)
        if n_prompt + max_new > self.context_size:
            from trapetum.errors import TrapetumError
            raise TrapetumError("context overflow")
        stop_now = isinstance(prompt, str) and "STOPNOW" in prompt
        return self._gen(n_prompt, 0 if stop_now else max_new, cancel, kw.get("stop") or [])

    def _gen(self, n_prompt, max_new, cancel, stops):
        t0 = time.perf_counter()
        out, ids, finish = "", [], "length" if max_new else "stop"
        for i in range(max_new):
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            time.sleep(self.token_delay)
            piece = f" w{i}"
            if any(s in out + piece for s in stops):
                finish = "stop"
                break
            out += piece
            ids.append(i)
            yield _Event(piece, i)
        dt = time.perf_counter() - t0
        yield _Event("", None, True, _Completion(out, ids, finish, n_prompt, len(ids), self.token_delay,
                                                 len(ids) / dt if dt > 0 else 0.0))

    def chat_stream(self, messages, settings=None, *, cancel=None, **kw):
        return self.stream(self.encode_chat(messages), settings, cancel=cancel, **kw)


def _main_fake(argv: list[str]) -> None:
    import argparse
    sys.path.insert(0, str(REPO))
    from trapetum.serve.server import ModelSpec, run
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--queue", type=int, default=64)
    p.add_argument("--token-delay", type=float, default=0.01)
    p.add_argument("--load-delay", type=float, default=0.0)
    p.add_argument("--models", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--api-key", default=None)
    p.add_argument("--templates", default=None, help="JSON file: a list of chat templates (or null), one per model")
    p.add_argument("--template-timeout", type=float, default=5.0)
    p.add_argument("--header-timeout", type=float, default=10.0)
    p.add_argument("--body-timeout", type=float, default=30.0)
    p.add_argument("--allowed-host", action="append", default=None)
    a = p.parse_args(argv)
    templates = json.loads(Path(a.templates).read_text()) if a.templates else []

    def tokenizer(template):
        if template is None:
            return None
        from tokenizers import Tokenizer as HF
        from tokenizers.models import WordLevel

        from trapetum.tokenizer import TemplateLimits, Tokenizer
        return Tokenizer(HF(WordLevel({"<unk>": 0}, unk_token="<unk>")), bos_token=None, eos_tokens=[],
                         chat_template=template, source=f"fake-{template[:10]}.gguf",
                         template_limits=TemplateLimits(timeout_s=a.template_timeout))

    def loader(i):
        def load():
            time.sleep(a.load_delay)
            return FakeModel(name=f"fake-{chr(ord('a') + i)}", token_delay=a.token_delay * (1 + i),
                             context_size=a.context,
                             tokenizer=tokenizer(templates[i] if i < len(templates) else None))
        return load

    specs = [ModelSpec(loader=loader(i)) for i in range(max(a.models, len(templates)))]
    run(specs, port=a.port, max_waiting=a.queue, api_key=a.api_key, access_log=False,
        header_timeout_s=a.header_timeout, body_timeout_s=a.body_timeout, allowed_hosts=a.allowed_host)


def sse_events(lines) -> list:
    """Parse ``data: ...`` SSE lines into JSON objects (and the string "[DONE]")."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            d = line[6:]
            out.append(d if d == "[DONE]" else json.loads(d))
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "fake":
        _main_fake(sys.argv[2:])
    else:
        sys.exit("usage: serve_fixtures.py fake --port N [...]")
