"""End-to-end decode, verify and prefill benchmark on one GPU, random weights at real model shapes.

    python -m trapetum.eval.bench_e2e --out DIR [--models llama2-7b,llama3-8b] [--formats fp16,cb4] [--switches]
                                      [--verify 1,2,4,8,16] [--verify-bases 64,1088] [--attn-configs NAME,...]
    python -m trapetum.eval.bench_e2e --out DIR --models llama2-70b --bins 0 --verify 8   (2-bit AQLM formats)
    python -m trapetum.eval.bench_e2e --out DIR --models llama2-70b --formats aqlm-2x8 --aqlm-kernels table,mma
                                      --bins 0 --verify 1,8 --verify-bases 64   (the 2x8 kernel options side by side)
    python -m trapetum.eval.bench_e2e --out DIR --models deepseek-v2-lite,mixtral-8x7b --formats cb4,aqlm-2x8 --bins 0
                                      [--mla latent]   (mixture of experts; floors: python -m trapetum.eval.moe_floor)

For each model shape and format (eval/random_model.py: fp16; cb4 = 4-bit codebook projections + 8-bit head;
llama2-70b: aqlm-2x8 and aqlm-1x16), the engine is built from a random checkpoint generated on the GPU, and one
process measures:
  * load: peak GPU memory while building, against the engine's weight bytes plus its KV cache;
  * decode tok/s, greedy, CUDA graph: mean over 128 consecutive steps from positions 0, 1024 and 3968 (the bins
    first 128, 1,024-1,152, 3,968-4,096);
  * verify (``--verify M,...``): one VERIFY pass of M rows at each base of ``--verify-bases``, graph-replayed,
    against one decode step from the same base (the mean of 32 consecutive steps), both timed in the same run: the
    ratio is what speculative decoding pays per verify round;
  * prefill tok/s at 512 and 2,048 tokens (median of 7; not for the AQLM formats, which dequantize per call);
  * short prompts (``--short-prompts 16,32,...``): ms of the dequantizing prompt pass against the exact prefill
    (16-row verify passes) at each length, and which one the default prefill takes (GpuEngine.short_exact);
  * with --switches the decode bins again with each option off (graph, fuse, CUDA kernels, fused attention, PDL);
    with --attn-configs the bins with each named attention config;
  * ``--aqlm-kernels table,mma``: the aqlm-2x8 rows once per 2x8 kernel option (KernelOptions.aqlm_kernel; the
    "mma" rows are labelled aqlm-2x8+mma), each engine's verify against its own decode steps.
Writes results.json and results.md under DIR; prints the table last.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..settings import AQLM_KERNELS, Options
from .random_model import FORMATS, random_checkpoint

DEFAULT_FORMATS = ("fp16", "cb4")
SHAPE_FORMATS = {"llama2-70b": ("aqlm-2x8", "aqlm-1x16")}
BINS = (0, 1024, 3968)
STEPS = 128
MAX_LEN = 4096 + 128
DECODE_REF_STEPS = 32  # decode steps from a verify base that give the step time it is compared with
SWITCHES = {"graph=off": dict(graph=False), "fuse=off": dict(fuse=False), "cuda-kernels=off": dict(kernels={"cuda": False}),
            "attention=unfused": dict(attention="unfused"), "pdl=off": dict(kernels={"pdl": "off"})}


def _cuda_time(fn, reps: int = 1) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / reps


def decode_bins(eng, bins=BINS, steps=STEPS) -> dict[int, float]:
    """tok/s over `steps` consecutive greedy steps starting at each position in `bins`."""
    out = {}
    for p0 in bins:
        if p0 + steps > eng.max_len:
            continue
        eng.set_position(1, p0)
        eng.step(True)  # capture (first call) and warm up
        eng.set_position(1, p0)
        out[p0] = 1.0 / _cuda_time(lambda: eng.step(True), steps)
    return out


def verify_cost(eng, rows: list[int], bases: list[int], reps: int = 20) -> dict:
    """{base: {M: (verify seconds, decode-step seconds, ratio)}}: medians of 5 groups of `reps` verify replays, and
    of 5 runs of DECODE_REF_STEPS consecutive decode steps from the same base."""
    out = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for base in bases:
        res = out[base] = {}
        for m in rows:
            if base + m + 1 > eng.max_len:
                continue
            toks = torch.randint(3, eng.cfg.vocab_size, (m,), device="cuda", generator=g)
            eng.verify(toks, base)  # capture
            ver = sorted(_cuda_time(lambda: eng.verify(toks, base), reps) for _ in range(5))[2]
            dec = []
            for _ in range(5):
                eng.set_position(1, base)
                dec.append(_cuda_time(lambda: eng.step(True), DECODE_REF_STEPS))
            dec = sorted(dec)[2]
            res[m] = (ver, dec, ver / dec)
    return out


def prefill_rate(eng, n: int, vocab: int) -> float:
    ids = torch.randint(0, vocab, (n,), device="cuda")
    eng.prefill(ids)
    times = sorted(_cuda_time(lambda: eng.prefill(ids)) for _ in range(7))  # 512 tokens is host-bound: noisy
    return n / times[3]


def short_prompts(eng, lengths, vocab: int) -> dict[int, dict]:
    """Per prompt length T: ms of the dequantizing prompt pass (``prefill_pass``) and of the exact prefill
    (``prefill_exact``: 16-row verify passes), each captured first and then the median of 7 timed calls, and the
    path the default prefill takes (``short_exact``)."""
    out = {}
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), device="cuda")
        row = {"default_path": "exact" if eng.short_exact(n) else "pass"}
        for name, fn in (("pass_ms", eng.prefill_pass), ("exact_ms", eng.prefill_exact)):
            fn(ids)
            fn(ids)  # the padded pass: eager at first use, captured at the second
            row[name] = sorted(_cuda_time(lambda: fn(ids)) for _ in range(7))[3] * 1e3
        out[n] = row
    return out


def build(shape: str, fmt: str, options: Options):
    from ..runtime.engine import GpuEngine
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    eng = GpuEngine(random_checkpoint(shape, fmt), MAX_LEN, device="cuda", options=options)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return eng, {"weight_bytes": eng.weight_bytes(), "kv_bytes": eng.kv.nbytes(), "load_peak_bytes": peak,
                 "load_peak_over_weights_kv": peak / (eng.weight_bytes() + eng.kv.nbytes())}


def run(models: list[str], switches: bool, out_dir: Path, formats: list[str] | None = None,
        bins: tuple[int, ...] = BINS, attn_configs: tuple[str, ...] = (), verify_rows: tuple[int, ...] = (),
        verify_bases: tuple[int, ...] = (64, 1088), options: Options | None = None,
        aqlm_kernels: tuple[str, ...] = ("table",), short: tuple[int, ...] = ()) -> dict:
    opts0 = options or Options()
    results = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
               "models": {}}
    for shape in models:
        res = results["models"][shape] = {}
        runs = [(f, k) for f in formats or SHAPE_FORMATS.get(shape, DEFAULT_FORMATS)
                for k in (aqlm_kernels if f == "aqlm-2x8" else ("table",))]
        for fmt, kernel in runs:
            base_opts = opts0.replace(kernels={"aqlm_kernel": kernel})
            eng, r = build(shape, fmt, base_opts)
            res[fmt if kernel == "table" else f"{fmt}+{kernel}"] = r
            torch.cuda.reset_peak_memory_stats()  # peak below = serving (engine + KV cache + activations)
            t0 = time.time()
            r["decode"] = decode_bins(eng, bins)
            if verify_rows:
                r["verify"] = verify_cost(eng, list(verify_rows), list(verify_bases))
            if not fmt.startswith("aqlm"):
                r["prefill"] = {n: prefill_rate(eng, n, eng.cfg.vocab_size) for n in (512, 2048)}
            if short:
                r["short"] = short_prompts(eng, short, eng.cfg.vocab_size)
            r["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            del eng
            variants = dict(SWITCHES) if switches else {}
            variants.update({f"attn_config={n}": dict(attn_config=n) for n in attn_configs})
            for name, change in variants.items():
                eng, _ = build(shape, fmt, base_opts.replace(**change))
                steps = 32 if name == "graph=off" else STEPS
                r.setdefault("switches", {})[name] = decode_bins(eng, bins if name.startswith("attn") else (0,), steps)
                del eng
            r["seconds"] = time.time() - t0
            print(f"{shape} {fmt} ({kernel}): " + json.dumps({k: v for k, v in r.items() if k not in ('switches', 'verify')}),
                  flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    md = markdown(results)
    (out_dir / "results.md").write_text(md)
    print(md)
    return results


def markdown(results: dict) -> str:
    lines = [f"GPU: {results['gpu']}, torch {results['torch']}, {results['date']}", "",
             "| model | format | weights GB | load peak / (weights + KV) | tok/s @0-128 | @1024-1152 | @3968-4096 | "
             "prefill 512 tok/s | prefill 2048 tok/s | peak mem GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape, res in results["models"].items():
        for fmt, r in res.items():
            cells = _cells(r["decode"], BINS, "{:.1f}") + _cells(r.get("prefill", {}), (512, 2048), "{:.0f}")
            lines.append(f"| {shape} | {fmt} | {r['weight_bytes'] / 1e9:.2f} | {r['load_peak_over_weights_kv']:.3f} | "
                         f"{' | '.join(cells)} | {r['peak_mem_bytes'] / 1e9:.2f} |")
        if "fp16" in res and "cb4" in res and 0 in res["fp16"]["decode"] and 0 in res["cb4"]["decode"]:
            f, c = res["fp16"], res["cb4"]
            lines.append(f"| {shape} | cb4 / fp16 | | | {c['decode'][0] / f['decode'][0]:.2f}x | | | | | |")
    ver = [(s, f, r["verify"]) for s, res in results["models"].items() for f, r in res.items() if "verify" in r]
    if ver:
        lines += ["", "| model | format | base | M | verify us | decode step us | verify / step |", "|---|---|---|---|---|---|---|"]
        for shape, fmt, v in ver:
            for base, rows in v.items():
                for m, (tv, td, ratio) in rows.items():
                    lines.append(f"| {shape} | {fmt} | {base} | {m} | {tv * 1e6:.1f} | {td * 1e6:.1f} | {ratio:.3f}x |")
    sh = [(s, f, r["short"]) for s, res in results["models"].items() for f, r in res.items() if "short" in r]
    if sh:
        lines += ["", "| model | format | prompt tokens | prompt pass ms | exact prefill ms | exact / pass | default takes |",
                  "|---|---|---|---|---|---|---|"]
        for shape, fmt, v in sh:
            for n, row in v.items():
                lines.append(f"| {shape} | {fmt} | {n} | {row['pass_ms']:.2f} | {row['exact_ms']:.2f} | "
                             f"{row['exact_ms'] / row['pass_ms']:.2f}x | {row['default_path']} |")
    sw = [(s, f, r["switches"]) for s, res in results["models"].items() for f, r in res.items() if "switches" in r]
    if sw:
        lines += ["", "| model | format | option | tok/s @0-128 | @1024-1152 | @3968-4096 |", "|---|---|---|---|---|---|"]
        for shape, fmt, switches in sw:
            for name, d in switches.items():
                lines.append(f"| {shape} | {fmt} | {name} | {' | '.join(_cells(d, BINS, '{:.1f}'))} |")
    return "\n".join(lines) + "\n"


def _cells(values: dict, keys, fmt: str) -> list[str]:
    """Table cells of ``values`` at ``keys`` ("-" where not measured)."""
    return [fmt.format(values[k]) if k in values else "-" for k in keys]


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(b) for b in s.split(",") if b)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/bench-e2e", metavar="DIR",
                   help="directory for results.json and results.md (default out/bench-e2e)")
    p.add_argument("--models", default="llama2-7b,llama3-8b", metavar="SHAPE,...",
                   help="model shapes, comma-separated, from eval/random_model.py SHAPES (default llama2-7b,llama3-8b)")
    p.add_argument("--switches", action="store_true", help="also measure with each option off")
    p.add_argument("--formats", default="", help=f"comma list from {', '.join(FORMATS)} (default: "
                   f"{', '.join(DEFAULT_FORMATS)}; {', '.join(f'{k}: {v}' for k, v in SHAPE_FORMATS.items())})")
    p.add_argument("--bins", default=",".join(map(str, BINS)), help="decode start positions (128 steps each)")
    p.add_argument("--verify", default="", help="verify rows M to time against decode steps, e.g. 1,2,4,8,16")
    p.add_argument("--short-prompts", default="", help="prompt lengths to time the prompt pass against the exact "
                   "prefill at, e.g. 16,32,64,128,192,256 (GpuEngine.short_exact's rule)")
    p.add_argument("--verify-bases", default="64,1088", help="positions of the verify passes")
    p.add_argument("--attn-configs", default="", help="comma list of attention config names (AttnConfig.name): "
                   "the bins again with each, next to the default")
    p.add_argument("--aqlm-kernels", default="table", help="2x8 GEMV kernels to run the aqlm-2x8 rows with: "
                   "table, mma or table,mma (KernelOptions.aqlm_kernel)")
    p.add_argument("--mla", default="expanded", choices=("expanded", "latent"),
                   help="latent-attention models: per-head cache (expanded) or the absorbed form over the latent cache")
    a = p.parse_args(argv)
    from ..kernels.attention import named_config
    names = tuple(n for n in a.attn_configs.split(",") if n)
    try:
        for n in names:
            named_config(n)
    except ValueError as e:
        print(f"bench_e2e: --attn-configs: {e}")
        return 2
    kernels = tuple(k for k in a.aqlm_kernels.split(",") if k)
    if not kernels or any(k not in AQLM_KERNELS for k in kernels):
        print(f"bench_e2e: --aqlm-kernels: expected a comma list of {', '.join(AQLM_KERNELS)}, got {a.aqlm_kernels!r}")
        return 2
    if not torch.cuda.is_available():
        print("bench_e2e needs a CUDA GPU")
        return 1
    run(a.models.split(","), a.switches, Path(a.out), [f for f in a.formats.split(",") if f] or None,
        _ints(a.bins), names, _ints(a.verify), _ints(a.verify_bases), Options.from_env().replace(mla=a.mla),
        kernels, _ints(a.short_prompts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
