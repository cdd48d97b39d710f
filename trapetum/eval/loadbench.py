"""Load benchmark for ``trapetum serve``: N concurrent streaming clients against the OpenAI API.

    trapetum bench load --clients 1,4,16 --requests 32 --max-tokens 64
    trapetum bench load --url http://127.0.0.1:8000 --api-key KEY --clients 8
    trapetum bench load --clients 1,4,16,64 --max-tokens 128 --max-batch 64   # batched serving (scheduler)

Without ``--url`` it starts ``trapetum serve MODEL`` on a free loopback port (the embedded
default model unless ``--model`` is given) and stops it afterwards. Each client sends streamed
chat completions back to back until the run has sent ``--requests`` requests (default ``--per-client`` K per
client, at least 8). Before each level a warm-up round (one 8-token request per client, not counted) lets the
server compile and capture what that many concurrent requests need (e.g. the GPU batch's CUDA graph buckets)
outside the timed run. Every request
generates exactly ``--max-tokens`` tokens (``ignore_eos``), so runs compare. Measured on the
client side, per request:

- TTFT: request sent -> first content token (includes queueing behind other clients),
- inter-token latency (ITL): the gaps between successive content tokens,
- end-to-end latency; and for the run: output tokens / wall time (total throughput),
  requests / s, errors; the throughput and the p50 ITL relative to the 1-client level (when the run has one);
  the most requests the server reported running at once (``/health`` polled during the level: whether the
  requests were decoded together).
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List some good habits for learning a language.",
    "What makes bread rise?",
    "Describe the water cycle to a child.",
    "Give me ideas for a rainy weekend.",
    "Why is the sky blue?",
    "Summarize the rules of chess in a few sentences.",
]


@dataclass
class Result:
    ok: bool
    status: int = 0
    error: str = ""
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    tokens: int = 0
    queue_s: float | None = None


def pct(xs: list[float], p: float) -> float | None:
    """Percentile by linear interpolation (p in 0..100); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def one_request(client, url: str, headers: dict, model: str | None, prompt: str, max_tokens: int,
                      temperature: float) -> Result:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": temperature, "ignore_eos": True}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    last = None
    r = Result(ok=False)
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                r.error = (await resp.aread()).decode(errors="replace")[:200]
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    r.ok = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    r.error = ev["error"].get("message", "error")
                    break
                if ev.get("usage"):
                    r.tokens = ev["usage"]["completion_tokens"]
                    r.queue_s = (ev.get("timings") or {}).get("queue_s")
                for ch in ev.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if last is None:
                            r.ttft = now - t0
                        else:
                            r.itl.append(now - last)
                        last = now
    except Exception as e:  # noqa: BLE001 -- a failed request is a data point, not a crash
        r.error = f"{type(e).__name__}: {e}"
    r.e2e = time.perf_counter() - t0
    return r


async def _peak_running(client, url: str, stop: asyncio.Event) -> int:
    """The most jobs /health reports running on one engine, polled every 0.1 s until ``stop``."""
    peak = 0
    while not stop.is_set():
        try:
            r = await client.get(url + "/health", timeout=5)
            peak = max([peak] + [int(e.get("running", 0)) for e in r.json().get("engines", [])])
        except Exception:  # noqa: BLE001 -- a missed poll is no data point
            pass
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except asyncio.TimeoutError:
            pass
    return peak


