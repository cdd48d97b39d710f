"""Where `trapetum quantize --calib FILE` spends its time on the CPU, phase by phase, at a chosen thread count:
file calibration (``collect_input_stats_layerwise``) over ``--seqs`` windows, then the k-means of one layer's
projections and of the LM head (weighted by those statistics), each with wall and process CPU time (CPU time is
the steadier figure on a shared machine), and optionally a cProfile table of the k-means of the head.
Usage: python scripts/profile_quantize_cpu.py MODEL --calib FILE [--seqs 8] [--layer 0] [--threads 1] [--cprofile]"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from trapetum.formats.detect import load_checkpoint
from trapetum.quant import calibrate
from trapetum.quant.quantize import Recipe, quantize_matrix
from trapetum.schemes.record import QuantRecord
from trapetum.schemes import registry


def _timed(label: str, fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    print(f"{label:<44} wall {time.perf_counter() - w:7.2f} s   cpu {time.process_time() - c:7.2f} s", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--calib", required=True)
    p.add_argument("--seqs", type=int, default=8, help="calibration windows of 512 tokens (the recipe uses 32)")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cprofile", action="store_true", help="cProfile table of the head's k-means")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch threads {torch.get_num_threads()}")
    ck = load_checkpoint(a.model)
    recipe = Recipe()
    toks = _timed("tokenize + windows", lambda: calibrate.file_calibration_tokens(ck.tokenizer, a.calib, a.seqs, 512))
    stats = _timed(f"layerwise statistics, {toks.shape[0]} x {toks.shape[1]} tokens, "
                   f"{ck.config.num_layers} layers",
                   lambda: calibrate.collect_input_stats_layerwise(ck, toks, progress=False))

    def weight(name):
        x = ck.tensors[name]
        return (registry.dequantize(x, torch.float32) if isinstance(x, QuantRecord) else x).float()

    total_w = total_c = 0.0
    for n in [f"model.layers.{a.layer}.{s}" for s in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                       "mlp.down_proj")]:
        W = weight(n + ".weight")
        w, c = time.perf_counter(), time.process_time()
        _, err = quantize_matrix(W, recipe.bits, stats[n], recipe, "cpu", None)
        dw, dc = time.perf_counter() - w, time.process_time() - c
        total_w, total_c = total_w + dw, total_c + dc
        print(f"k-means {n:<36} {tuple(W.shape)} wall {dw:6.2f} s  cpu {dc:6.2f} s  rel err {err['rel_err']:.4f}")
    print(f"k-means of layer {a.layer}: wall {total_w:.2f} s, cpu {total_c:.2f} s "
          f"(x {ck.config.num_layers} layers ~ {total_c * ck.config.num_layers:.0f} s cpu)")
    E = weight("lm_head.weight" if "lm_head.weight" in set(ck.tensors) else "model.embed_tokens.weight")
    run = lambda: quantize_matrix(E, recipe.head_bits, stats["lm_head"], recipe, "cpu", None)  # noqa: E731
    if a.cprofile:
        prof = cProfile.Profile()
        prof.enable()
    _, err = _timed(f"k-means of the head {tuple(E.shape)}, {recipe.head_bits}-bit", run)
    print(f"head rel err {err['rel_err']:.4f}")
    if a.cprofile:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
