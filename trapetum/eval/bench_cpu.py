"""CPU decode benchmark of a .cbk model (or a GGUF, whose Q4_0 / Q4_1 / Q5_0 / Q8_0 projections the host GEMV reads
in place: schemes/ggml.py): the host GEMV path against dequantize-and-multiply, in one process.

    python -m trapetum.eval.bench_cpu MODEL.cbk|MODEL.gguf [--threads 1,2] [--tokens 64] [--rounds 3] [--out DIR]
                                      [--paths torch,host,step] [--llama-bench PATH --gguf FILE]
                                      [--host-path avx2]

Measured, each round alternating every (threads, path) so that a busy machine slows all of them alike:
  * decode tok/s, greedy, ``--tokens`` new tokens after a short prompt (``Completion.tokens_per_s``: the first
    token excluded), for each of ``--paths``: torch (``Options(host_kernels=False)``: dense copies of the
    codebook weights, fp32 matmul), host (``Options(cpu_step=False)``: the reference decoder's ops with
    kernels/host_gemv.py on the stored codes), step (the default: the CPU executor, models/cpu_ops.py) and
    step-int8 (the step with ``Options(host_numerics="int8")``: the int8 dot of the 4-bit projections and the 8-bit head, other numbers;
    ``--paths step,step-int8`` compares the two modes in one run, with "step-int8 GEMV GB/s" its step GEMV pass);
  * host GEMV GB/s: every 4/8-bit projection of the model once, M = 1, in model order (run back to back by one C
    call, ``host_ops.GemvPass``; before session 16 each from Python), over the bytes a decode
    step's GEMVs actually read (``HostGemv.nbytes``: the codes and the tables as the GEMV reads them: per-row
    fp16 tables, or for the shared storage the groups' tables and the fp16 row scales, each row's table formed
    in registers), against the memory read bandwidth measured the same way: a numpy sum over a ``--bw-mb``
    float32 array split over the same number of threads (best of 5 each);
  * step GEMV GB/s (with the step path): the GEMVs the CPU executor runs in a decode step, as it calls them
    (the ``FusedGemv`` calls ``tp_dense_layer`` makes from C: per layer the fused q/k/v, o, the fused gate/up
    with its activation, down; then the head), M = 1, in model order, over the same bytes (the parts'
    ``HostGemv.nbytes``; best of 5). Fewer, larger calls than the per-projection pass above, run back to back
    by one C call (``host_ops.GemvPass``: no Python between them, as in the step): the time the step's GEMV
    pass takes (its norms and residual adds excluded, its activation included). Before session 16 the pass
    called each GEMV from Python (~5 us a call on the development VM: 6-12% of SmolLM2's pass);
  * with ``--llama-bench`` and ``--gguf``: llama.cpp's ``llama-bench -p 0 -n TOKENS -t T`` in the same rounds.
Torch's thread count is set to T for every path (the host kernels follow ``torch.get_num_threads()``).
``--host-path P`` caps the host kernels' code path for the whole run (``host_gemv.limit_path``): a lower path's
speed on this CPU, e.g. the AVX2 path on an AVX-512 machine (against a llama.cpp built for AVX2 alone). Prints a
markdown table (medians over the rounds, with the range; "step / llama.cpp" is the ratio of the medians);
``--out``: results.json there.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import TrapetumError

PROMPT = "The history of the printing press begins"
PATH_OPTIONS = {"torch": {"host_kernels": False}, "host": {"cpu_step": False}, "step": {},
                "step-int8": {"host_numerics": "int8"}}


def read_bandwidth(threads: int, mb: int = 512, reps: int = 5) -> float:
    """GB/s of a numpy float32 sum over ``mb`` MB, split over ``threads`` threads (best of ``reps``)."""
    import numpy as np  # here and below, not at the top: `trapetum bench cpu --help` imports neither

    a = np.ones(mb * (1 << 20) // 4, dtype=np.float32)
    parts = np.array_split(a, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(ex.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def host_gemvs(decoder) -> list:
    return [m.host for m in decoder.modules() if getattr(m, "host", None) is not None]


def gemv_bandwidth(gemvs: list, threads: int, reps: int = 5) -> tuple[float, float]:
    """(GB/s, ms) of one pass over ``gemvs`` with M = 1 (best of ``reps``)."""
    import torch

    from ..kernels.host_ops import FusedGemv, GemvPass

    from ..kernels import ggml_host as gh

    # each projection as a one-part fused GEMV (the same kernel and bits), all run by one C call (a GGUF's block
    # weights, kernels/ggml_host.HostGgml, as segments of bits gh.BITS)
    one = [FusedGemv([(g.weight.blocks, g.weight, None)], gh.BITS, g.in_features) if isinstance(g, gh.HostGgml)
           else FusedGemv([(g.codes, g.tables, None)], g.bits, g.in_features) for g in gemvs]
    run = GemvPass([(f, torch.randn(1, f.in_features), torch.empty(1, f.out_features)) for f in one], threads).run
    nbytes = sum(g.nbytes for g in gemvs)
    run()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9, best * 1e3


def step_gemvs(decoder) -> list:
    """(FusedGemv, bytes read) of the GEMVs the CPU step executor runs a decode step, in order (its plan built by a
    pass first); [] where the executor does not run every projection on the host GEMV."""
    step = decoder.cpu_step
    if step is None or step._plan is None:
        return []
    act = decoder.config.hidden_act
    out = []
    for layer in step._plan.layers:
        for kind, p in layer.blocks:
            if kind not in ("attention", "mlp"):
                return []
            for w, a in ((p.qkv, None), (p.o, None)) if kind == "attention" else ((p.gate_up, act), (p.down, None)):
                f = step.fused(w, a)
                if not f:
                    return []
                mods = w[:2] if a else w if isinstance(w, tuple) else (w,)
                out.append((f, sum(m.host.nbytes for m in mods)))
    f = step.fused(step._plan.head)
    return out + [(f, step._plan.head.host.nbytes)] if f else []


def step_gemv_bandwidth(calls: list, threads: int, reps: int = 5) -> float:
    """GB/s of one pass over ``calls`` (step_gemvs) with M = 1 (best of ``reps``)."""
    import torch

    from ..kernels.host_ops import GemvPass

    run = GemvPass([(f, torch.randn(1, f.in_features), torch.empty(1, f.out_features)) for f, _ in calls],
                   threads).run
    run()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return sum(b for _, b in calls) / best / 1e9


def decode_rate(model, ids: list[int], tokens: int) -> float:
    return model.generate(ids, max_new_tokens=tokens, ignore_eos=True).tokens_per_s


def llama_bench(exe: str, gguf: str, threads: int, tokens: int) -> float:
    r = subprocess.run([exe, "-m", gguf, "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "1", "-o", "json"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {r.stderr.strip()[-300:]}")
    return float(json.loads(r.stdout)[0]["avg_ts"])


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The benchmark's options (also those of ``trapetum bench cpu``)."""
    ap.add_argument("model", help=".cbk file (4/8-bit codebook projections)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bw-mb", type=int, default=512)
    ap.add_argument("--llama-bench", default=None, metavar="PATH", help="llama.cpp's llama-bench binary")
    ap.add_argument("--gguf", default=None, help="the GGUF that llama-bench decodes")
    ap.add_argument("--paths", default="torch,host,step", help="comma-separated: torch, host, step, step-int8")
    ap.add_argument("--out", default=None, metavar="DIR")
    ap.add_argument("--host-path", default=None, metavar="PATH",
                    help="cap the host kernels' code path (c, avx2, avx512, avx512vbmi, avx512fp16; default: the "
                         "best this CPU runs), e.g. avx2: what an AVX2-only machine runs, on this one")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    try:
        return run_args(ap.parse_args(argv))
    except TrapetumError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run_args(a: argparse.Namespace) -> int:
    import torch

    import trapetum
    from ..kernels import host_gemv as hg
    from ..settings import Options

    threads = [int(t) for t in a.threads.split(",")]
    paths = [p for p in a.paths.split(",") if p]
    if not paths or any(p not in PATH_OPTIONS for p in paths):
        raise TrapetumError(f"bench cpu: --paths takes {', '.join(PATH_OPTIONS)}, got {a.paths!r}")
    if not hg.available():
        raise TrapetumError(f"bench cpu: host kernels unavailable: {hg.error()}")
    if a.host_path is not None:
        if a.host_path not in hg.PATHS:
            raise TrapetumError(f"bench cpu: --host-path takes {', '.join(hg.PATHS)}, got {a.host_path!r}")
        hg.limit_path(a.host_path)
    models = {p: trapetum.load(a.model, options=Options(**PATH_OPTIONS[p])) for p in paths}
    probe = models.get("step") or models.get("host") or trapetum.load(a.model)
    ids = probe.encode(PROMPT)
    gemvs = host_gemvs(probe.decoder)
    if not gemvs:
        raise TrapetumError(f"bench cpu: {a.model} has no projection on the host GEMV (4/8-bit codebooks, a GGUF's "
                            "Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K blocks)")
    for m in models.values():  # warm up: dense copies, the kernels' first build, the thread pool
        decode_rate(m, ids, 4)
    steps = step_gemvs(models["step"].decoder) if "step" in models else []
    steps8 = step_gemvs(models["step-int8"].decoder) if "step-int8" in models else []
    runs: dict[str, list[float]] = {}
    for r in range(a.rounds):
        for t in threads:
            torch.set_num_threads(t)
            for name, m in models.items():
                runs.setdefault(f"{name} t={t}", []).append(decode_rate(m, ids, a.tokens))
            if a.llama_bench and a.gguf:
                runs.setdefault(f"llama.cpp t={t}", []).append(llama_bench(a.llama_bench, a.gguf, t, a.tokens))
            gbs, ms = gemv_bandwidth(gemvs, t)
            runs.setdefault(f"gemv GB/s t={t}", []).append(gbs)
            runs.setdefault(f"gemv ms t={t}", []).append(ms)
            if steps:
                runs.setdefault(f"step gemv GB/s t={t}", []).append(step_gemv_bandwidth(steps, t))
            if steps8:  # over the bytes the int8 pass reads (4-bit: the codes and 20 bytes a row; the 8-bit head:
                # its int8 weights, K rounded up to 128, and 4 bytes a row; HostGemv.nbytes)
                runs.setdefault(f"step-int8 gemv GB/s t={t}", []).append(step_gemv_bandwidth(steps8, t))
            runs.setdefault(f"read GB/s t={t}", []).append(read_bandwidth(t, a.bw_mb))
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()), flush=True)
    nbytes = sum(g.nbytes for g in gemvs)
    res = {"model": a.model, "cpu": _cpu_name(), "host_path": hg.best_path(), "tokens": a.tokens,
           "rounds": a.rounds, "gemv_weight_bytes": nbytes,
           "step_gemv_bytes": sum(b for _, b in steps), "step_int8_gemv_bytes": sum(b for _, b in steps8), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "runs": runs}
    lines = [f"{a.model}: {_cpu_name()}, host path {hg.best_path()}, {len(gemvs)} host GEMVs "
             f"({nbytes / 1e6:.1f} MB per step), {a.tokens} new tokens, {a.rounds} rounds alternated",
             "", "| threads | " + " | ".join(f"{p} tok/s" for p in paths) + " | llama.cpp tok/s | step / llama.cpp "
             "| host GEMV GB/s | read GB/s | GEMV / read | step GEMV GB/s | step GEMV / read |",
             "|---|" + "---|" * (len(paths) + 7)]

    if steps8:
        lines[2] = lines[2].rstrip() + " step-int8 / llama.cpp | step-int8 GEMV GB/s |"
        lines[3] += "---|---|"

    def cell(k):
        v = runs.get(k)
        return "-" if not v else f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"

    for t in threads:
        med = {k: statistics.median(v) for k, v in runs.items() if k.endswith(f"t={t}")}
        ratio = (f"{med[f'step t={t}'] / med[f'llama.cpp t={t}']:.2f}x"
                 if f"step t={t}" in med and f"llama.cpp t={t}" in med else "-")
        lines.append(f"| {t} | " + " | ".join(cell(f"{p} t={t}") for p in paths) + f" | {cell(f'llama.cpp t={t}')} | "
                     f"{ratio} | {cell(f'gemv GB/s t={t}')} | {cell(f'read GB/s t={t}')} | "
                     f"{med[f'gemv GB/s t={t}'] / med[f'read GB/s t={t}']:.0%} | {cell(f'step gemv GB/s t={t}')} | "
                     + (f"{med[f'step gemv GB/s t={t}'] / med[f'read GB/s t={t}']:.0%} |" if steps else "- |"))
        if steps8:
            r8 = (f"{med[f'step-int8 t={t}'] / med[f'llama.cpp t={t}']:.2f}x" if f"llama.cpp t={t}" in med else "-")
            lines[-1] += f" {r8} | {cell(f'step-int8 gemv GB/s t={t}')} |"
    print("\n".join(lines))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(res, indent=1))
        (out / "results.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
