"""A real model on the GPU engine against the CPU reference path (fp32), dense and quantized.

    python scripts/gpu_agreement.py MODEL.gguf --out DIR

Quantizes MODEL to a 4-bit .cbk (8-bit head; calibration text sampled from the model), then for
the source and the .cbk: prompt logits of the GPU engine (prefill, every position) vs the CPU
reference, relative error ||a-b||/||b||, and 16 greedy tokens from both. Prints a table last.
"""
import argparse
import json
import sys
import time
from pathlib import Path


import trapetum
from trapetum.quant.quantize import Recipe, quantize_to_cbk

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t = time.time()
    cbk = out / "model-4bit.cbk"
    quantize_to_cbk(a.model, cbk, Recipe(bits=4, head_bits=8).validate(), device="cuda", progress=False)
    rows = [f"quantized on the GPU in {time.time() - t:.1f} s ({cbk.stat().st_size / 1e6:.1f} MB)"]
    results = {}
    for name, src in (("source", a.model), ("cbk-4bit", str(cbk))):
        cpu = trapetum.load(src)
        gpu = trapetum.load(src, device="cuda")
        errs, greedy = [], []
        for p in PROMPTS:
            ids = cpu.encode(p)
            ref = cpu.logits(ids)
            got = gpu.runner.prefill(ids, all_logits=True).cpu()
            errs.append(float((got - ref).norm() / ref.norm()))
            c = cpu.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids
            g = gpu.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids
            greedy.append(next((i for i, (x, y) in enumerate(zip(c, g)) if x != y), len(c)))
        comp = gpu.generate("The meaning of life is", max_new_tokens=200, ignore_eos=True)
        results[name] = {"max_rel_err": max(errs), "rel_errs": errs, "greedy_match_prefix": greedy,
                         "decode_tok_s": comp.tokens_per_s}
        rows.append(f"{name:9s} max prompt-logit rel err {max(errs):.2e}  greedy prefix matches "
                    f"{greedy} / 16  decode {comp.tokens_per_s:.0f} tok/s (200 tokens, host loop)")
    (out / "agreement.json").write_text(json.dumps(results, indent=2))
    print("\n".join(rows))
    ok = all(r["max_rel_err"] < 2e-3 and min(r["greedy_match_prefix"]) == 16 for r in results.values())
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
