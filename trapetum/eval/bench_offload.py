"""Models larger than the GPU (issue 18, item 4): decode tok/s of one random-weight model at a real shape
(eval/random_model.py), all on the GPU against the same model with tensors in host RAM, built in turn in one
process; the host side's read bandwidth, the GPU memory peaks, and per-layer times with an extrapolation.

    python -m trapetum.eval.bench_offload [--shape deepseek-v2-lite] [--format cb4] [--layers N] [--steps 32]
                                          [--threads T] [--gpu-mem GB] [--ctx N] [--per-layer] [--no-gpu]
                                          [--out DIR]

(the same as ``trapetum bench offload ...``). Rows, each engine built from the same checkpoint (generated on the
GPU tensor by tensor, seeded by name):

    gpu           everything on the GPU, steps replayed as CUDA graphs
    gpu-eager     the same engine's steps without graphs (MoE shapes): what eager launches cost, the most that
                  graph segments between host layers could give back
    host-experts  (MoE) every MoE layer's routed experts in host RAM (runtime/host_experts.py; eager steps)
    embed-host    (dense) the embedding table in host RAM, one row gathered and uploaded per token, steps still
                  graphs
The offload row is planned by ``--gpu-mem GB`` through the engine's planner (runtime/placement.py) when the plan
moves something; otherwise (no budget, or a budget everything fits) its placement is forced ("placed" says which).
With ``--gpu-mem`` the plan and the budget each placement needs are printed (weights + KV cache of ``--ctx``
positions + the planner's 1 GiB margin; GiB).

Measured: greedy decode from position 64 (after a 64-token prompt), ``--steps`` steps by the wall clock after 4
warm-up steps (tok/s); the host time per token (the experts' ``compute``: host GEMVs, activation, weighted sum;
the embedding's row gather) and the bytes read from host RAM per token (the chosen experts' codes and codebooks;
the rows): host GB/s = bytes / host time; rest = step - host (GPU work, launches, copies, syncs). GPU peak: torch's
peak allocated over the build and the decode (GiB; the CUDA context is outside it); build: wall seconds of the
engine's construction. "same tokens": how many of the row's greedy tokens match the gpu row's, from the first.

``--per-layer``: ``--steps`` more steps on each eager row (gpu-eager, host-experts) with a sync after the embedding
and after each layer (decoder_forward's ``on_layer``): ms of the embedding (with the row upload), each dense and
each MoE layer (its host ms beside), the head. When the slice has fewer layers than the shape, the whole model's
step is extrapolated from the slice, labelled so: embedding and head once, the mean layer of each kind times its
count in the full model; with the host bytes per token and the host RAM its routed experts would take.
Checked before building: the host RAM the offload row needs against the machine's available memory (refused in
one line); the gpu rows are skipped (with a note) when the whole slice does not fit the free GPU memory.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

from typing import TYPE_CHECKING

from ..errors import TrapetumError

if TYPE_CHECKING:  # torch, the runtime and the random models are imported where used: `bench offload --help`
    from ..models.config import ModelConfig  # imports no torch (tests/test_cli_startup.py)
    from ..runtime import placement as pl

PROMPT = 64
WARMUP = 4
GIB = 1 << 30  # = runtime.placement.GIB


class BenchError(TrapetumError):
    """A benchmark configuration this machine cannot run (one line)."""


class HostMeter:
    """Host seconds and bytes of an engine's host work: every HostExperts' ``compute`` (per layer) and the host
    embedding's row gather (``GpuEngine._gather_rows``)."""

    def __init__(self, eng):
        self.seconds, self.bytes, self.layers, self.embed_seconds = 0.0, 0, 0, 0.0
        self.by_layer: dict[int, float] = {}
        self.layer_bytes: dict[int, int] = {}
        for i, L in enumerate(eng.model.layers):
            for kind, w in L.blocks:
                if kind == "moe" and getattr(w.experts, "on_host", False):
                    self._wrap(i, w.experts)
                    self.layers += 1
        self.embed = bool(eng.host_embed)
        if self.embed:
            self._wrap_embed(eng)

    def _wrap(self, i: int, hx) -> None:
        import torch
        inner, per = hx.compute, hx.expert_bytes()

        def compute(x, weights, idx, out, threads=None):
            t = time.perf_counter()
            r = inner(x, weights, idx, out, threads)
            dt, n = time.perf_counter() - t, per * int(torch.unique(idx).numel())
            self.seconds += dt
            self.bytes += n
            self.by_layer[i] = self.by_layer.get(i, 0.0) + dt
            self.layer_bytes[i] = self.layer_bytes.get(i, 0) + n
            return r
        hx.compute = compute

    def _wrap_embed(self, eng) -> None:
        inner, row = eng._gather_rows, eng.cfg.hidden_size * eng.model.embed.element_size()

        def gather(ids):
            t = time.perf_counter()
            inner(ids)
            dt = time.perf_counter() - t
            self.seconds += dt
            self.embed_seconds += dt
            self.bytes += row * ids.numel()
        eng._gather_rows = gather

    @property
    def active(self) -> bool:
        return bool(self.layers or self.embed)

    def reset(self) -> None:
        self.seconds, self.bytes, self.embed_seconds = 0.0, 0, 0.0
        self.by_layer.clear()
        self.layer_bytes.clear()


