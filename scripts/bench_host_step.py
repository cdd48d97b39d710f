"""Host cost of one batched decode step, without the model: the scheduler (runtime/scheduler.py) over a runner
whose forwards return at once with precomputed logits, and the server's per-token streaming work.

    PYTHONPATH=$PWD python3 scripts/bench_host_step.py --tokenizer xfer/smollm2-tokenizer/tokenizer.json --sizes 1,4,16,64

Per batch size S: S greedy requests (``ignore_eos``, 128 new tokens, prompts of ~30 tokens) are admitted and
prefilled, then ``--steps`` decode steps are timed (perf_counter, best of ``--repeat`` runs): ms per step, and
the least-squares line ms = a + b x S over the sizes. The fake runner's decode returns a slice of a random fp32
logits table [S, V] (V the tokenizer's vocab): the step's time is the scheduler's own (admission checks, block
growth, sampling on the logits' device, the one host read, TokenStream.push: EOS, stop scan, detokenization).
``--vocab N``: logits of N tokens instead (the sampling ops' fixed cost without the CPU's scan of a full vocab:
on the GPU that scan is device time). ``--sample``: seeded sampling (temperature 0.8, top-p 0.95) instead of greedy. ``--profile S``: a cProfile of the
timed steps at that size (top 15 by cumulative time).

``--worker``: also serve/worker.py's engine thread over the same fake model (``worker_ms``). ``--cbk F.cbk``: also
the paged GPU runner on a real model, without the scheduler (``runner_ms``: decode wall and device ms per S, and
one prompt's prefill; ``prefill_parts``: that prefill's engine pass and write-back apart, and the step of the same
prompt folded into a decode forward beside S decode rows; ``overlapped_ms``: wall ms per decode step of the
scheduler's sequential and overlapped orders with a host busy-wait of ``--host-ms`` ms a step in place of the
host's per-token work).

``--sse``: also the per-token work of the server's streaming path for one event (protocol.chat_chunk + sse, as
serve/server.py's ``_stream`` formats it, and one ``call_soon_threadsafe`` hop onto a running event loop, as
``_Channel.sink``), microseconds per token.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import threading
import time
from types import SimpleNamespace

import torch

from trapetum.runtime.paged_kv import PagedKV
from trapetum.runtime.sampling import GenerationSettings
from trapetum.runtime.scheduler import Scheduler


class InstantRunner:
    """The scheduler's runner interface (runtime/paged_ops.py) with no model: logits from a fixed random table."""

    def __init__(self, vocab: int, num_blocks: int, rows: int = 64, block_size: int = 16, seed: int = 0):
        cfg = SimpleNamespace(mla=False, num_layers=1, num_kv_heads=1, head_dim=1)
        self.kv = PagedKV(cfg, num_blocks, block_size)
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(4, rows, vocab, generator=g) * 4  # 4 steps' worth, cycled
        self.calls = 0

    def prefill(self, table, tokens, start):
        return self.table[0, 0]

    def decode(self, tables, tokens, positions, prev=None, src=None):
        self.calls += 1
        return self.table[self.calls % 4, :len(tokens)]

    def replay(self, table, tokens, start):
        pass


def time_steps(tok, S: int, steps: int, sample: bool, vocab: int = 0, profile: bool = False) -> float:
    """ms per decode step of S running requests (after their prefills)."""
    vocab = vocab or (tok.tk.get_vocab_size() if tok is not None else 49152)
    runner = InstantRunner(vocab, num_blocks=S * 12 + 8, rows=max(S, 1))
    sch = Scheduler(runner, tok, vocab, 4096, max_batch=S, chunk=128, prefill_budget=1 << 20)
    prompt = tok.encode("Write a short story about a lighthouse keeper, please, in a few lines.") if tok else \
        list(range(1, 31))
    for i in range(S):
        s = GenerationSettings(max_new_tokens=steps + 8, ignore_eos=True, temperature=0.8 if sample else 0.0,
                               top_p=0.95 if sample else 1.0, seed=i if sample else None)
        sch.submit(prompt, s)
    sch.step()  # admission and every prefill (one step: the budget is unbounded here)
    assert all(r.state == "decode" for r in sch.active), "prefills not done in one step"
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        sch.step()
    dt = time.perf_counter() - t0
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(15)
    assert sch.peak_batch == S
    return dt / steps * 1e3


def fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares a, b of y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def sse_us(n: int = 5000) -> tuple[float, float]:
    """(format us, hop us) per token: protocol.chat_chunk + sse of a short piece, and call_soon_threadsafe onto a
    loop running in another thread (the sender's cost)."""
    from trapetum.serve import protocol as P
    t0 = time.perf_counter()
    for i in range(n):
        P.sse(P.chat_chunk("chatcmpl-0123456789", "model", 1700000000, {"content": " word"}, None,
                           with_usage_field=True))
    fmt = (time.perf_counter() - t0) / n * 1e6
    loop = asyncio.new_event_loop()
    q: asyncio.Queue = asyncio.Queue()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    t0 = time.perf_counter()
    for i in range(n):
        loop.call_soon_threadsafe(q.put_nowait, ("token", i))
    hop = (time.perf_counter() - t0) / n * 1e6
    loop.call_soon_threadsafe(loop.stop)
    th.join(5)
    return fmt, hop


class _FakeModel:
    """What serve/worker.py needs of a Model to batch it, over an InstantRunner."""

    def __init__(self, tok, vocab: int):
        self.tok, self.vocab = tok, vocab

    def batch_scheduler(self, max_batch: int):
        runner = InstantRunner(self.vocab, num_blocks=max_batch * 12 + 8, rows=max_batch)
        return Scheduler(runner, self.tok, self.vocab, 4096, max_batch=max_batch, chunk=128)

    def encode(self, text):
        return self.tok.encode(text) if self.tok is not None else list(range(1, 31))

    @staticmethod
    def _settings(settings, overrides):
        return GenerationSettings(**overrides).validate()


def worker_ms(tok, S: int, tokens: int, vocab: int, stream: bool) -> tuple[float, int]:
    """(ms per step, steps) of serve/worker.py's engine thread decoding S jobs of ``tokens`` tokens on the fake
    model: from the first job's start to the last job's end over the scheduler's steps. ``stream``: each job's
    events hop onto an event loop in another thread (``call_soon_threadsafe``, as the server's _Channel) where a
    consumer formats each token's SSE chunk (protocol.chat_chunk + sse, as _stream; no socket write), so that
    thread competes for the GIL as the server's does; else the sink drops the events on the engine thread."""
    from trapetum.serve import protocol as P
    from trapetum.serve.worker import Job, Worker
    vocab = vocab or (tok.tk.get_vocab_size() if tok is not None else 49152)
    model = _FakeModel(tok, vocab)
    w = Worker([lambda: ("fake", model)], batch={"max_batch": S}, max_waiting=S + 1)
    w.start()
    while w.state == "loading":
        time.sleep(0.01)
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    done = threading.Semaphore(0)
    out: list[bytes] = []

    async def consume(q):
        while True:
            getter = asyncio.ensure_future(q.get())
            await asyncio.wait({getter}, timeout=15.0)
            kind, payload = getter.result()
            if kind == "token" and payload.text:
                out.append(P.sse(P.chat_chunk("chatcmpl-0123456789", "fake", 1700000000,
                                              {"content": payload.text}, None, with_usage_field=True)))
            if kind in ("done", "error"):
                done.release()
                return

    def sink_for():
        if not stream:
            return lambda kind, payload: done.release() if kind in ("done", "error") else None
        q = asyncio.run_coroutine_threadsafe(_make_queue(), loop).result()
        asyncio.run_coroutine_threadsafe(consume(q), loop)
        return lambda kind, payload: loop.call_soon_threadsafe(q.put_nowait, (kind, payload))

    jobs = [Job("fake", "text", "Write a short story about a lighthouse keeper.",
                {"max_new_tokens": tokens, "ignore_eos": True}, sink_for())
            for _ in range(S)]
    sched = None
    t0 = time.perf_counter()
    for j in jobs:
        w.submit(j)
    for _ in jobs:
        done.acquire()
    dt = time.perf_counter() - t0
    sched = w.schedulers["fake"]
    steps = sched.steps
    w.stop()
    loop.call_soon_threadsafe(loop.stop)
    th.join(5)
    return dt / steps * 1e3, steps


