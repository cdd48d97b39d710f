"""Session 13 (issue 18): prefetch variants of the host GEMV. Builds codebook_host.c + host_pool.c with each
argument's -D flags into /tmp and runs the Qwen model's GEMVs in model order (cold) through tp_codebook_gemv, M = 1,
one thread: the layers' and the head's time, best of 4 (the session ran it with a PF_HINT macro on the codes'
prefetch, since removed; the "-DPF=..." variants need none).

    python scripts/sessions/cpu_s13_prefetch.py "" "-DPF=0" "-DPF=8192"
"""
import ctypes
import subprocess
import sys
import time

import torch

import trapetum
from trapetum.kernels import host_gemv as hg
from trapetum.settings import Options
m = trapetum.load("/tmp/s10b/qwen-e8.cbk", options=Options(cpu_step=False))
gs = [(n, mod.host) for n, mod in m.decoder.named_modules() if getattr(mod, "host", None) is not None]
src = [str(p) for p in hg.SOURCES[:2]]
def build(defs):
    out = f"/tmp/s18pf_{abs(hash(defs))}.so"
    subprocess.run(["gcc", *hg.FLAGS, *defs, "-o", out, *src, "-lm"], check=True)
    lib = ctypes.CDLL(out)
    L, P, I = ctypes.c_long, ctypes.c_void_p, ctypes.c_int
    lib.tp_codebook_gemv.argtypes = [P, L, L, L, P, L, P, P, L, L, I, P, L, I, I]
    return lib
xs = [torch.randn(1, g.in_features) for _, g in gs]
ys = [torch.empty(1, g.out_features) for _, g in gs]
variants = [a.split() for a in sys.argv[1:]]
libs = [build(tuple(v)) for v in variants]
res = {i: [1e9, 1e9] for i in range(len(libs))}
for r in range(4):
    for i, lib in enumerate(libs):
        for part, sel in ((0, lambda n: n != "lm_head"), (1, lambda n: n == "lm_head")):
            t0 = time.perf_counter()
            for (n, g), x, y in zip(gs, xs, ys):
                if sel(n):
                    c, ldc, cb, sc, G, N, bits = g._args
                    lib.tp_codebook_gemv(x.data_ptr(), x.stride(0), 1, g.in_features, c, ldc, cb, sc, G, N, bits,
                                         y.data_ptr(), N, 1, -1)
            res[i][part] = min(res[i][part], time.perf_counter() - t0)
for i, v in enumerate(variants):
    print(" ".join(v) or "(default)", f"layers {res[i][0]*1e3:.1f} ms, head {res[i][1]*1e3:.1f} ms")