def _sync(eng) -> None:
    import torch
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)


def layer_times(eng, steps: int, meter: HostMeter | None) -> dict:
    """Mean ms per step of the embedding, each layer and the head over ``steps`` eager steps, synced after the
    embedding and after each layer (module docstring); host ms per layer from ``meter``."""
    marks: list[float] = []

    def hook(i):
        _sync(eng)
        marks.append(time.perf_counter())
    n = len(eng.model.layers)
    embed = head = total = 0.0
    per = [0.0] * n
    if meter is not None:
        meter.reset()
    eng.layer_hook = hook
    try:
        for _ in range(steps):
            marks.clear()
            _sync(eng)
            t0 = time.perf_counter()
            eng.step(True)
            _sync(eng)
            t1 = time.perf_counter()
            embed += marks[0] - t0
            for i in range(n):
                per[i] += marks[i + 1] - marks[i]
            head += t1 - marks[-1]
            total += t1 - t0
    finally:
        eng.layer_hook = None
    ms = 1e3 / steps
    host = meter.by_layer if meter is not None else {}
    hbytes = meter.layer_bytes if meter is not None else {}
    kinds = [eng.cfg.block_kinds(i)[1] for i in range(n)]
    return {"embed_ms": embed * ms, "head_ms": head * ms, "step_ms": total * ms,
            "layers": [{"kind": "moe" if k == "moe" else "dense", "ms": per[i] * ms,
                        "host_ms": host.get(i, 0.0) * ms, "host_bytes": hbytes.get(i, 0) / steps}
                       for i, k in enumerate(kinds)]}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def by_kind(per: dict) -> dict:
    """{kind: (layers, mean ms, mean host ms, mean host bytes per token)} of a ``layer_times`` result."""
    out = {}
    for kind in ("dense", "moe"):
        ls = [x for x in per["layers"] if x["kind"] == kind]
        if ls:
            out[kind] = (len(ls), _mean([x["ms"] for x in ls]), _mean([x["host_ms"] for x in ls]),
                         _mean([x["host_bytes"] for x in ls]))
    return out


def extrapolate(per: dict, full: ModelConfig, full_sizes: dict[str, int]) -> dict | None:
    """The whole model's step from a slice's ``layer_times`` (module docstring); None when the slice lacks a layer
    kind the full model has."""
    from ..runtime import placement as pl
    kinds = by_kind(per)
    counts = {"dense": full.mlp_types.count("dense"), "moe": full.mlp_types.count("moe")}
    if any(c and k not in kinds for k, c in counts.items()):
        return None
    ms = per["embed_ms"] + per["head_ms"] + sum(c * kinds[k][1] for k, c in counts.items() if c)
    host_ms = sum(c * kinds[k][2] for k, c in counts.items() if c)
    host_bytes = sum(c * kinds[k][3] for k, c in counts.items() if c)
    experts = sum(n for name, n in full_sizes.items() if pl.is_routed_expert(name))
    return {"layers": full.num_layers, "dense": counts["dense"], "moe": counts["moe"], "step_ms": ms,
            "tok_s": 1e3 / ms, "host_ms": host_ms, "host_mb_per_token": host_bytes / 1e6,
            "expert_host_gb": experts / 1e9, "other_gpu_gb": (sum(full_sizes.values()) - experts) / 1e9}


