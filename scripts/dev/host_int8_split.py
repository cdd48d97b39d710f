"""Session 20 (issue 18): a decode step's host GEMV pass split into the 4-bit layer GEMVs and the 8-bit head, fp32
against int8 host numerics (``Options.host_numerics``), one thread on one host path: best of 7 passes, the four
(numerics, part) passes alternated 3 times. Prints ms and GB/s per repeat.

    python3 scripts/dev/host_int8_split.py MODEL.cbk avx2|avx512vbmi|...
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import trapetum
from trapetum.eval.bench_cpu import PROMPT, step_gemvs
from trapetum.kernels import host_gemv as hg
from trapetum.kernels.host_ops import GemvPass
from trapetum.settings import Options


def main():
    model, path = sys.argv[1], sys.argv[2]
    hg.limit_path(path)
    torch.set_num_threads(1)
    passes = {}
    for num in ("fp32", "int8"):
        m = trapetum.load(model, options=Options(host_numerics=num))
        m.generate(m.encode(PROMPT), max_new_tokens=2, ignore_eos=True)
        calls = step_gemvs(m.decoder)
        for kind, cs in (("layers", calls[:-1]), ("head", calls[-1:])):
            work = [(f, torch.randn(1, f.in_features), torch.empty(1, f.out_features)) for f, _ in cs]
            passes[(num, kind)] = (GemvPass(work, 1).run, sum(b for _, b in cs))
    res = {}
    for _ in range(3):
        for key, (run, nbytes) in passes.items():
            run()
            best = 1e9
            for _ in range(7):
                t0 = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - t0)
            res.setdefault(key, []).append((best * 1e3, nbytes / best / 1e9))
    for (num, kind), v in res.items():
        print(f"{path} {num} {kind}: ms {[round(a, 2) for a, _ in v]} GB/s {[round(b, 1) for _, b in v]}")


if __name__ == "__main__":
    main()
