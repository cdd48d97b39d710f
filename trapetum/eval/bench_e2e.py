"""End-to-end decode and prefill benchmark on one GPU, random weights at real model shapes.

    python -m trapetum.eval.bench_e2e --out DIR [--models llama2-7b,llama3-8b] [--switches]
    python -m trapetum.eval.bench_e2e --out DIR --models llama2-70b --bins 0   (2-bit AQLM formats)

For each model shape, builds (on the GPU) an fp16 model and a 4-bit per-row codebook model with
an 8-bit LM head (Llama-2-70B, which does not fit in fp16: AQLM 2x8 and 1x16 models with random
codes, codebooks and scales and an fp16 LM head, as AQLM checkpoints keep it; not run by default),
and in one process measures:
  * decode tok/s, greedy, CUDA graph: mean over 128 consecutive steps starting at positions
    0, 1024 and 3968 (the seed's bins: first 128, 1,024-1,152, 3,968-4,096);
  * prefill tok/s at prompt lengths 512 and 2,048 (median of 7; not for the AQLM formats, whose
    prefill dequantizes every projection per call);
  * peak GPU memory of each engine;
  * with --switches, the same decode bins with each kill switch (TRAPETUM_GRAPH=0, TRAPETUM_FUSE=0,
    TRAPETUM_TC=0, TRAPETUM_ATTN=unfused, TRAPETUM_ATTN=seq, TRAPETUM_PDL=0) so every optimization's share is
    visible; with --attn-configs NAME,..., the same bins with each named attention config (TRAPETUM_ATTN_CONFIG).
Writes results.json, results.md and decode.png under DIR; prints the table last.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from ..models.config import ModelConfig
from ..models.decoder import Block, Decoder
from ..models.layers import Embedding, Linear, RMSNorm

SHAPES = {
    "llama2-7b": dict(family="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                      num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096),
    "llama3-8b": dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
                      rope_theta=500000.0),
    "llama2-70b": dict(family="llama", vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80,
                       num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=4096),
}
FORMATS = ("fp16", "cb4")
SHAPE_FORMATS = {"llama2-70b": ("aqlm-2x8", "aqlm-1x16")}  # formats measured when --formats is not given
BINS = (0, 1024, 3968)
STEPS = 128


class RandomCodebookLinear(nn.Module):
    """A projection stored as per-row codebooks (canonical layout), random contents."""

    def __init__(self, out_f: int, in_f: int, bits: int, device):
        super().__init__()
        self.in_features, self.out_features, self.bits, self.bias = in_f, out_f, bits, None
        per = 8 // bits
        self.codes = torch.randint(0, 256, (out_f, -(-in_f // per)), dtype=torch.uint8, device=device)
        cb = torch.randn(out_f, 1 << bits, device=device).sort(dim=1).values * 0.02
        self.codebook = cb.to(torch.float16)

    def dequantize(self):
        from ..kernels.codebook_gemv import dequantize
        return dequantize(self.codes, self.codebook, self.bits, self.in_features)


def random_additive(out_f: int, in_f: int, scheme: str, device, g: torch.Generator) -> nn.Module:
    """An AQLM projection (``AdditiveLinear``, canonical layout) with random codes, codebooks, scales."""
    from ..quant.additive import SCHEMES, AdditiveLinear

    M, nbits = SCHEMES[scheme]
    half = 1 << (nbits - 1)
    codes = torch.randint(-half, half, (out_f, in_f // 8, M), device=device, generator=g,
                          dtype=torch.int8 if nbits == 8 else torch.int16)
    cb = torch.randn(M, 1 << nbits, 1, 8, device=device, generator=g).half()
    scales = torch.full((out_f, 1, 1, 1), 0.02 / M ** 0.5, device=device, dtype=torch.float16)
    return AdditiveLinear(codes, cb, scales)


def random_decoder(shape: str, fmt: str, device="cuda") -> Decoder:
    """fmt: 'fp16' (dense), 'cb4' (4-bit codebook projections, 8-bit codebook head) or 'aqlm-2x8' /
    'aqlm-1x16' (additive projections, fp16 head)."""
    cfg = ModelConfig(**SHAPES[shape]).validate(shape)
    D, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qd, kd = cfg.num_heads * hd, cfg.num_kv_heads * hd
    g = torch.Generator(device=device).manual_seed(0)

    def proj(out_f, in_f, bits=4):
        if fmt == "fp16" or (fmt.startswith("aqlm") and bits == 8):  # AQLM models keep an fp16 head
            return Linear(torch.randn(out_f, in_f, device=device, dtype=torch.float16, generator=g) * 0.02)
        if fmt.startswith("aqlm"):
            return random_additive(out_f, in_f, fmt, device, g)
        return RandomCodebookLinear(out_f, in_f, bits, device)

    def norm():
        return RMSNorm(torch.ones(D, device=device), cfg.rms_norm_eps)

    blocks = []
    for i in range(cfg.num_layers):
        mods = {"q": proj(qd, D), "k": proj(kd, D), "v": proj(kd, D), "o": proj(D, qd),
                "gate": proj(I, D), "up": proj(I, D), "down": proj(D, I),
                "input_norm": norm(), "post_attn_norm": norm()}
        blocks.append(Block(cfg, i, mods))
    embed = Embedding(torch.randn(cfg.vocab_size, D, device=device, dtype=torch.float16, generator=g) * 0.02)
    head = proj(cfg.vocab_size, D, bits=8)
    return Decoder(cfg, embed, blocks, norm(), head).to(device)


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
        t = _cuda_time(lambda: eng.step(True), steps)
        out[p0] = 1.0 / t
    return out


def prefill_rate(eng, n: int, vocab: int) -> float:
    ids = torch.randint(0, vocab, (n,), device="cuda")
    eng.prefill(ids)
    times = sorted(_cuda_time(lambda: eng.prefill(ids)) for _ in range(7))  # 512 tokens is host-bound: noisy
    return n / times[3]


def with_env(name: str, value: str):
    class _Env:
        def __enter__(self):
            self.old = os.environ.get(name)
            os.environ[name] = value

        def __exit__(self, *a):
            if self.old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = self.old
    return _Env()


def run(models: list[str], switches: bool, out_dir: Path, formats: list[str] | None = None,
        bins: tuple[int, ...] = BINS, attn_configs: tuple[str, ...] = ()) -> dict:
    from ..runtime.engine import GpuEngine
    results = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
               "models": {}}
    for shape in models:
        res = results["models"][shape] = {}
        for fmt in formats or SHAPE_FORMATS.get(shape, FORMATS):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            dec = random_decoder(shape, fmt)
            eng = GpuEngine(dec, max_len=4096 + 128)
            del dec
            torch.cuda.empty_cache()
            r = res[fmt] = {"weight_bytes": eng.weight_bytes(), "build_peak_bytes": torch.cuda.max_memory_allocated()}
            torch.cuda.reset_peak_memory_stats()  # peak below = serving (engine + KV cache + activations)
            t0 = time.time()
            r["decode"] = decode_bins(eng, bins)
            if not fmt.startswith("aqlm"):
                r["prefill"] = {n: prefill_rate(eng, n, eng.cfg.vocab_size) for n in (512, 2048)}
            r["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            if switches:
                r["switches"] = {}
                for name, value in (("TRAPETUM_ATTN", "unfused"), ("TRAPETUM_ATTN", "seq"), ("TRAPETUM_TC", "0"),
                                    ("TRAPETUM_PDL", "0")):
                    with with_env(name, value):
                        eng.graphs.clear()
                        r["switches"][f"{name}={value}"] = decode_bins(eng)
                eng.graphs.clear()
                eng.use_graph = False
                r["switches"]["TRAPETUM_GRAPH=0"] = decode_bins(eng, bins=(0,), steps=32)
                eng.use_graph = True
            for name in attn_configs:  # the same bins with each named attention config (graphs recaptured)
                with with_env("TRAPETUM_ATTN_CONFIG", name):
                    eng.graphs.clear()
                    r.setdefault("switches", {})[f"TRAPETUM_ATTN_CONFIG={name}"] = decode_bins(eng, bins)
                eng.graphs.clear()
            del eng
            torch.cuda.empty_cache()
            if switches:
                dec = random_decoder(shape, fmt)
                eng = GpuEngine(dec, max_len=4096 + 128, fuse=False)
                del dec
                r["switches"]["TRAPETUM_FUSE=0"] = decode_bins(eng, bins=(0,))
                del eng
                torch.cuda.empty_cache()
            r["seconds"] = time.time() - t0
            print(f"{shape} {fmt}: " + json.dumps({k: v for k, v in r.items() if k != 'switches'}), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    md = markdown(results)
    (out_dir / "results.md").write_text(md)
    try:
        plot(results, out_dir / "decode.png")
    except Exception as e:  # plotting is optional
        print(f"(no plot: {e})")
    print(md)
    return results


def markdown(results: dict) -> str:
    lines = [f"GPU: {results['gpu']}, torch {results['torch']}, {results['date']}", "",
             "| model | format | weights GB | tok/s @0-128 | @1024-1152 | @3968-4096 | prefill 512 tok/s | "
             "prefill 2048 tok/s | peak mem GB |", "|---|---|---|---|---|---|---|---|---|"]
    for shape, res in results["models"].items():
        for fmt, r in res.items():
            cells = _cells(r["decode"], BINS, "{:.1f}") + _cells(r.get("prefill", {}), (512, 2048), "{:.0f}")
            lines.append(f"| {shape} | {fmt} | {r['weight_bytes'] / 1e9:.2f} | {' | '.join(cells)} | "
                         f"{r['peak_mem_bytes'] / 1e9:.2f} |")
        if "fp16" in res and "cb4" in res:
            f, c = res["fp16"], res["cb4"]
            lines.append(f"| {shape} | cb4 / fp16 | | {c['decode'][0] / f['decode'][0]:.2f}x | | | "
                         f"{c['prefill'][512] / f['prefill'][512]:.2f}x | {c['prefill'][2048] / f['prefill'][2048]:.2f}x | |")
    sw = [(s, f, r["switches"]) for s, res in results["models"].items() for f, r in res.items() if "switches" in r]
    if sw:
        lines += ["", "| model | format | switch | tok/s @0-128 | @1024-1152 | @3968-4096 |", "|---|---|---|---|---|---|"]
        for shape, fmt, switches in sw:
            for name, d in switches.items():
                lines.append(f"| {shape} | {fmt} | {name} | {' | '.join(_cells(d, BINS, '{:.1f}'))} |")
    return "\n".join(lines) + "\n"


def _cells(values: dict, keys, fmt: str) -> list[str]:
    """Table cells of ``values`` at ``keys`` ("-" where not measured)."""
    return [fmt.format(values[k]) if k in values else "-" for k in keys]


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for shape, res in results["models"].items():
        for fmt, r in res.items():
            xs = sorted(r["decode"])
            ax.plot([x + STEPS / 2 for x in xs], [r["decode"][x] for x in xs], marker="o", label=f"{shape} {fmt}")
    ax.set_xlabel("position")
    ax.set_ylabel("decode tok/s (batch 1, CUDA graph)")
    ax.set_title(results["gpu"])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/bench-e2e")
    p.add_argument("--models", default="llama2-7b,llama3-8b")
    p.add_argument("--switches", action="store_true", help="also measure with each kill switch")
    p.add_argument("--formats", default="", help="comma list from fp16, cb4, aqlm-2x8, aqlm-1x16 "
                   f"(default: {', '.join(FORMATS)}; {', '.join(f'{k}: {v}' for k, v in SHAPE_FORMATS.items())})")
    p.add_argument("--bins", default=",".join(map(str, BINS)), help="decode start positions (128 steps each)")
    p.add_argument("--attn-configs", default="", help="comma list of attention candidate names (AttnConfig.name): "
                   "the bins again with each (TRAPETUM_ATTN_CONFIG), next to the default")
    a = p.parse_args(argv)
    from ..kernels.attention import named_config
    names = tuple(n for n in a.attn_configs.split(",") if n)
    try:
        for n in names:
            named_config(n)
    except ValueError as e:
        print(f"bench_e2e: --attn-configs: {e}")
        return 2
    if not torch.cuda.is_available():
        print("bench_e2e needs a CUDA GPU")
        return 1
    run(a.models.split(","), a.switches, Path(a.out), [f for f in a.formats.split(",") if f] or None,
        tuple(int(b) for b in a.bins.split(",") if b), names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