def decode(eng, steps: int, meter: HostMeter | None, per_layer: bool = False) -> dict:
    import torch
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, eng.cfg.vocab_size, (PROMPT,), generator=g).tolist()
    logits = eng.prefill(prompt)
    eng.set_position(int(torch.argmax(logits)), PROMPT)
    for _ in range(WARMUP):
        eng.step(True)
    toks = torch.zeros(steps, dtype=torch.long, device=eng.device)
    _sync(eng)
    if meter is not None:
        meter.reset()
    t = time.perf_counter()
    for i in range(steps):
        eng.step(True)
        toks[i:i + 1].copy_(eng.token)  # a device copy, no sync
    _sync(eng)
    dt = (time.perf_counter() - t) / steps
    out = {"tok_s": 1.0 / dt, "step_ms": dt * 1e3, "gpu_weight_gb": eng.weight_bytes() / 1e9,
           "host_weight_gb": eng.host_weight_bytes() / 1e9, "tokens": toks.tolist()}
    if meter is not None and meter.active:
        host = meter.seconds / steps
        out.update(host_ms=host * 1e3, host_mb_per_token=meter.bytes / steps / 1e6,
                   host_gb_s=meter.bytes / meter.seconds / 1e9 if meter.seconds else 0.0,
                   rest_ms=(dt - host) * 1e3, host_layers=meter.layers)
    if per_layer:
        out["per_layer"] = layer_times(eng, steps, meter)
    return out


def _available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _build(ck, max_len: int, device, **kw) -> tuple:
    import torch
    from ..runtime.engine import GpuEngine
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    eng = GpuEngine(ck, max_len, device=device, **kw)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return eng, time.perf_counter() - t


def _memory(device) -> dict:
    import torch
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"gpu_peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "gpu_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB, "device_used_gib": (total - free) / GIB}


def _release(device) -> None:
    import torch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def needs(sizes: dict[str, int], cfg: ModelConfig, kv: int, tied: bool) -> dict[str, float]:
    """GiB of GPU memory each placement of the planner's order needs (weights + KV + margin)."""
    from ..runtime import placement as pl
    total = sum(sizes.values())
    embed = 0 if tied else sizes.get(pl.EMBED, 0)
    experts = sum(n for k, n in sizes.items() if pl.is_routed_expert(k)) if cfg.moe else 0
    out = {"everything on the GPU": total}
    if embed:
        out["embedding in host RAM"] = total - embed
    if experts:
        out[("embedding and " if embed else "") + "routed experts in host RAM"] = total - embed - experts
    return {k: (v + kv + pl.MARGIN) / GIB for k, v in out.items()}


def _offload_name(p: pl.Placement) -> str:
    return {(False, True): "host-experts", (True, False): "embed-host", (True, True): "embed+experts-host"}[
        (p.embed_host, p.experts_host)]


