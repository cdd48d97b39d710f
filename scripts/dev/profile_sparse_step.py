"""Where a sparse decode step's time goes (issue 19): one Llama-shape 4-bit engine of random weights, thresholds
recorded from its own prompt pass at sparsity S (as `bench_sparse --e2e`), then the eager step under torch.profiler
(GPU time per kernel name) and the graph-replayed step's wall, dense and sparse.

    python scripts/dev/profile_sparse_step.py [--shape llama2-7b] [--sparsity 0.5] [--kernel compact] [--reps 3]

An experiment tool: BENCHMARKS.md figures come from `trapetum bench sparse --e2e`.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profile_engine import kernel_times, table  # noqa: E402

from trapetum.eval.bench_e2e import _cuda_time  # noqa: E402
from trapetum.eval.bench_sparse import _recorded_thresholds  # noqa: E402
from trapetum.eval.random_model import random_checkpoint  # noqa: E402
from trapetum.models.sparsity import SITES, SiteThresholds, SparsityTable  # noqa: E402
from trapetum.runtime.engine import GpuEngine  # noqa: E402
from trapetum.settings import SPARSE_KERNELS, Options  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--kernel", default="compact", choices=SPARSE_KERNELS,
                   help="KernelOptions.sparse_kernel (default compact: the kernel session 12 profiled; the engine's "
                        "default is mma)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--base", type=int, default=64)
    a = p.parse_args(argv)
    ckpt = random_checkpoint(a.shape, "cb4")
    for graph in (True, False):
        eng = GpuEngine(ckpt, 1024, device="cuda",
                        options=Options(graph=graph).replace(kernels={"sparse_kernel": a.kernel}))
        L = eng.cfg.num_layers
        tags = {(4 * i + j + 1) * 1e-30: (i, site) for i in range(L) for j, site in enumerate(SITES)}
        by_layer = [{site: t for t, (i, site) in tags.items() if i == layer} for layer in range(L)]
        eng.set_sparsity(SparsityTable(tuple(SiteThresholds(**d) for d in by_layer)))
        found: dict = {}
        ids = torch.randint(3, eng.cfg.vocab_size, (256,), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(0))
        with _recorded_thresholds([a.sparsity], tags, found):
            eng.prefill(ids)
        sparse = SparsityTable(tuple(SiteThresholds(**{s: found[(a.sparsity, i, s)] for s in SITES})
                                     for i in range(L)), {s: a.sparsity for s in SITES}, {"source": "random"})

        def fn(eng=eng):
            eng.set_position(1, a.base)
            eng.step(True)
        for name, tab in (("dense", None), (f"S={a.sparsity}", sparse)):
            eng.set_sparsity(tab)
            fn()
            if graph:
                wall = sorted(_cuda_time(fn, 20) for _ in range(5))[2]
                print(f"-- {a.shape} {name}: graph wall {wall * 1e6:.0f} us", flush=True)
            else:
                print(table(f"{a.shape} {name} eager", kernel_times(fn, a.reps), float("nan"), top=16), flush=True)
        del eng
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
