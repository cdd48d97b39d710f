"""Quantizer speed on a random-weight model at a real shape (issue 3 item 4).

    python -m trapetum.eval.bench_quantize --shape llama2-7b [--device cuda] [--out DIR] [--layers N]
    trapetum bench quantize --shape llama2-7b

Builds a lazy checkpoint whose tensors are generated on demand (seeded per tensor, fp16, on the
device), E[x^2] statistics drawn at random per input channel (the weighted k-means path, without
running calibration text through a random model), and times ``quantize_to_cbk`` end to end: every
projection 4-bit, the LM head 8-bit, the file streamed to DIR. ``--layers`` quantizes the first N
blocks only (a smoke run); the figure to report is a full run.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
import zlib
from pathlib import Path

import torch

from ..formats.checkpoint import Checkpoint, LazyTensors, expected_shapes
from ..models.config import ModelConfig
from ..quant.quantize import PROJ_SUFFIXES, Recipe, quantize_to_cbk
from .bench_e2e import SHAPES


def random_checkpoint(cfg: ModelConfig, device: str) -> Checkpoint:
    """Lazy checkpoint of random fp16 weights (norms ones), one tensor materialized per access."""
    shapes = expected_shapes(cfg)

    def getter(name: str, shape: tuple[int, ...]):
        def get() -> torch.Tensor:
            if len(shape) == 1:
                return torch.ones(shape, device=device)
            g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
            return (torch.randn(shape, device=device, generator=g) * 0.02).to(torch.float16)
        return get

    tensors = LazyTensors({n: getter(n, s) for n, s in shapes.items()}, {n: "F16" for n in shapes}, shapes)
    return Checkpoint(cfg, tensors, None, f"random:{cfg.family}", "random")


def random_stats(cfg: ModelConfig, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(1)
    ins = {"self_attn.q_proj": cfg.hidden_size, "self_attn.k_proj": cfg.hidden_size,
           "self_attn.v_proj": cfg.hidden_size, "self_attn.o_proj": cfg.num_heads * cfg.head_dim,
           "mlp.gate_proj": cfg.hidden_size, "mlp.up_proj": cfg.hidden_size, "mlp.down_proj": cfg.intermediate_size}
    stats = {}
    for i in range(cfg.num_layers):
        for suf in PROJ_SUFFIXES:
            stats[f"model.layers.{i}.{suf}"] = torch.rand(ins[suf], device=device, generator=g) + 0.01
    stats["lm_head"] = torch.rand(cfg.hidden_size, device=device, generator=g) + 0.01
    return stats


def run(shape: str, device: str, out_dir: Path | None, layers: int | None = None) -> dict:
    spec = dict(SHAPES[shape])
    if layers:
        spec["num_layers"] = layers
    cfg = ModelConfig(**spec).validate(shape)
    ckpt = random_checkpoint(cfg, device)
    stats = random_stats(cfg, device)
    recipe = Recipe(bits=4, head_bits=8, embed_bits=None).validate()
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        path, qm = quantize_to_cbk(ckpt, Path(tmp) / "model.cbk", recipe, device=device, progress=True,
                                   stats=stats)
        seconds = time.perf_counter() - t0
        size = path.stat().st_size
    res = {"shape": shape, "layers": cfg.num_layers, "device": device,
           "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
           "seconds": round(seconds, 2), "file_bytes": size, "date": time.strftime("%Y-%m-%d"),
           "recipe": "4-bit projections (E[x^2]-weighted k-means, random statistics), 8-bit head, fp16 embedding"}
    print(json.dumps(res))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="directory for the temporary .cbk (default: system temp)")
    p.add_argument("--layers", type=int, default=None, help="only the first N blocks (smoke run)")
    a = p.parse_args(argv)
    run(a.shape, a.device, Path(a.out) if a.out else None, a.layers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
