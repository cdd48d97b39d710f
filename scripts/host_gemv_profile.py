"""Where the host GEMV pass of a .cbk spends its time: bench_cpu's pass (every 4/8-bit projection once, model order,
M = 1) with each call timed inside the pass (cold caches, as a decode step meets them), summed per kind (q/k/v/o,
gate/up/down, the head); then the kernel alone on a cache-resident matrix of each bit width (compute bound: no
DRAM traffic), through the C entry point (no Python checks), per code path this CPU runs.

    python scripts/host_gemv_profile.py MODEL.cbk [--threads 1,2] [--passes 5]

Prints, per thread count, the best pass's total and each kind's ms and GB/s (``HostGemv.nbytes``: codes and tables
as read), and the warm kernel's GB/s of codes.
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

import trapetum
from trapetum.kernels import host_gemv as hg
from trapetum.settings import Options


def kind(name: str) -> str:
    return "head" if name == "lm_head" else name.split(".")[-1]


def pass_profile(gemvs, threads: int, passes: int):
    xs = [torch.randn(1, g.in_features) for _, g in gemvs]
    best = None
    for _ in range(passes):
        per = collections.defaultdict(float)
        t00 = time.perf_counter()
        for (n, g), x in zip(gemvs, xs):
            t0 = time.perf_counter()
            g(x, threads)
            per[kind(n)] += time.perf_counter() - t0
        total = time.perf_counter() - t00
        if best is None or total < best[0]:
            best = (total, dict(per))
    return best


def warm_kernel(bits: int, N: int, K: int, path: str, reps: int = 200) -> float:
    """GB/s of codes of one L2-resident N x K matrix, M = 1, one thread, best of 5 x ``reps`` calls."""
    lib = hg.library()
    codes = torch.randint(0, 256, (N, K * bits // 8), dtype=torch.uint8)
    cb = torch.randn(N, 1 << bits).to(torch.float16)
    x, y = torch.randn(1, K), torch.empty(1, N)
    p, best = hg.PATHS.index(path), float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            lib.tp_codebook_gemv(x.data_ptr(), K, 1, K, codes.data_ptr(), codes.stride(0), cb.data_ptr(), None, 0,
                                 N, bits, y.data_ptr(), N, 1, p)
        best = min(best, (time.perf_counter() - t0) / reps)
    return codes.numel() / best / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--passes", type=int, default=5)
    a = ap.parse_args(argv)
    m = trapetum.load(a.model, options=Options(cpu_step=False))
    gemvs = [(n, mod.host) for n, mod in m.decoder.named_modules() if getattr(mod, "host", None) is not None]
    nbytes = collections.defaultdict(int)
    for n, g in gemvs:
        nbytes[kind(n)] += g.nbytes
    print(f"{a.model}: {len(gemvs)} host GEMVs, {sum(nbytes.values()) / 1e6:.1f} MB a pass, path {hg.best_path()}")
    for t in (int(s) for s in a.threads.split(",")):
        total, per = pass_profile(gemvs, t, a.passes)
        print(f"threads {t}: pass {total * 1e3:.1f} ms, {sum(nbytes.values()) / total / 1e9:.2f} GB/s; " + ", ".join(
            f"{k} {v * 1e3:.1f} ms {nbytes[k] / v / 1e9:.1f} GB/s" for k, v in per.items()))
    paths = hg.PATHS[: hg.PATHS.index(hg.best_path()) + 1]
    for bits, N, K in ((4, 1536, 896), (8, 1024, 896)):
        print(f"warm {bits}-bit {N}x{K}: " + ", ".join(f"{p} {warm_kernel(bits, N, K, p):.1f} GB/s"
                                                      for p in paths if p != "c"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
