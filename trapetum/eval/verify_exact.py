"""The verify contract, checked: a VERIFY pass of M rows gives bitwise the logits and KV-cache rows of M decode steps.

    python -m trapetum.eval.verify_exact [--shapes cb4-mha,cb4-gqa,aqlm-2x8,fp16] [--rows 1,2,4,8,16]
                                         [--bases 6,56,1016] [--options default,fuse=off,cuda-kernels=off]
    python -m trapetum.eval.verify_exact --shapes aqlm-2x8 --options aqlm=mma   (the "mma" 2x8 kernel option)

For each (base, M): a fixed prompt of ``base`` tokens is prefilled, the cache snapshotted; then
  decode: cache restored, every position >= base and the logits / workspace buffers filled with random values,
          M decode steps (tokens t_0 .. t_{M-1} at base .. base + M - 1), then one more step (t_M at base + M);
  verify: cache restored, state scrambled again (other random values), one VERIFY pass of t_0 .. t_{M-1} at base,
          then the same next decode step;
and the check asserts, bitwise: each verify row's logits == the decode step's, the cache rows base .. base + M - 1
== the decode steps' rows (every layer, K and V), and the next step's logits equal. Graphs are captured at the
first base and replayed at the others (the engine's graphs are keyed by mode and rows, not position). The
engines are small (few layers) at real per-layer shapes: Llama-2-7B MHA 32x128 and Llama-3-8B GQA 32/8x128 4-bit,
a 2x8 AQLM and an fp16 model, random weights (eval/random_model.py).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from ..settings import Options

VARIANTS = {"default": {}, "fuse=off": dict(fuse=False), "cuda-kernels=off": dict(kernels={"cuda": False}),
            "attention=unfused": dict(attention="unfused"), "graph=off": dict(graph=False),
            "aqlm=mma": dict(kernels={"aqlm_kernel": "mma"})}  # the tensor-core 2x8 kernel (aqlm-2x8 only)
# name -> (random_model shape, format, layers)
SHAPES = {"cb4-mha": ("llama2-7b", "cb4", 2), "cb4-gqa": ("llama3-8b", "cb4", 2),
          "aqlm-2x8": ("llama2-7b", "aqlm-2x8", 2), "fp16": ("llama2-7b", "fp16", 2)}


def _scramble(eng, base: int, g: torch.Generator) -> None:
    """Random values in every cache position >= base, the logits and greedy buffers and the attention workspace."""
    for t in (eng.kv.k, eng.kv.v):
        t[:, :, base:].copy_(torch.randn(t[:, :, base:].shape, generator=g, device=t.device).to(t.dtype))
    eng.logits_rows.copy_(torch.randn(eng.logits_rows.shape, generator=g, device=eng.device))
    eng.argmax_rows.random_(0, 2 ** 31, generator=g)
    for t in eng.attn_ws:
        if t.dtype.is_floating_point:
            t.copy_(torch.randn(t.shape, generator=g, device=t.device))


def check(eng, rows=(1, 2, 4, 8, 16), bases=(6, 56, 1016), seed: int = 0) -> list[dict]:
    """One record per (base, M): whether logits rows, cache rows and the next step agree bitwise."""
    dev = eng.device
    g = torch.Generator(device=dev).manual_seed(seed)
    V = eng.cfg.vocab_size
    out = []
    for base in bases:
        prompt = torch.randint(3, V, (base,), generator=g, device=dev)
        eng.prefill(prompt)
        k0, v0 = eng.kv.k[:, :, :base].clone(), eng.kv.v[:, :, :base].clone()
        for m in rows:
            if base + m + 1 > eng.max_len:
                continue
            toks = torch.randint(3, V, (m + 1,), generator=g, device=dev)

            def restore():
                eng.kv.k[:, :, :base].copy_(k0)
                eng.kv.v[:, :, :base].copy_(v0)
                _scramble(eng, base, g)

            restore()
            steps = []
            for r in range(m):
                eng.set_position(toks[r], base + r)
                eng.step(greedy=False)
                steps.append(eng.logits.clone())
            kd, vd = eng.kv.k[:, :, base:base + m].clone(), eng.kv.v[:, :, base:base + m].clone()
            eng.set_position(toks[m], base + m)
            eng.step(greedy=False)
            next_d = eng.logits.clone()

            restore()
            ver = eng.verify(toks[:m], base).clone()
            kv_ok = torch.equal(eng.kv.k[:, :, base:base + m], kd) and torch.equal(eng.kv.v[:, :, base:base + m], vd)
            eng.set_position(toks[m], base + m)
            eng.step(greedy=False)
            rows_ok = [torch.equal(ver[r], steps[r]) for r in range(m)]
            diff = max(float((ver[r] - steps[r]).abs().max()) for r in range(m))
            out.append({"base": base, "rows": m, "logits": all(rows_ok), "kv": kv_ok,
                        "next": torch.equal(eng.logits, next_d), "max_abs_diff": diff,
                        "ok": all(rows_ok) and kv_ok and torch.equal(eng.logits, next_d)})
    return out


def engine(shape: str, options: Options, max_len: int = 1040, device="cuda"):
    from ..runtime.engine import GpuEngine
    from .random_model import random_checkpoint
    model, fmt, layers = SHAPES[shape]
    return GpuEngine(random_checkpoint(model, fmt, device, layers=layers), max_len, device=device, options=options)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--bases", default="6,56,1016")
    p.add_argument("--options", default="default,fuse=off,cuda-kernels=off")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("verify_exact needs a CUDA GPU")
        return 1
    rows = tuple(int(x) for x in a.rows.split(","))
    bases = tuple(int(x) for x in a.bases.split(","))
    table, bad = [], 0
    for variant in a.options.split(","):
        opts = Options().replace(**VARIANTS[variant])
        for shape in a.shapes.split(","):
            t0 = time.time()
            eng = engine(shape, opts)
            res = check(eng, rows, bases)
            n_ok = sum(r["ok"] for r in res)
            bad += len(res) - n_ok
            worst = max(r["max_abs_diff"] for r in res)
            table.append(f"| {variant} | {shape} | {n_ok} of {len(res)} | {worst:.3g} | {time.time() - t0:.0f} s |")
            for r in res:
                if not r["ok"]:
                    print(f"MISMATCH {variant} {shape}: {r}", flush=True)
            del eng
            torch.cuda.empty_cache()
    print("| options | model | bitwise equal (base x M) | max abs logit diff | time |\n|---|---|---|---|---|")
    print("\n".join(table))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
