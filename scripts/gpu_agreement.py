"""A real model on the GPU engine against the CPU reference path (fp32), dense and quantized.

    python scripts/gpu_agreement.py MODEL.gguf --out DIR [--precise]

Quantizes MODEL to a 4-bit .cbk (8-bit head; calibration text sampled from the model), then for
the source and the .cbk: prompt logits of the GPU engine (prefill, every position) vs the CPU
reference, relative error ||a-b||/||b||, and 16 greedy tokens from both. Prints a table last.

--precise: also loads each model with precise_prefill=True (runtime/precise.py) and reports both modes;
PASS/FAIL is then the precise prefill's (max error < 2e-3 on every prompt, source and .cbk), the
default rows and the greedy prefixes are information.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

import trapetum
from trapetum.quant.quantize import Recipe, quantize_to_cbk
from trapetum.settings import Options

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--precise", action="store_true", help="also the precise prefill; PASS/FAIL is its")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t = time.time()
    cbk = out / "model-4bit.cbk"
    quantize_to_cbk(a.model, cbk, Recipe(bits=4, head_bits=8).validate(), device="cuda", progress=False,
                    mem_budget_gb=Options.from_env().calib_mem_gb)
    rows = [f"quantized on the GPU in {time.time() - t:.1f} s ({cbk.stat().st_size / 1e6:.1f} MB)"]
    results = {}
    modes = ("default", "precise") if a.precise else ("default",)
    for name, src in (("source", a.model), ("cbk-4bit", str(cbk))):
        cpu = trapetum.load(src)
        refs = [(cpu.encode(p), cpu.logits(cpu.encode(p))) for p in PROMPTS]
        cpu_greedy = [cpu.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids for ids, _ in refs]
        for mode in modes:
            t = time.time()
            gpu = trapetum.load(src, device="cuda", precise_prefill=mode == "precise")
            load_s = time.time() - t
            errs, greedy, pre_ms = [], [], []
            for (ids, ref), c in zip(refs, cpu_greedy):
                gpu.runner.prefill(ids, all_logits=True)  # warm-up (kernels, allocations)
                torch.cuda.synchronize()
                t = time.perf_counter()
                got = gpu.runner.prefill(ids, all_logits=True)
                torch.cuda.synchronize()
                pre_ms.append((time.perf_counter() - t) * 1e3)
                errs.append(float((got.cpu() - ref).norm() / ref.norm()))
                g = gpu.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids
                greedy.append(next((i for i, (x, y) in enumerate(zip(c, g)) if x != y), len(c)))
            r = {"mode": mode, "max_rel_err": max(errs), "rel_errs": errs, "greedy_match_prefix": greedy,
                 "prefill_ms": pre_ms, "load_s": load_s}
            line = (f"{name:9s} {mode:8s} prompt-logit rel err {' '.join(f'{e:.2e}' for e in errs)} "
                    f"(max {max(errs):.2e})  greedy prefix {greedy} / 16  prefill {min(pre_ms):.1f} ms")
            if mode == "precise":
                from trapetum.runtime import precise
                r["fp32_output_gemm"] = precise._OUT_DTYPE_MM  # False: the fp32-GEMM fallback ran (old torch)
                line += "  (fp16 GEMMs, fp32 out)" if precise._OUT_DTYPE_MM else "  (fp32-GEMM fallback)"
            if mode == "default":
                comp = gpu.generate("The meaning of life is", max_new_tokens=200, ignore_eos=True)
                r["decode_tok_s"] = comp.tokens_per_s
                line += f"  decode {comp.tokens_per_s:.0f} tok/s (200 tokens, host loop)"
            results[f"{name}/{mode}" if a.precise else name] = r
            rows.append(line)
            del gpu
            torch.cuda.empty_cache()
    (out / "agreement.json").write_text(json.dumps(results, indent=2))
    print("\n".join(rows))
    if a.precise:  # the precise prefill against the bar; default rows are information
        ok = all(r["max_rel_err"] < 2e-3 for r in results.values() if r["mode"] == "precise")
        print("precise prefill, max prompt-logit rel err < 2e-3 (source and cbk-4bit): " + ("PASS" if ok else "FAIL"))
    else:
        ok = all(r["max_rel_err"] < 2e-3 and min(r["greedy_match_prefix"]) == 16 for r in results.values())
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
