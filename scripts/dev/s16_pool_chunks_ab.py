"""Session 16: the thread pool's chunks a thread, A / B in one process. Builds the host library once per count
(copies of trapetum/kernels/host/ with host_pool.c's `long chunk = ...` line set to COUNT chunks a thread; each
variant its own library and pool), then times the CPU step's GEMV pass at 2 threads (the layers' calls, then the
head) through each, rotating the order every round, 20 ms apart so the other pools' workers are asleep; prints
each count's median GB/s and its ratio to the last count's, per round.

    PYTHONPATH=. python3 scripts/dev/s16_pool_chunks_ab.py MODEL.cbk 1,2,4,8 [ROUNDS]
"""
import ctypes
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import trapetum
from trapetum.eval import bench_cpu as bc
from trapetum.kernels import host_gemv as hg
from trapetum.kernels.host_ops import GemvPass

HOST = Path(hg.__file__).resolve().parent / "host"
LINE = re.compile(r"long chunk = \(N \+ \d+L \* nt - 1\) / \(\d+L \* nt\);")


def variant(count: int, tmp: Path) -> ctypes.CDLL:
    d = tmp / f"h{count}"
    shutil.copytree(HOST, d)
    src = (d / "host_pool.c").read_text()
    new, n = LINE.subn(f"long chunk = (N + {count}L * nt - 1) / ({count}L * nt);", src)
    if n != 1:
        raise SystemExit("host_pool.c: the chunk line was not found")
    (d / "host_pool.c").write_text(new)
    lib = hg.compile_library(f"codebook_host_c{count}", [d / p.name for p in hg.SOURCES], ("-lm",))
    lib.tp_gemv_multi_list.restype = ctypes.c_int
    lib.tp_gemv_multi_list.argtypes = [ctypes.c_void_p, ctypes.c_long]
    return lib


def main() -> None:
    counts = [int(c) for c in sys.argv[2].split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    m = trapetum.load(sys.argv[1])
    bc.decode_rate(m, m.encode(bc.PROMPT), 2)
    steps = bc.step_gemvs(m.decoder)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {c: variant(c, Path(tmp)) for c in counts}
        for name, part in (("layers", steps[:-1]), ("head", steps[-1:])):
            args = [(f, torch.randn(1, f.in_features), torch.empty(1, f.out_features)) for f, _ in part]
            nb = sum(b for _, b in part)
            calls = GemvPass(args, 2)._calls
            res = {c: [] for c in counts}
            for r in range(rounds):
                order = counts[r % len(counts):] + counts[:r % len(counts)]
                for c in order:
                    time.sleep(0.02)
                    libs[c].tp_gemv_multi_list(calls, len(args))
                    best = float("inf")
                    for _ in range(5):
                        t0 = time.perf_counter()
                        libs[c].tp_gemv_multi_list(calls, len(args))
                        best = min(best, time.perf_counter() - t0)
                    res[c].append(nb / best / 1e9)
            base = res[counts[-1]]
            for c in counts:
                ratio = [a / b for a, b in zip(res[c], base)]
                print(f"{name}: {c} chunks a thread: median {statistics.median(res[c]):.1f} GB/s, ratio to "
                      f"{counts[-1]} median {statistics.median(ratio):.3f}, above 1 in {sum(x > 1 for x in ratio)}"
                      f"/{rounds} rounds")


if __name__ == "__main__":
    main()
