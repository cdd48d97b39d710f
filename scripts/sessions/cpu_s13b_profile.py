"""Session 13, second part (issue 18): where a CPU decode step spends its time: CpuOps methods and the host
GEMV calls (FusedGemv.run) wrapped with perf_counter, 64 greedy tokens, best of 3 (the 06:43 / 06:47 UTC profiles
of NOTES-engine.md; "project" includes the head's call through "logits").

    python scripts/sessions/cpu_s13b_profile.py MODEL.cbk THREADS
"""
import collections
import sys
import time

import torch

import trapetum
from trapetum.kernels import host_ops as ho
from trapetum.models import cpu_ops

model_path, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
m = trapetum.load(model_path)
ids = m.encode("The history of the printing press begins")
acc, cnt = collections.defaultdict(float), collections.defaultdict(int)


def wrap(owner, name, key):
    f = getattr(owner, name)

    def g(*a, **k):
        t0 = time.perf_counter()
        r = f(*a, **k)
        acc[key] += time.perf_counter() - t0
        cnt[key] += 1
        return r
    setattr(owner, name, g)


for n in ("norm", "project", "gate_up", "attend", "embed", "logits", "heads", "add", "split"):
    wrap(cpu_ops.CpuOps, n, n)
wrap(ho.FusedGemv, "run", "C gemv")
m.generate(ids, max_new_tokens=4, ignore_eos=True)
best = None
for _ in range(3):
    acc.clear()
    cnt.clear()
    c = m.generate(ids, max_new_tokens=64, ignore_eos=True)
    if best is None or c.tokens_per_s > best[0]:
        best = (c.tokens_per_s, dict(acc), dict(cnt))
tps, a, n = best
print(f"{model_path} t={threads}: {tps:.1f} tok/s ({1e3 / tps:.2f} ms/token)")
for k in sorted(a, key=lambda k: -a[k]):
    print(f"  {k:8s} {a[k] * 1e3 / 64:7.3f} ms/token  {n[k] / 64:6.1f} calls/token  {a[k] / n[k] * 1e6:7.1f} us/call")
