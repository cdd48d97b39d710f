"""Where the 2x8 additive quantizer spends its time on the GPU: one Llama-2-7B gate-shaped projection
(11008 x 4096, random weights and importance) quantized with the default recipe by several beam-step
implementations / chunk sizes; wall time of each, its final weighted error, whether the codes agree bit
for bit, and a torch.profiler table (top ops by CUDA and by CPU time) of the last one.
Usage: python scripts/profile_quantizer.py --out DIR [--runs torch:65536,triton:1048576]"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from trapetum.quant.additive import quantize_additive


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--runs", default="torch:65536,triton:1048576", help="search:chunk,... (beam step, block)")
    p.add_argument("--shape", default="11008x4096", help="out x in")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n, k = (int(s) for s in a.shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    W = torch.randn(n, k, device="cuda", generator=g) * 0.02
    imp = torch.rand(k, device="cuda", generator=g) + 0.01
    quantize_additive(W[:256], imp, device="cuda")  # warm-up: kernels, cuBLAS handles
    res, codes = [], {}
    runs = [(r.split(":")[0], int(r.split(":")[1])) for r in a.runs.split(",")]
    for i, (search, c) in enumerate(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        if i == len(runs) - 1:
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                r = quantize_additive(W, imp, device="cuda", chunk=c, search=search)
                torch.cuda.synchronize()
        else:
            r = quantize_additive(W, imp, device="cuda", chunk=c, search=search)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        codes[i] = r.codes
        res.append({"search": search, "chunk": c, "seconds": round(dt, 2), "rel_err_weighted": r.history[-1] ** 0.5,
                    "profiled": i == len(runs) - 1, "peak_gb": torch.cuda.max_memory_allocated() / 1e9})
        print(json.dumps(res[-1]), flush=True)
    same = [float((codes[0] == codes[i]).all(-1).float().mean()) for i in range(1, len(runs))]
    (out / "profile_cuda.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    (out / "profile_cpu.txt").write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    (out / "quantizer_profile.json").write_text(json.dumps({"shape": a.shape, "runs": res, "codes_equal_fraction": same}, indent=1))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    print("| search | chunk | seconds (profiled run slower) | weighted rel. error |\n|---|---|---|---|")
    for r in res:
        print(f"| {r['search']} | {r['chunk']} | {r['seconds']}{' (profiled)' if r['profiled'] else ''} "
              f"| {r['rel_err_weighted']:.5f} |")
    print(f"fraction of code groups equal to the first run's: {same}")


if __name__ == "__main__":
    main()
