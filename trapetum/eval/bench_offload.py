"""Routed experts in host RAM against all on the GPU (issue 18, item 4): decode tok/s of one random-weight model at a
real shape (eval/random_model.py), built twice in one process, and the host side's read bandwidth.

    python -m trapetum.eval.bench_offload [--shape deepseek-v2-lite] [--layers N] [--steps 64] [--threads T]
                                          [--gpu-mem GB] [--out DIR]

(the same as ``trapetum bench offload ...``)

Both engines are built from the same 4-bit checkpoint (``cb4``: 4-bit codebook projections, 8-bit head, generated
on the GPU, seeded by name): "gpu" all on the device (CUDA graphs), "host-experts" with every MoE layer's routed
experts in host RAM (runtime/host_experts.py; eager steps), placed by ``--gpu-mem GB`` through the planner
(runtime/placement.py) when given, else forced (experts on the host, the embedding on the GPU). Measured: greedy
decode from position 64 (after a 64-token prompt), ``--steps`` steps timed by the wall clock after 4 warm-up steps
(tok/s); on the host-experts engine also the host time (the experts' ``compute``: the host GEMVs, the activation,
the weighted sum) and the bytes of the chosen experts' codes and codebooks it read, per token: host GB/s = bytes /
host time; the rest of the step (GPU work, launches, the per-layer copies and syncs) is step time - host time.
The row "gpu-eager" is the all-on-GPU engine's steps without CUDA graphs: its gap to "gpu" is what eager launches
cost, the most that graph segments between the host layers could give back to "host-experts".
``--threads``: the host kernels' threads (default torch's). Prints a markdown table; ``--out DIR``: results.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PROMPT = 64


class HostMeter:
    """Wraps every HostExperts of an engine: host seconds and bytes read by ``compute``."""

    def __init__(self, eng):
        self.seconds, self.bytes, self.layers = 0.0, 0, 0
        for L in eng.model.layers:
            for kind, w in L.blocks:
                if kind == "moe" and getattr(w.experts, "on_host", False):
                    self._wrap(w.experts)
                    self.layers += 1

    def _wrap(self, hx):
        import torch  # here and below, not at the top: `trapetum bench offload --help` imports no torch

        inner, per = hx.compute, hx.expert_bytes()

        def compute(x, weights, idx, out, threads=None):
            t = time.perf_counter()
            r = inner(x, weights, idx, out, threads)
            self.seconds += time.perf_counter() - t
            self.bytes += per * int(torch.unique(idx).numel())
            return r
        hx.compute = compute

    def reset(self):
        self.seconds, self.bytes = 0.0, 0


def _sync(eng) -> None:
    import torch

    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)


def decode(eng, steps: int, meter: HostMeter | None) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, eng.cfg.vocab_size, (PROMPT,), generator=g).tolist()
    logits = eng.prefill(prompt)
    eng.set_position(int(torch.argmax(logits)), PROMPT)
    for _ in range(4):
        eng.step(True)
    _sync(eng)
    if meter is not None:
        meter.reset()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step(True)
    _sync(eng)
    dt = (time.perf_counter() - t) / steps
    out = {"tok_s": 1.0 / dt, "step_ms": dt * 1e3, "gpu_weight_gb": eng.weight_bytes() / 1e9,
           "host_weight_gb": eng.host_weight_bytes() / 1e9}
    if meter is not None and meter.layers:
        host = meter.seconds / steps
        out.update(host_ms=host * 1e3, host_mb_per_token=meter.bytes / steps / 1e6,
                   host_gb_s=meter.bytes / meter.seconds / 1e9 if meter.seconds else 0.0,
                   rest_ms=(dt - host) * 1e3, host_layers=meter.layers)
    return out


def run(shape: str, layers: int | None, steps: int, gpu_mem: float | None) -> dict:
    import torch

    from ..runtime.engine import GpuEngine
    from ..runtime.placement import Placement
    from ..settings import Options
    from .random_model import random_checkpoint
    max_len = PROMPT + steps + 16
    results = {"shape": shape, "layers": layers, "steps": steps, "threads": torch.get_num_threads(), "rows": {}}
    eng = GpuEngine(random_checkpoint(shape, "cb4", layers=layers), max_len, device="cuda")
    results["rows"]["gpu"] = decode(eng, steps, None)
    eng.use_graph = False  # the same engine's steps eager: what the launches cost (graph segments would save it)
    results["rows"]["gpu-eager"] = decode(eng, steps, None)
    del eng
    torch.cuda.empty_cache()
    ck = random_checkpoint(shape, "cb4", layers=layers)
    if gpu_mem is not None:
        eng = GpuEngine(ck, max_len, device="cuda", options=Options(gpu_mem_gb=gpu_mem))
    else:
        eng = GpuEngine(ck, max_len, device="cuda", placement=Placement(experts_host=True))
    results["placement"] = eng.placement.describe()
    results["rows"]["host-experts"] = decode(eng, steps, HostMeter(eng))
    return results


def markdown(r: dict) -> str:
    lines = [f"{r['shape']} ({r['layers'] or 'all'} layers), 4-bit, {r['threads']} host threads, greedy decode "
             f"from position {PROMPT}, {r['steps']} steps; host-experts: {r['placement']}", "",
             "| engine | tok/s | step ms | GPU weights GB | host weights GB | host ms/token | rest ms/token | "
             "host MB/token | host GB/s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, x in r["rows"].items():
        h = [f"{x['host_ms']:.2f}", f"{x['rest_ms']:.2f}", f"{x['host_mb_per_token']:.1f}",
             f"{x['host_gb_s']:.1f}"] if "host_ms" in x else ["-"] * 4
        lines.append(f"| {name} | {x['tok_s']:.1f} | {x['step_ms']:.2f} | {x['gpu_weight_gb']:.2f} | "
                     f"{x['host_weight_gb']:.2f} | " + " | ".join(h) + " |")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The benchmark's options (also those of ``trapetum bench offload``)."""
    ap.add_argument("--shape", default="deepseek-v2-lite")
    ap.add_argument("--layers", type=int, default=None, help="the first N layers only (default all)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="host kernel threads (default torch's)")
    ap.add_argument("--gpu-mem", type=float, default=None, help="plan with this budget (default: force the experts)")
    ap.add_argument("--out", default=None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run_args(ap.parse_args(argv))


def run_args(a: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench_offload: needs a CUDA GPU", file=sys.stderr)
        return 1
    if a.threads:
        torch.set_num_threads(a.threads)
    with torch.inference_mode():
        r = run(a.shape, a.layers, a.steps, a.gpu_mem)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "results.json").write_text(json.dumps(r, indent=1))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
