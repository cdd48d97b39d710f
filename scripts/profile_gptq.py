"""Where ``quantize --gptq`` spends its time on one projection: ``gptq_refine`` (2 rounds) on a random W [R, C]
with the bench's random Hessian (diag(E[x^2]) + a rank-C/8 part, ``eval/bench_quantize.RandomHessians``), from the
E[x^2]-weighted k-means start; wall time of the assignment passes, the refits and the objectives, for each sweep
implementation asked for, and whether their books, codes and objectives are equal bit for bit.

    python scripts/profile_gptq.py --shape 4096x11008 --device cuda --sweeps torch,triton
    python scripts/profile_gptq.py --shape 1024x1024 --device cpu --threads 1 --sweeps torch [--profile]

``--module PATH`` loads another copy of ``trapetum/quant/gptq.py`` (e.g. an older commit's, written out with
``git show REV:trapetum/quant/gptq.py > /tmp/gptq_old.py``) and times it too, as "module"."""
from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch

from trapetum.quant import gptq
from trapetum.quant.codebook_fit import project_centroids
from trapetum.quant.kmeans import kmeans_rows


def timed_refine(mod, W, H, book, codes, stored, sweep, sync):
    T = {}
    saved = {n: getattr(mod, n) for n in ("gptq_assign", "refit_codebooks", "hessian_objective", "inverse_cholesky")
             if hasattr(mod, n)}

    def wrap(n, f):
        def g(*a, **k):
            sync()
            t = time.perf_counter()
            r = f(*a, **k)
            sync()
            T[n] = T.get(n, 0.0) + time.perf_counter() - t
            return r
        return g
    for n, f in saved.items():
        setattr(mod, n, wrap(n, f))
    try:
        kw = {"sweep_impl": sweep} if sweep != "module" else {}
        sync()
        t = time.perf_counter()
        out = mod.gptq_refine(W, H, book, codes, lambda c: project_centroids(c, "f16"), stored, rounds=2, **kw)
        sync()
        T["total"] = time.perf_counter() - t
    finally:
        for n, f in saved.items():
            setattr(mod, n, f)
    T["rest"] = T["total"] - sum(v for k, v in T.items() if k != "total")  # codes' round trips, sorting, project
    return out, {k: round(v, 3) for k, v in T.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1024x1024", help="R x C (out x in)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sweeps", default="auto", help="comma-separated: torch, triton, auto")
    p.add_argument("--module", default=None, help="another gptq.py to time as well")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--profile", action="store_true", help="torch.profiler table of the last run")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    R, C = (int(s) for s in a.shape.split("x"))
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    W = (torch.randn(R, C, generator=g) * 0.02).to(dev)
    d = torch.rand(C, generator=g) + 0.01
    A = torch.randn(C, max(1, C // 8), generator=g) / C ** 0.5
    H = (torch.diag(d) + A @ A.T).to(dev)
    res = kmeans_rows(W, 16, d.to(dev))
    book, stored = project_centroids(res.codebook.cpu(), "f16")
    codes = res.codes.cpu()
    runs = [("branch", gptq, s) for s in a.sweeps.split(",")]
    if a.module:
        # a submodule of trapetum.quant, so that its relative imports (..kernels) resolve
        spec = importlib.util.spec_from_file_location("trapetum.quant.gptq_other", a.module)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        runs.insert(0, ("module", other, "module"))
    w = min(R, 64)  # warm-up (compiles the kernel): 64 rows, Triton's specialization of R % 16 == 0 as 4096
    timed_refine(gptq, W[:w], H, book[:w], codes[:w], {k: v[:w] for k, v in stored.items()},
                 runs[-1][2] if runs[-1][2] != "module" else "auto", sync)
    outs = []
    for i, (name, mod, sweep) in enumerate(runs):
        if a.profile and i == len(runs) - 1:
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with torch.profiler.profile(activities=acts) as prof:
                out, T = timed_refine(mod, W, H, book, codes, stored, sweep, sync)
            print(prof.key_averages().table(sort_by="self_cuda_time_total" if dev.type == "cuda"
                                            else "self_cpu_time_total", row_limit=14))
        else:
            out, T = timed_refine(mod, W, H, book, codes, stored, sweep, sync)
        outs.append(out)
        print(json.dumps({"code": name, "sweep": sweep, "shape": [R, C], "device": str(dev), "seconds": T,
                          "hessian_gain": out[3]["objective"] / out[3]["objective_start"]}), flush=True)
    same = [bool(torch.equal(outs[0][0], o[0]) and torch.equal(outs[0][1], o[1]) and outs[0][3] == o[3])
            for o in outs[1:]]
    print(json.dumps({"equal_to_first_run": same}))


if __name__ == "__main__":
    main()
