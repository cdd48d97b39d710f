"""Bytes one decode step must read, and the tok/s they allow, for the model shapes of eval/random_model.py (issue 17:
the mixture-of-experts bars are set against this floor).

    python -m trapetum.eval.moe_floor [--models deepseek-v2-lite,mixtral-8x7b] [--formats cb4,aqlm-2x8,fp16]
                                      [--bandwidth 4.0] [--position 64]

Per token: every non-expert weight of the format (random_model.random_checkpoint's records: cb4 = 4-bit codes +
16 fp16 centroids per row, 8-bit head with 256 per row; aqlm-2x8 = 2 bytes of codes per 8 inputs + 8 KiB of
codebooks + an fp16 scale per row, fp16 head; fp16 = 2 bytes a weight), the routed experts' weights times k / E
(exactly k of E equal-sized experts per token), routers and shared experts in full, one embedding row; plus the KV
cache at ``--position`` (the mean of the first 128 positions by default), both as the engine caches it today (per
head; MLA expanded through kv_b to 2 x H x max(head_dim, v_head_dim)) and as the latent (kv_lora_rank +
qk_rope_head_dim per position). Floor = bytes / bandwidth (TB/s).
"""
from __future__ import annotations

import argparse

from ..models.config import ModelConfig
from ..models.schema import expected_shapes
from .random_model import FORMATS, SHAPES


def weight_bytes(name: str, shape: tuple, fmt: str) -> int:
    if len(shape) == 1:
        return shape[0] * 4  # norms fp32, biases small
    n, k = shape
    if name == "model.embed_tokens.weight":
        return k * 2  # one fp16 row
    if fmt == "fp16" or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
        return n * k * 2
    if fmt == "cb4":
        if name == "lm_head.weight":
            return n * k + n * 256 * 2
        return n * -(-k // 2) + n * 16 * 2
    if name == "lm_head.weight":  # aqlm formats: fp16 head
        return n * k * 2
    m = 2 if fmt == "aqlm-2x8" else 1
    return n * (k // 8) * m * (1 if fmt == "aqlm-2x8" else 2) + m * (256 if fmt == "aqlm-2x8" else 65536) * 8 * 2 + n * 2


def step_bytes(shape: str, fmt: str, position: int = 64) -> dict:
    cfg = ModelConfig(**SHAPES[shape]).validate(shape)
    experts = dense = 0
    for name, shp in expected_shapes(cfg).items():
        b = weight_bytes(name, shp, fmt)
        if ".experts." in name:
            experts += b
        else:
            dense += b
    active = experts * cfg.num_experts_per_tok // max(cfg.num_experts, 1)
    if cfg.kv_lora_rank:
        kv_now = 2 * cfg.num_heads * max(cfg.head_dim, cfg.v_head_dim) * 2 * cfg.num_layers * position
        kv_latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * cfg.num_layers * position
    else:
        kv_now = kv_latent = 2 * cfg.num_kv_heads * cfg.head_dim * 2 * cfg.num_layers * position
    return {"dense": dense, "experts_active": active, "experts_all": experts, "kv_now": kv_now, "kv_latent": kv_latent}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trapetum.eval.moe_floor", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="deepseek-v2-lite,mixtral-8x7b")
    p.add_argument("--formats", default="cb4,aqlm-2x8,fp16")
    p.add_argument("--bandwidth", type=float, default=4.0, help="TB/s")
    p.add_argument("--position", type=int, default=64)
    a = p.parse_args(argv)
    for shape in a.models.split(","):
        if shape not in SHAPES:
            print(f"moe_floor: --models: unknown shape {shape!r} (one of {', '.join(SHAPES)})")
            return 2
    for fmt in a.formats.split(","):
        if fmt not in FORMATS:
            print(f"moe_floor: --formats: unknown format {fmt!r} (one of {', '.join(FORMATS)})")
            return 2
    print("| model | format | non-expert MB | active experts MB | KV MB (engine now / latent) | MB / token "
          "(now / latent) | floor us (latent) | tok/s bound (latent) |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in a.models.split(","):
        for fmt in a.formats.split(","):
            b = step_bytes(shape, fmt, a.position)
            now = b["dense"] + b["experts_active"] + b["kv_now"]
            lat = b["dense"] + b["experts_active"] + b["kv_latent"]
            us = lat / (a.bandwidth * 1e12) * 1e6
            print(f"| {shape} | {fmt} | {b['dense'] / 1e6:.1f} | {b['experts_active'] / 1e6:.1f} | "
                  f"{b['kv_now'] / 1e6:.1f} / {b['kv_latent'] / 1e6:.1f} | {now / 1e6:.1f} / {lat / 1e6:.1f} | "
                  f"{us:.0f} | {1e6 / us:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