async def run_level(url: str, clients: int, requests: int, *, max_tokens: int, api_key: str | None,
                    model: str | None, temperature: float, timeout: float) -> dict:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[Result] = []
    counter = iter(range(requests))
    stop = asyncio.Event()

    async def client_loop(c):
        for i in counter:
            results.append(await one_request(c, url, headers, model, PROMPTS[i % len(PROMPTS)], max_tokens,
                                              temperature))

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as c, httpx.AsyncClient() as poll:
        watcher = asyncio.ensure_future(_peak_running(poll, url, stop))
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(c) for _ in range(clients)))
        wall = time.perf_counter() - t0
        stop.set()
        peak = await watcher
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok]
    toks = sum(r.tokens for r in ok)
    return {
        "clients": clients, "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "error_samples": sorted({f"{r.status} {r.error}" for r in results if not r.ok})[:3],
        "wall_s": wall, "output_tokens": toks, "throughput_tok_s": toks / wall if wall > 0 else 0.0,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_s": {f"p{p}": pct(ttft, p) for p in (50, 90, 99)},
        "itl_ms": {f"p{p}": (v * 1000 if (v := pct(itl, p)) is not None else None) for p in (50, 90, 99)},
        "e2e_s": {f"p{p}": pct(e2e, p) for p in (50, 90, 99)},
        "per_stream_tok_s_mean": statistics.mean([(r.tokens - 1) / sum(r.itl) for r in ok
                                                  if r.itl and sum(r.itl) > 0]) if ok else None,
        "peak_running": peak,
    }


def add_ratios(rows: list[dict]) -> None:
    """Each level's throughput and p50 ITL relative to the 1-client level's (None without one)."""
    base = next((r for r in rows if r["clients"] == 1), None)
    for r in rows:
        tput = base and base["throughput_tok_s"]
        itl = base and base["itl_ms"]["p50"]
        r["throughput_vs_1"] = r["throughput_tok_s"] / tput if tput else None
        r["itl_p50_vs_1"] = r["itl_ms"]["p50"] / itl if itl and r["itl_ms"]["p50"] is not None else None


def _f(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(rows: list[dict], meta: dict) -> str:
    out = [f"Load benchmark: {meta['model']} at {meta['url']}, streamed chat completions, "
           f"{meta['max_tokens']} output tokens each (ignore_eos), temperature {meta['temperature']}.",
           f"Command: `{meta['command']}`", "",
           "| clients | requests (errors) | throughput tok/s (x 1 client) | req/s | TTFT p50 / p90 / p99 s "
           "| ITL p50 / p90 / p99 ms (p50 x 1 client) | e2e p50 / p99 s | per-stream tok/s | peak running |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, i, e = r["ttft_s"], r["itl_ms"], r["e2e_s"]
        out.append(f"| {r['clients']} | {r['requests']} ({r['errors']}) | {_f(r['throughput_tok_s'], 1)} "
                   f"({_f(r.get('throughput_vs_1'))}) | "
                   f"{_f(r['requests_per_s'])} | {_f(t['p50'])} / {_f(t['p90'])} / {_f(t['p99'])} | "
                   f"{_f(i['p50'], 1)} / {_f(i['p90'], 1)} / {_f(i['p99'], 1)} ({_f(r.get('itl_p50_vs_1'))}) | "
                   f"{_f(e['p50'])} / {_f(e['p99'])} | {_f(r['per_stream_tok_s_mean'], 1)} | "
                   f"{r.get('peak_running', '-')} |")
    return "\n".join(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """``trapetum serve`` in a subprocess for the duration of the benchmark."""

    def __init__(self, models: list[str], extra: list[str], queue: int):
        import tempfile
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="trapetum-loadbench-", suffix=".log", delete=False)
        argv = [sys.executable, "-m", "trapetum.cli", "serve", *models, "--port", str(self.port),
                "--queue", str(queue), "--no-access-log", *extra]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 600) -> None:
        import httpx
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {open(self.log.name, errors='replace').read()[-2000:]}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    return
                if r.json().get("status") == "error":
                    raise RuntimeError(f"server failed to load: {r.json().get('error')}")
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError("server not ready")

    def stop(self) -> None:
        import signal
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)


