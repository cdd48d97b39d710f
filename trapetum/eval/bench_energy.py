"""GPU power and energy per token of decode, several model shapes and formats in one process (NVML).

    python -m trapetum.eval.bench_energy [--runs llama2-7b:fp16,llama2-7b:cb4,llama2-7b:aqlm-2x8,llama2-70b:aqlm-2x8]
                                         [--seconds 3] [--position 0]

(the same as ``trapetum bench energy ...``)

Each run builds the engine from a random checkpoint of the shape and format (eval/random_model.py), warms the
decode graph up, then times greedy CUDA-graph decode steps from ``--position`` (batches of 32 steps, repeated
for at least ``--seconds``) with NVML (eval/nvml.py: the energy counter, else power samples). Printed per run:
tok/s, mean W, J/token, tokens/J; and the idle power before the first run. Without NVML (no driver library, no
device): one line saying so, exit 1. Nothing is recorded by this module: figures go to BENCHMARKS.md with the
command.
"""
from __future__ import annotations

import argparse
import sys

from ..errors import TrapetumError
from .nvml import Nvml, NvmlError

DEFAULT_RUNS = "llama2-7b:fp16,llama2-7b:cb4,llama2-7b:aqlm-2x8,llama2-70b:aqlm-2x8"
BATCH = 32


def decode_energy(meter: Nvml, eng, seconds: float, position: int = 0, sync=None) -> dict:
    """{tok/s, W, J/token, tokens/J, steps, method} of greedy decode steps from ``position`` for >= ``seconds``."""
    kw = {} if sync is None else {"sync": sync}

    def batch():
        eng.set_position(1, position)
        for _ in range(BATCH):
            eng.step(True)
    batch()  # capture and warm up
    t, _, _ = meter.measure(batch, **kw)
    reps = max(1, int(seconds / max(t, 1e-9)) + 1)

    def window():
        for _ in range(reps):
            batch()
    t, joules, method = meter.measure(window, **kw)
    steps = reps * BATCH
    return {"tok_s": steps / t, "watts": joules / t, "j_per_token": joules / steps,
            "tokens_per_j": steps / joules if joules > 0 else float("inf"), "steps": steps, "method": method}


def parse_runs(text: str) -> list[tuple[str, str]]:
    from .random_model import FORMATS, SHAPES
    runs = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        shape, _, fmt = item.partition(":")
        if shape not in SHAPES or fmt not in FORMATS:
            raise TrapetumError(f"--runs: {item!r} must be SHAPE:FORMAT with SHAPE in {', '.join(SHAPES)} and FORMAT "
                                f"in {', '.join(FORMATS)}")
        runs.append((shape, fmt))
    if not runs:
        raise TrapetumError("--runs: no runs given")
    return runs


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (also those of ``trapetum bench energy``)."""
    p.add_argument("--runs", default=DEFAULT_RUNS, help="SHAPE:FORMAT,... (default %(default)s)")
    p.add_argument("--seconds", type=float, default=3.0, help="decode window per run, seconds (default 3)")
    p.add_argument("--position", type=int, default=0, help="first decode position (default 0)")


def main(argv=None, open_meter=Nvml.open) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_args(p.parse_args(argv), open_meter)


def run_args(a: argparse.Namespace, open_meter=Nvml.open) -> int:
    try:
        runs = parse_runs(a.runs)
        meter = open_meter()
    except (NvmlError, TrapetumError) as e:
        print(f"bench_energy: {e}", file=sys.stderr)
        return 1
    import torch
    if not torch.cuda.is_available():
        print("bench_energy: needs a CUDA GPU", file=sys.stderr)
        return 1
    import time
    from ..runtime.engine import GpuEngine
    from .random_model import random_checkpoint
    t, joules, method = meter.measure(lambda: time.sleep(1.0))
    idle_w = joules / t
    print(f"GPU {torch.cuda.get_device_name()}: idle {idle_w:.1f} W ({method}); decode from position {a.position}, "
          f">= {a.seconds} s per run, random weights")
    print("| model | format | tok/s | mean W | J/token | tokens/J | steps | method |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for shape, fmt in runs:
        eng = GpuEngine(random_checkpoint(shape, fmt), a.position + 64, device="cuda")
        r = decode_energy(meter, eng, a.seconds, a.position)
        print(f"| {shape} | {fmt} | {r['tok_s']:.1f} | {r['watts']:.1f} | {r['j_per_token']:.4f} | "
              f"{r['tokens_per_j']:.2f} | {r['steps']} | {r['method']} |", flush=True)
        del eng
        torch.cuda.empty_cache()
    meter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
