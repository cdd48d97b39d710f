"""Where the 2x8 additive quantizer spends its time on the GPU: one Llama-2-7B gate-shaped projection
(11008 x 4096, random weights and importance) quantized with the default recipe at several beam-search
chunk sizes; wall time of each, whether the codes agree bit for bit, and a torch.profiler table (top ops
by CUDA and by CPU time) of the last one. Usage: python scripts/profile_quantizer.py --out DIR [--chunks 8192,131072]"""
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
    p.add_argument("--chunks", default="8192,131072")
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
    chunks = [int(c) for c in a.chunks.split(",")]
    for i, c in enumerate(chunks):
        torch.cuda.synchronize()
        t = time.perf_counter()
        if i == len(chunks) - 1:
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                r = quantize_additive(W, imp, device="cuda", chunk=c)
                torch.cuda.synchronize()
        else:
            r = quantize_additive(W, imp, device="cuda", chunk=c)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        codes[c] = r.codes
        res.append({"chunk": c, "seconds": round(dt, 2), "rel_err_weighted": r.history[-1] ** 0.5,
                    "profiled": i == len(chunks) - 1, "peak_gb": torch.cuda.max_memory_allocated() / 1e9})
        print(json.dumps(res[-1]), flush=True)
    same = all(torch.equal(codes[chunks[0]], codes[c]) for c in chunks[1:])
    (out / "profile_cuda.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    (out / "profile_cpu.txt").write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    (out / "quantizer_profile.json").write_text(json.dumps({"shape": a.shape, "runs": res, "codes_equal": same}, indent=1))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    print(f"| chunk | seconds (profiled run slower) |\n|---|---|")
    for r in res:
        print(f"| {r['chunk']} | {r['seconds']}{' (profiled)' if r['profiled'] else ''} |")
    print(f"codes equal across chunk sizes: {same}")


if __name__ == "__main__":
    main()
