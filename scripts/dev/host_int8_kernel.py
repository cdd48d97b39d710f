"""Session 20 (issue 18): the host 4-bit codebook GEMV alone, fp32 against int8 numerics (``host_gemv.int8_tables``),
warm and cache-resident: random codes, one row, one thread, best of 5 x REPS calls, per host path, at SmolLM2's and
Qwen2.5-0.5B's projection shapes (out x in). Prints microseconds, GB/s of codes and the int8 speed-up.

    python3 scripts/dev/host_int8_kernel.py [REPS] [PATHS, default avx2,avx512vbmi]
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trapetum.kernels import host_gemv as hg
from trapetum.kernels.pack import pack_codes

SHAPES = [(1536, 576), (576, 1536), (4864, 896), (896, 4864)]


def best_of(f, reps):
    f()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    paths = (sys.argv[2] if len(sys.argv) > 2 else "avx2,avx512vbmi").split(",")
    for n, k in SHAPES:
        idx = torch.randint(0, 16, (n, k))
        cb = torch.randn(n, 16).half()
        x = torch.randn(1, k)
        codes, t8, out = pack_codes(idx, 4), hg.int8_tables(cb, 4), torch.empty(1, n)
        row = []
        for p in paths:
            a = best_of(lambda: hg.codebook_gemv_host(x, codes, cb, 4, k, threads=1, path=p, out=out), reps)
            b = best_of(lambda: hg.codebook_gemv_host(x, codes, t8, 4, k, threads=1, path=p, out=out), reps)
            row.append(f"{p}: fp32 {a * 1e6:.1f} us ({codes.numel() / a / 1e9:.1f} GB/s) int8 {b * 1e6:.1f} us "
                       f"({codes.numel() / b / 1e9:.1f} GB/s) {a / b:.2f}x")
        print(n, k, " | ".join(row))


if __name__ == "__main__":
    main()