def run(shape: str, fmt: str = "cb4", layers: int | None = None, steps: int = 32, gpu_mem: float | None = None,
        ctx: int | None = None, per_layer: bool = False, gpu: bool = True, device="cuda",
        overrides: dict | None = None) -> dict:
    """The rows of the module docstring (``overrides``: ModelConfig fields, for tests at tiny sizes)."""
    import torch
    from ..runtime import placement as pl
    from .random_model import random_checkpoint, random_sizes, shape_config
    from ..settings import Options
    dev = torch.device(device)
    cfg = shape_config(shape, layers, overrides)
    full = shape_config(shape, None, overrides)
    sizes = random_sizes(shape, fmt, layers, overrides)
    max_len = max(PROMPT + WARMUP + steps * (2 if per_layer else 1) + 16, ctx or 0)
    kv = pl.kv_bytes(cfg, max_len)
    tied = bool(cfg.tie_word_embeddings) and "lm_head.weight" not in sizes
    r = {"shape": shape, "format": fmt, "layers": cfg.num_layers, "full_layers": full.num_layers, "steps": steps,
         "max_len": max_len, "threads": torch.get_num_threads(), "rows": {}, "notes": []}
    planned = None
    if gpu_mem is not None:
        planned = pl.plan(sizes, cfg, kv, int(gpu_mem * GIB), tied_dense_embed=tied, source=f"{shape} ({fmt})")
        r["plan"] = f"--gpu-mem {gpu_mem:g}: {planned.describe()}"
        r["needs_gib"] = needs(sizes, cfg, kv, tied)
    if planned is not None and planned.offloads:
        place, kw = planned, {"options": Options(gpu_mem_gb=gpu_mem)}
        r["placed"] = f"planned under --gpu-mem {gpu_mem:g}"
    else:
        place = pl.Placement(experts_host=True) if cfg.moe else pl.Placement(embed_host=True)
        kw = {"placement": place}
        r["placed"] = "forced" + (f"; the plan under --gpu-mem {gpu_mem:g} keeps everything on the GPU"
                                  if planned is not None else "")
    experts = sum(n for k, n in sizes.items() if pl.is_routed_expert(k)) if place.experts_host else 0
    host_need = experts + (sizes.get(pl.EMBED, 0) if place.embed_host else 0)
    avail = _available_host_bytes()
    if avail is not None and host_need > 0.9 * avail:
        raise BenchError(f"{shape} with {cfg.num_layers} layers puts {host_need / 1e9:.1f} GB in host RAM; this "
                         f"machine has {avail / 1e9:.1f} GB available: use fewer --layers")
    if gpu and dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0]
        need = sum(sizes.values()) + kv + pl.MARGIN
        if need > free:
            gpu = False
            r["notes"].append(f"gpu rows skipped: the slice needs {need / GIB:.1f} GiB, the GPU has {free / GIB:.1f} "
                              "GiB free")
    if gpu:
        eng, build_s = _build(random_checkpoint(shape, fmt, dev, layers, overrides), max_len, dev)
        r["rows"]["gpu"] = dict(decode(eng, steps, None), placed="-", build_s=build_s, **_memory(dev))
        if cfg.moe:
            eng.use_graph = False  # the same engine's steps eager (module docstring)
            r["rows"]["gpu-eager"] = dict(decode(eng, steps, None, per_layer), placed="-", build_s=build_s)
        del eng
        _release(dev)
    # a table kept in host RAM comes from the checkpoint on the CPU, as from a mmapped file (random_checkpoint)
    host_names = (pl.EMBED,) if place.embed_host else ()
    eng, build_s = _build(random_checkpoint(shape, fmt, dev, layers, overrides, host_names), max_len, dev, **kw)
    if (eng.placement.embed_host, eng.placement.experts_host) != (place.embed_host, place.experts_host):
        raise BenchError(f"the engine placed {eng.placement.describe()}, the benchmark planned {place.describe()}")
    name = _offload_name(eng.placement)
    r["placement"] = eng.placement.describe()
    row = decode(eng, steps, HostMeter(eng), per_layer and not eng.use_graph)
    r["rows"][name] = dict(row, placed=r["placed"], build_s=build_s, **_memory(dev))
    del eng
    _release(dev)
    ref = r["rows"].get("gpu", {}).get("tokens")
    for x in r["rows"].values():
        if ref is not None:
            same = next((i for i, (a, b) in enumerate(zip(x["tokens"], ref)) if a != b), len(ref))
            x["same_tokens"] = f"{same}/{len(ref)}"
    if per_layer and cfg.num_layers < full.num_layers:
        row = r["rows"][name]
        if "per_layer" in row:
            r["extrapolation"] = extrapolate(row["per_layer"], full, random_sizes(shape, fmt, None, overrides))
    return r


def _f(x: dict, key: str, fmt: str = "{:.2f}") -> str:
    return fmt.format(x[key]) if key in x else "-"


