"""Session 16: bench_cpu's step GEMV pass with Python between the calls (each FusedGemv.run from Python, as before
session 16) against one C call over the same list (host_ops.GemvPass, as bench_cpu times it now), 5 alternated
rounds in one process, best of 5 passes each; GB/s over the step's bytes. Also the Python cost alone: the same
calls from Python at M = 0 rows (they return before any work), and a 64-token decode at one thread with the time
in ``CpuOps.dense_layer`` (the per-layer Python and its C call) against ``DenseLayer.__call__`` (the C call).

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
    empty = [(f, torch.randn(0, f.in_features), torch.empty(0, f.out_features)) for f, _ in steps]
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for f, x, y in empty:
            f.run(x, y, None, 1)
        best = min(best, time.perf_counter() - t0)
    print(f"M = 0 rows from Python: {best * 1e3:.3f} ms a pass of {len(empty)} calls ({best / len(empty) * 1e6:.2f} us a call)")
    layer_python(m)


def layer_python(m) -> None:
    """ms a token in CpuOps.dense_layer and in DenseLayer.__call__ over a 64-token decode at one thread."""
    from trapetum.kernels import host_ops as ho
    from trapetum.models import cpu_ops

    spent = {"CpuOps.dense_layer": 0.0, "DenseLayer.__call__": 0.0}

    def timed(name, fn):
        def run(*a):
            t0 = time.perf_counter()
            r = fn(*a)
            spent[name] += time.perf_counter() - t0
            return r
        return run

    old = cpu_ops.CpuOps.dense_layer, ho.DenseLayer.__call__
    cpu_ops.CpuOps.dense_layer = timed("CpuOps.dense_layer", old[0])
    ho.DenseLayer.__call__ = timed("DenseLayer.__call__", old[1])
    try:
        torch.set_num_threads(1)
        m.generate(m.encode(bc.PROMPT), max_new_tokens=64, ignore_eos=True)
    finally:
        cpu_ops.CpuOps.dense_layer, ho.DenseLayer.__call__ = old
    layers = m.decoder.config.num_layers
    extra = (spent["CpuOps.dense_layer"] - spent["DenseLayer.__call__"]) / 64
    print(" ".join(f"{k} {v / 64 * 1e3:.3f} ms a token;" for k, v in spent.items()),
          f"Python around the C call: {extra * 1e3:.3f} ms a token ({extra / layers * 1e6:.1f} us a layer)")


if __name__ == "__main__":
    main()