def runner_ms(path: str, device: str, sizes: list[int], steps: int, prompt_len: int = 38,
              host_ms: tuple = ()) -> None:
    """The paged GPU runner alone (runtime/paged_engine.py) on ``path``: per S, the wall ms of one decode step
    (inputs staged, graph replayed, the logits' argmax read back: what the scheduler waits for) and its device ms
    (CUDA events around the replay), and the wall ms of one prefill forward of ``prompt_len`` tokens (a chat
    prompt of the load bench is 35-42 tokens). Printed one line per S."""
    from trapetum.formats.detect import load_checkpoint
    from trapetum.runtime.engine import GpuEngine
    from trapetum.runtime.paged_engine import GpuBatchRunner
    from trapetum.settings import Options
    cuda = device.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()
    eng = GpuEngine(load_checkpoint(path), 1024, device=device, options=Options())
    S_max = max(sizes)
    per = (prompt_len + steps + 2 + 15) // 16 + 1
    runner = GpuBatchRunner(eng, (S_max + 1) * per, 16)
    tables = [torch.arange(i * per, (i + 1) * per) for i in range(S_max + 1)]  # one more: prefill_parts' prompt
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, eng.cfg.vocab_size, (prompt_len,), generator=g).tolist()
    walls = []
    for i, t in enumerate(tables):
        sync()
        t0 = time.perf_counter()
        runner.prefill(t, prompt, 0)
        sync()
        walls.append(time.perf_counter() - t0)
    pf = sorted(walls[1:] or walls)[len(walls[1:] or walls) // 2] * 1e3
    for S in sizes:
        for k in range(2):  # the first: the bucket's capture
            toks, pos = [prompt[-1]] * S, [prompt_len + k] * S
            torch.argmax(runner.decode(tables[:S], toks, pos), -1).tolist()
        wall, dev = [], []
        for k in range(steps):
            toks, pos = [prompt[(k + 7) % prompt_len]] * S, [prompt_len + 2 + k] * S
            t0 = time.perf_counter()
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            logits = runner.decode(tables[:S], toks, pos)
            if cuda:
                e1.record()
            torch.argmax(logits, -1).tolist()
            wall.append(time.perf_counter() - t0)
            if cuda:
                e1.synchronize()
                dev.append(e0.elapsed_time(e1) / 1e3)
        med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3 if xs else float("nan")  # noqa: E731
        print(f"runner S={S:3d}  decode wall {med(wall):7.3f} ms  device {med(dev):7.3f} ms   "
              f"(prefill of {prompt_len} tokens: {pf:.2f} ms)")
        for h in host_ms:
            seq, ovl = (overlapped_ms(runner, tables[:S], prompt, prompt_len + 2, steps, h, o) for o in (False, True))
            print(f"runner S={S:3d}  host {h:4.1f} ms a step: sequential {seq:7.3f} ms/step, overlapped {ovl:7.3f} "
                  f"ms/step")
    prefill_parts(runner, eng, tables, prompt, sizes, sync)


def overlapped_ms(runner, tables, prompt, base: int, steps: int, host_ms: float, overlap: bool) -> float:
    """Wall ms per decode step of len(tables) rows at positions base .. base + steps - 1 (greedy, the argmax read
    back through runtime/scheduler._Read, then a busy wait of ``host_ms`` in place of the host's work on the
    tokens): sequential (enqueue step N, read it, host work), or overlapped (enqueue step N + 1 with step N's
    tokens taken on the device, then read step N, host work), as runtime/scheduler.py orders them."""
    from trapetum.runtime.scheduler import _Read
    S = len(tables)

    def busy():
        t = time.perf_counter()
        while time.perf_counter() - t < host_ms / 1e3:
            pass
    toks, pending = [prompt[-1]] * S, None
    if torch.device(runner.eng.device).type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k in range(steps):
        pos = [base + k] * S
        if pending is not None:
            logits = runner.decode(tables, [0] * S, pos, pending.toks, list(range(S)))
        else:
            logits = runner.decode(tables, toks, pos)
        read = _Read(torch.argmax(logits, -1), [])
        if overlap:
            if pending is not None:
                pending.tokens()
                busy()
            pending = read
        else:
            toks = read.tokens()
            busy()
    if pending is not None:  # the last step's tokens and host work (the same count of both as sequential)
        pending.tokens()
        busy()
    return (time.perf_counter() - t0) / steps * 1e3


def prefill_parts(runner, eng, tables, prompt, sizes, sync, reps: int = 9) -> None:
    """Where a prompt's prefill goes (median wall ms of ``reps``, after a warm-up that captures the graphs):
    the engine's padded pass alone, the all-layer write-back alone, and the prompt folded into a decode forward
    (its n rows of one sequence; beside S decode rows of other sequences: the step's extra cost)."""
    n, t = len(prompt), tables[0]
    ids = torch.tensor(prompt, dtype=torch.long, device=eng.device)
    tab = t.to(eng.device)

    def ms(fn):
        walls = []
        for _ in range(reps + 2):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            walls.append(time.perf_counter() - t0)
        return sorted(walls[2:])[reps // 2] * 1e3
    engine = ms(lambda: eng.prefill(ids))
    write = ms(lambda: runner.kv.write_all(tab, 0, eng.kv.k[:, :, :n], eng.kv.v[:, :, :n]))
    print(f"prefill parts: engine pass {engine:.2f} ms, all-layer write-back {write:.3f} ms")
    for S in [0] + sizes:
        rows = [tables[i + 1] for i in range(S)]
        toks, pos = [prompt[-1]] * S + prompt, [n] * S + list(range(n))  # the decode rows: their next position

        def step():
            torch.argmax(runner.decode(rows + [t] * n, toks, pos), -1).tolist()
        f = ms(step)
        print(f"folded prompt of {n} rows beside {S:3d} decode rows: step {f:.3f} ms")


async def _make_queue():
    return asyncio.Queue()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="scripts/bench_host_step.py", description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", help="tokenizer.json (or a model file) whose detokenization is timed")
    ap.add_argument("--sizes", default="1,4,16,64")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sample", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="S")
    ap.add_argument("--vocab", type=int, default=0, help="logits width (default: the tokenizer's vocab)")
    ap.add_argument("--sse", action="store_true")
    ap.add_argument("--worker", action="store_true", help="also the worker's steps, without and with streaming")
    ap.add_argument("--cbk", help="also the paged GPU runner's decode step and prefill on this model (runner_ms)")
    ap.add_argument("--device", default="cuda", help="the runner's device (cpu: under TRITON_INTERPRET=1)")
    ap.add_argument("--host-ms", default="", help="with --cbk: comma list of host ms a step for overlapped_ms")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = None
    if a.tokenizer:
        from trapetum.eval.random_cbk import read_tokenizer_source
        tok = read_tokenizer_source(a.tokenizer)
    sizes = [int(x) for x in a.sizes.split(",")]
    ms = []
    for S in sizes:
        best = min(time_steps(tok, S, a.steps, a.sample, a.vocab) for _ in range(a.repeat))
        ms.append(best)
        print(f"S={S:3d}  {best:7.3f} ms/step  {best / S * 1e3:7.1f} us/row")
    if len(sizes) > 1:
        ca, cb = fit(sizes, ms)
        print(f"fit: ms/step = {ca:.3f} + {cb:.4f} x S")
    if a.profile:
        time_steps(tok, a.profile, a.steps, a.sample, a.vocab, profile=True)
    if a.worker:
        for S in sizes:
            for stream in (False, True):
                best = min(worker_ms(tok, S, a.steps, a.vocab, stream)[0] for _ in range(a.repeat))
                print(f"worker S={S:3d} {'streamed' if stream else 'dropped '}  {best:7.3f} ms/step")
    if a.cbk:
        runner_ms(a.cbk, a.device, sizes, a.steps,
                  host_ms=tuple(float(x) for x in a.host_ms.split(",") if x))
    if a.sse:
        fmt, hop = sse_us()
        print(f"server per token: SSE chunk format {fmt:.1f} us, call_soon_threadsafe hop {hop:.1f} us")


if __name__ == "__main__":
    main()
