"""Where the time of a speculative round goes on the GPU (random weights at real shapes, modeled acceptance).

    python scripts/profile_spec.py [--target llama3-8b:cb4] [--draft llama3.2-1b:cb4] [--k 7] [--alpha 0.8]
        [--prompt-len 128] [--new-tokens 256] [--out DIR] [--loops pipelined,sync]

Three views of the same PARD arm as ``trapetum.eval.bench_spec``'s modeled part, for each loop of ``--loops``
("pipelined": runtime/speculative/pipeline.py, round r + 1 queued before round r's verdict is read back; "sync":
one read-back per round before the next round is launched):
  1. device time of each forward a round runs, alone (CUDA events over graph replays): the target's verify pass
     of k + 1 rows, the drafter's PARD pass of k rows (the synchronous loop's average is about n + k rows) and of
     2k rows (the pipelined loop's fixed k_prev + k rows), a decode step for scale;
  2. the round's wall time (a timed generation) with host timers around the loop's parts: sync: the drafter's
     ``propose``, the target's ``rows``, ``judge`` (the round's read-back: it waits for the device) and the rest;
     pipelined: ``propose_at``, ``rows_at``, ``device_verdict`` (launches only) and ``Reader.recv`` (the wait for
     the round before: the device runs the next round meanwhile);
  3. a torch.profiler trace of one generation: GPU busy time (union of kernel intervals) against the wall, and
     the host's top operators by self time. The trace goes to DIR/trace-LOOP.json.
An experiment tool, not a benchmark of record (BENCHMARKS.md figures come from trapetum.eval.bench_spec).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import trapetum.runtime.speculative.loop as loop
import trapetum.runtime.speculative.pipeline as pipeline
from trapetum.eval.bench_spec import _spec, timed_tokens, warm
from trapetum.eval.random_model import random_checkpoint
from trapetum.runtime.engine import GpuEngine
from trapetum.runtime.sampling import GenerationSettings
from trapetum.runtime.speculative import EngineRows, PardDrafter, ScriptedDrafter, SpeculativeRunner
from trapetum.settings import Options


def event_time(fn, reps: int = 50) -> float:
    """Seconds per call of fn on the device (CUDA events around reps calls, after two warm calls)."""
    fn()
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


class Timers:
    """Host seconds spent inside wrapped callables, by label (no synchronization added)."""

    def __init__(self):
        self.sec: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, label, fn):
        def inner(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.sec[label] += time.perf_counter() - t0
                self.calls[label] += 1
        return inner


def busy_union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="llama3-8b:cb4")
    p.add_argument("--draft", default="llama3.2-1b:cb4")
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--alpha", type=float, default=0.8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--out", default="")
    p.add_argument("--loops", default="pipelined,sync")
    a = p.parse_args(argv)
    dev = "cuda"
    opts = Options()
    max_len = a.prompt_len + a.new_tokens + 32
    te = GpuEngine(random_checkpoint(*_spec(a.target), device=dev), max_len, device=dev, options=opts)
    de = GpuEngine(random_checkpoint(*_spec(a.draft), device=dev), max_len, device=dev, options=opts)
    warm(te)
    warm(de)
    V = te.cfg.vocab_size
    prompt = torch.randint(3, V, (a.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    truth, t_plain = timed_tokens(te, prompt, a.new_tokens, dev)
    _, t_plain = timed_tokens(te, prompt, a.new_tokens, dev)
    target = EngineRows(te)

    def runner(pipelined: bool):
        inner = PardDrafter(EngineRows(de), mask_token=V - 1)
        return SpeculativeRunner(target, ScriptedDrafter.modeled(prompt + truth, a.alpha, V, seed=1, device=dev,
                                                                 inner=inner), a.k, pipelined=pipelined)

    # 1. device time of each forward, alone
    base = a.prompt_len + 64
    rows_t = torch.zeros(16, dtype=torch.long, device=dev)
    m2 = min(2 * a.k, 16)
    dev_t = {"target verify k+1 rows": event_time(lambda: te.verify(rows_t[:a.k + 1], base)),
             "drafter PARD pass k rows": event_time(lambda: de.verify(rows_t[:a.k], base)),
             f"drafter PARD pass {m2} rows (pipelined: k_prev + k)": event_time(lambda: de.verify(rows_t[:m2], base)),
             "target decode step": event_time(lambda: (te.set_position(0, base), te.step(True))),
             "target prefill of the prompt": event_time(lambda: te.prefill(prompt), reps=5),
             "drafter prefill of the prompt": event_time(lambda: de.prefill(prompt), reps=5)}
    prefills = dev_t["target prefill of the prompt"] + dev_t["drafter prefill of the prompt"]
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    lines = ["-- device time alone (ms)"]
    lines += [f"{v * 1e3:8.3f}  {k}" for k, v in dev_t.items()]
    lines.append(f"{(dev_t['target verify k+1 rows'] + dev_t['drafter PARD pass k rows']) * 1e3:8.3f}  "
                 "sum of a sync round's two forwards (k-row PARD pass)")
    lines.append(f"{(dev_t['target verify k+1 rows'] + dev_t[f'drafter PARD pass {m2} rows (pipelined: k_prev + k)']) * 1e3:8.3f}  "
                 f"sum of a pipelined round's two forwards ({m2}-row PARD pass)")
    record = {"device": dev_t, "t_plain": t_plain, "loops": {}}
    for loop_name in a.loops.split(","):
        pipe = loop_name == "pipelined"
        # 2. wall per round, host timers around the loop's parts
        list(runner(pipe).tokens(prompt, GenerationSettings(max_new_tokens=32), max_len))  # warm the arm
        _, t_spec = timed_tokens(runner(pipe), prompt, a.new_tokens, dev)
        tm = Timers()
        r = runner(pipe)
        saved = []

        def patch(obj, name, label):
            saved.append((obj, name, obj.__dict__.get(name)))
            setattr(obj, name, tm.wrap(label, getattr(obj, name)))

        if pipe:
            patch(pipeline, "device_verdict", "device_verdict (launches)")
            patch(target, "rows_at", "target.rows_at (verify launch)")
            patch(r.drafter, "propose_at", "drafter.propose_at (PARD launch)")
            recv = pipeline.Reader.recv
            pipeline.Reader.recv = staticmethod(tm.wrap("Reader.recv (wait for the round before)", recv))
        else:
            patch(loop, "judge", "judge (read-back wait + host)")
            patch(target, "rows", "target.rows (verify launch)")
            patch(r.drafter, "propose", "drafter.propose (PARD launch)")
        try:
            _, t_timed = timed_tokens(r, prompt, a.new_tokens, dev)
        finally:
            for obj, name, old in reversed(saved):
                if old is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, old)
            if pipe:
                pipeline.Reader.recv = staticmethod(recv)
        rounds = r.stats.rounds

        # 3. profiler trace of one generation
        r3 = runner(pipe)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            list(r3.tokens(prompt, GenerationSettings(max_new_tokens=a.new_tokens), max_len))
            torch.cuda.synchronize()
            t_prof = time.perf_counter() - t0
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = busy_union([(e.time_range.start, e.time_range.end) for e in ev]) / 1e6
        host = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()),
                      key=lambda x: -x[1])[:20]
        if out:
            prof.export_chrome_trace(str(out / f"trace-{loop_name}.json"))

        per = 1e3 / rounds
        lines += [f"== {loop_name} loop: plain {a.new_tokens / t_plain:.1f} tok/s; PARD k={a.k} alpha={a.alpha}: "
                  f"{a.new_tokens / t_spec:.1f} tok/s ({t_plain / t_spec:.2f}x), {rounds} rounds, "
                  f"{r.stats.tokens_per_round:.2f} tokens/round, {t_spec * 1e3 / rounds:.3f} ms/round untimed, "
                  f"{t_timed * per:.3f} ms/round with host timers; untimed less both prefills: "
                  f"{(t_spec - prefills) * 1e3 / rounds:.3f} ms/round"]
        lines.append("-- host time per round (ms), timers without synchronization")
        lines += [f"{v * per:8.3f}  {k} ({tm.calls[k] / rounds:.1f} calls/round)" for k, v in tm.sec.items()]
        lines.append(f"{(t_timed - sum(tm.sec.values())) * per:8.3f}  everything else (sampler, lists, yields)")
        lines.append(f"-- profiler: wall {t_prof * 1e3:.1f} ms, GPU busy {busy * 1e3:.1f} ms ({busy / t_prof:.0%}), "
                     f"{len(ev)} GPU events; host top operators by self time (ms total, calls):")
        lines += [f"{s / 1e3:8.2f} {c:6d}  {k[:80]}" for k, s, c in host]
        record["loops"][loop_name] = {"host": dict(tm.sec), "rounds": rounds, "t_spec": t_spec, "t_timed": t_timed,
                                      "busy": busy, "t_prof": t_prof}
    text = "\n".join(lines)
    if out:
        (out / "profile_spec.txt").write_text(text + "\n")
        (out / "profile_spec.json").write_text(json.dumps(record, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
