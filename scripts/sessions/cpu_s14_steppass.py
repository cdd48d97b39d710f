"""Session 14: the step's GEMV pass alone at one thread (bench_cpu's step_gemv_bandwidth, N passes, each the best
of 5), then the best of 5 passes per call kind (fused q/k/v, o, fused gate/up with its activation, down, the head)
with its GB/s.

    PYTHONPATH=TREE python scripts/sessions/cpu_s14_steppass.py MODEL.cbk N
"""
import collections
import sys
import time

import torch

import trapetum
from trapetum.eval import bench_cpu as bc
from trapetum.kernels import host_gemv as hg

KINDS = ("qkv", "o", "gu", "down")


def main() -> None:
    m = trapetum.load(sys.argv[1])
    bc.decode_rate(m, m.encode(bc.PROMPT), 4)
    steps = bc.step_gemvs(m.decoder)
    torch.set_num_threads(1)
    passes = [bc.step_gemv_bandwidth(steps, 1) for _ in range(int(sys.argv[2]))]
    args = [(f, torch.randn(1, f.in_features), torch.empty(1, f.out_features), b) for f, b in steps]
    kind = ["head" if i == len(args) - 1 else KINDS[i % 4] for i in range(len(args))]
    best, nbytes = collections.defaultdict(lambda: 1e9), collections.defaultdict(int)
    for i, (_, _, _, b) in enumerate(args):
        nbytes[kind[i]] += b
    for _ in range(5):
        per = collections.defaultdict(float)
        for i, (f, x, y, _) in enumerate(args):
            t0 = time.perf_counter()
            f.run(x, y, None, 1)
            per[kind[i]] += time.perf_counter() - t0
        for k, v in per.items():
            best[k] = min(best[k], v)
    print(hg.best_path(), "step GB/s", " ".join(f"{v:.1f}" for v in passes), "|",
          " ".join(f"{k}:{best[k] * 1e3:.1f}ms {nbytes[k] / best[k] / 1e9:.1f}GB/s" for k in (*KINDS, "head")))


if __name__ == "__main__":
    main()
