"""Session 16: bench_cpu's step GEMV pass with Python between the calls (each FusedGemv.run from Python, as before
session 16) against one C call over the same list (host_ops.GemvPass, as bench_cpu times it now), 5 alternated
rounds in one process, best of 5 passes each; GB/s over the step's bytes.

    PYTHONPATH=. python3 scripts/dev/s16_pass_ab.py MODEL.cbk
"""
import sys
import time

import torch

import trapetum
from trapetum.eval import bench_cpu as bc
from trapetum.kernels.host_ops import GemvPass


def main() -> None:
    m = trapetum.load(sys.argv[1])
    bc.decode_rate(m, m.encode(bc.PROMPT), 2)
    steps = bc.step_gemvs(m.decoder)
    nb = sum(b for _, b in steps)
    args = [(f, torch.randn(1, f.in_features), torch.empty(1, f.out_features)) for f, _ in steps]
    for th in (1, 2):
        one = GemvPass(args, th)
        res = {"python": [], "one C call": []}
        for _ in range(5):
            for kind in res:
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    if kind == "python":
                        for f, x, y in args:
                            f.run(x, y, None, th)
                    else:
                        one.run()
                    best = min(best, time.perf_counter() - t0)
                res[kind].append(nb / best / 1e9)
        print(f"threads {th}: " + " | ".join(f"{k} " + " ".join(f"{v:.1f}" for v in vs) for k, vs in res.items()))


if __name__ == "__main__":
    main()
