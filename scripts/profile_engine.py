"""Where the time of a decode step and of a VERIFY pass goes, per kernel, on the GPU (random weights, real shapes).

    python scripts/profile_engine.py --shape llama2-7b --format cb4 --rows 8,16 --base 64 [--out DIR]
        [--off KERNEL_OPTION]   (also the graph walls with that boolean KernelOptions field off, same process)

Runs eager (graphs off) under torch.profiler and sums the GPU time of each kernel name over `--reps` passes; also
times the graph-replayed step and passes (the production figures) so the per-kernel sums can be set against them.
Prints one table per pass kind (top kernels, their share) and writes profile.json under DIR.
An experiment tool, not a benchmark of record: BENCHMARKS.md figures come from trapetum.eval.bench_e2e.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from trapetum.eval.bench_e2e import _cuda_time
from trapetum.eval.random_model import random_checkpoint
from trapetum.runtime.engine import GpuEngine
from trapetum.settings import KernelOptions, Options


def kernel_times(fn, reps: int) -> dict[str, tuple[float, int]]:
    """{kernel name: (GPU seconds per pass, launches per pass)} over `reps` calls of fn."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = acc[e.name[:90]]
            a[0] += e.time_range.elapsed_us() / 1e6 / reps
            a[1] += 1
    return {k: (v[0], v[1] // reps) for k, v in acc.items()}


def table(title: str, times: dict[str, tuple[float, int]], wall: float, top: int = 14) -> str:
    total = sum(t for t, _ in times.values())
    lines = [f"-- {title}: graph wall {wall * 1e6:.0f} us, eager kernel sum {total * 1e6:.0f} us, "
             f"{sum(n for _, n in times.values())} launches",
             f"{'us':>8} {'share':>6} {'n':>5}  kernel"]
    for name, (t, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{t * 1e6:8.1f} {t / total:6.1%} {n:5d}  {name}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--format", default="cb4")
    p.add_argument("--rows", default="8,16")
    p.add_argument("--base", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="")
    p.add_argument("--off", default="", help="a boolean KernelOptions field: graph walls with it off too")
    a = p.parse_args(argv)
    rows = [int(r) for r in a.rows.split(",") if r]
    ckpt = random_checkpoint(a.shape, a.format)
    out = {}
    runs = [(True, Options()), (False, Options(graph=False))]
    if a.off:
        runs.insert(1, ("off", Options(kernels=KernelOptions(**{a.off: False}))))
    for graph, opts in runs:
        eng = GpuEngine(ckpt, 2048, device="cuda", options=opts)
        g = torch.Generator(device="cuda").manual_seed(0)
        passes = {"decode": (1, None)}
        passes.update({f"verify M={m}": (m, torch.randint(3, eng.cfg.vocab_size, (m,), device="cuda", generator=g))
                       for m in rows})
        for name, (m, toks) in passes.items():
            def fn(toks=toks, eng=eng):
                if toks is None:
                    eng.set_position(1, a.base)
                    eng.step(True)
                else:
                    eng.verify(toks, a.base)
            fn()
            if graph == "off":
                out[name]["wall_off"] = sorted(_cuda_time(fn, 20) for _ in range(5))[2]
            elif graph:
                out.setdefault(name, {})["wall"] = sorted(_cuda_time(fn, 20) for _ in range(5))[2]
            else:
                out[name]["kernels"] = kernel_times(fn, a.reps)
        del eng
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "profile.json").write_text(json.dumps(out, indent=1))
    for name, r in out.items():
        print(table(f"{a.shape} {a.format} {name} at {a.base}", r["kernels"], r["wall"]))
    if a.off:
        print(f"-- graph walls (us), {a.off} on / off:")
        for name, r in out.items():
            print(f"{name:>14} {r['wall'] * 1e6:9.1f} {r['wall_off'] * 1e6:9.1f}  ({r['wall'] / r['wall_off']:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