def add_arguments(p) -> None:
    p.add_argument("--url", default=None, help="a running server (default: start `trapetum serve` for the run)")
    p.add_argument("--model", action="append", default=None, metavar="MODEL",
                   help="model to serve when starting a server (default: the embedded model); with --url, "
                        "the model id to request")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", default="1,4,16", help="concurrency levels, comma-separated (default 1,4,16)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level, at least one per client (default: --per-client per client, at least 8)")
    p.add_argument("--per-client", type=int, default=4, metavar="K",
                   help="without --requests: K requests per client at each level (default 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=None, help="--threads for the started server")
    p.add_argument("--device", default=None, help="--device for the started server")
    p.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="--max-batch for the started server (requests decoded together)")
    p.add_argument("--kv-blocks", type=int, default=None, metavar="N", help="--kv-blocks for the started server")
    p.add_argument("--kv-mem", type=float, default=None, metavar="GB", help="--kv-mem for the started server")
    p.add_argument("--gpu-batch", action="store_true", help="--gpu-batch for the started server")
    p.add_argument("--timeout", type=float, default=600, help="per-request timeout in seconds")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")


def run(args) -> int:
    from ..errors import TrapetumError
    try:
        levels = [int(x) for x in str(args.clients).split(",") if x.strip()]
    except ValueError:
        raise TrapetumError(f"--clients: expected integers like 1,4,16, got {args.clients!r}") from None
    if not levels or min(levels) < 1 or args.max_tokens < 1 or args.per_client < 1:
        raise TrapetumError("--clients, --max-tokens and --per-client must be at least 1")
    server = None
    url = args.url
    model_id = args.model[0] if (args.url and args.model) else None
    if url is None:
        extra = []
        if args.api_key:
            extra += ["--api-key", args.api_key]
        if args.threads:
            extra += ["--threads", str(args.threads)]
        if args.device:
            extra += ["--device", args.device]
        for flag, v in (("--max-batch", args.max_batch), ("--kv-blocks", args.kv_blocks), ("--kv-mem", args.kv_mem)):
            if v is not None:
                extra += [flag, str(v)]
        if args.gpu_batch:
            extra.append("--gpu-batch")
        server = _Server(args.model or [], extra, queue=max(levels) * 2 + 8)
        print(f"starting trapetum serve on {server.url} ...", file=sys.stderr, flush=True)
        server.wait()
        url = server.url
    try:
        import httpx
        h = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        served = [m["id"] for m in httpx.get(url.rstrip("/") + "/v1/models", headers=h, timeout=30).json()["data"]]
        model_id = model_id or served[0]
        # Warm-up: one short request (first-call allocations, caches).
        asyncio.run(run_level(url, 1, 1, max_tokens=4, api_key=args.api_key, model=model_id,
                              temperature=args.temperature, timeout=args.timeout))
        rows = []
        for n in levels:
            reqs = max(args.requests or max(8, args.per_client * n), n)     # every client sends at least one
            asyncio.run(run_level(url.rstrip("/"), n, n, max_tokens=min(8, args.max_tokens), api_key=args.api_key,
                                  model=model_id, temperature=args.temperature, timeout=args.timeout))  # warm-up
            print(f"{n} clients, {reqs} requests ...", file=sys.stderr, flush=True)
            rows.append(asyncio.run(run_level(url.rstrip("/"), n, reqs, max_tokens=args.max_tokens,
                                              api_key=args.api_key, model=model_id,
                                              temperature=args.temperature, timeout=args.timeout)))
    finally:
        if server is not None:
            server.stop()
    add_ratios(rows)
    argv = sys.argv[1:]
    for word in ("load", "loadbench"):
        if word in argv:
            argv = argv[argv.index(word) + 1:]
            break
    cmd = " ".join(["trapetum bench load", *argv]).strip()
    meta = {"url": args.url or "(started for the run)", "model": model_id, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "command": cmd, "cpu_count": os.cpu_count()}
    print(markdown(rows, meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "levels": rows}, f, indent=2)
    return 0 if all(r["errors"] == 0 for r in rows) else 1