def markdown(r: dict) -> str:
    lines = [f"{r['shape']} ({r['layers']} of {r['full_layers']} layers), {r['format']}, {r['threads']} host threads, "
             f"greedy decode from position {PROMPT}, {r['steps']} steps, KV cache of {r['max_len']} positions; "
             f"offload row: {r['placement']} ({r['placed']})"]
    if "plan" in r:
        lines.append(f"plan: {r['plan']}; GPU budget needed: " +
                     ", ".join(f"{k} {v:.2f} GiB" for k, v in r["needs_gib"].items()))
    lines += [f"note: {n}" for n in r["notes"]]
    lines += ["", "| engine | tok/s | step ms | build s | GPU weights GB | host weights GB | GPU peak GiB | host ms/token | "
              "rest ms/token | host MB/token | host GB/s | same tokens |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, x in r["rows"].items():
        lines.append(f"| {name} | {x['tok_s']:.1f} | {x['step_ms']:.2f} | {x['build_s']:.1f} | "
                     f"{x['gpu_weight_gb']:.2f} | {x['host_weight_gb']:.2f} | {_f(x, 'gpu_peak_gib')} | "
                     f"{_f(x, 'host_ms')} | {_f(x, 'rest_ms')} | {_f(x, 'host_mb_per_token', '{:.3f}')} | "
                     f"{_f(x, 'host_gb_s')} | {x.get('same_tokens', '-')} |")
    per = {n: x["per_layer"] for n, x in r["rows"].items() if "per_layer" in x}
    if per:
        lines += ["", "per layer (ms per token, eager steps synced after each layer):", "",
                  "| engine | embedding | dense layer (n) | MoE layer (n) | MoE layer host | head | step (synced) |",
                  "|---|---|---|---|---|---|---|"]
        for n, p in per.items():
            k = by_kind(p)
            d = f"{k['dense'][1]:.3f} ({k['dense'][0]})" if "dense" in k else "-"
            m = f"{k['moe'][1]:.3f} ({k['moe'][0]})" if "moe" in k else "-"
            h = f"{k['moe'][2]:.3f}" if "moe" in k else "-"
            lines.append(f"| {n} | {p['embed_ms']:.3f} | {d} | {m} | {h} | {p['head_ms']:.3f} | {p['step_ms']:.2f} |")
    e = r.get("extrapolation")
    if e:
        lines += ["", f"EXTRAPOLATED, not measured: the whole model ({e['layers']} layers: {e['dense']} dense, "
                      f"{e['moe']} MoE) from the slice's per-layer means: {e['step_ms']:.1f} ms/token = "
                      f"{e['tok_s']:.2f} tok/s, of which host {e['host_ms']:.1f} ms ({e['host_mb_per_token']:.0f} MB "
                      f"read from host RAM per token); its routed experts take {e['expert_host_gb']:.1f} GB of host "
                      f"RAM, the rest {e['other_gpu_gb']:.1f} GB on the GPU"]
    elif r["layers"] < r["full_layers"]:
        lines += ["", "no extrapolation: run --per-layer with a slice that has each layer kind of the model"]
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The benchmark's options (also those of ``trapetum bench offload``)."""
    ap.add_argument("--shape", default="deepseek-v2-lite", help="a shape of eval/random_model.py SHAPES")
    ap.add_argument("--format", default="cb4", help="weights: a format of eval/random_model.py FORMATS "
                    "(cb4: 4-bit, 8-bit head; default)")
    ap.add_argument("--layers", type=int, default=None, help="the first N layers only (default all)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="host kernel threads (default torch's)")
    ap.add_argument("--gpu-mem", type=float, default=None,
                    help="plan the offload row with this budget, GiB (default: force the move)")
    ap.add_argument("--ctx", type=int, default=None, help="KV cache positions (default what the run needs)")
    ap.add_argument("--per-layer", action="store_true", help="per-layer times of the eager rows, the extrapolation")
    ap.add_argument("--no-gpu", action="store_true", help="leave out the all-on-GPU rows")
    ap.add_argument("--out", default=None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run_args(ap.parse_args(argv))


def run_args(a: argparse.Namespace) -> int:
    import torch
    from .random_model import FORMATS
    if a.format not in FORMATS:
        print(f"bench_offload: --format: one of {', '.join(FORMATS)}, got {a.format!r}", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("bench_offload: needs a CUDA GPU", file=sys.stderr)
        return 1
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        with torch.inference_mode():
            r = run(a.shape, a.format, a.layers, a.steps, a.gpu_mem, a.ctx, a.per_layer, not a.no_gpu)
    except (TrapetumError, ValueError) as e:
        print(f"bench_offload: {e}", file=sys.stderr)
        return 1
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "results.json").write_text(json.dumps(r, indent=1))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
