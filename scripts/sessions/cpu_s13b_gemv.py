"""Session 13, second part (issue 18): the CPU step executor's own fused GEMVs (q/k/v, o, gate/up with its
activation, down, head) in a loop through FusedGemv.run, per kind, at 1 and 2 threads, best of 7 passes
(NOTES-engine.md; GB/s over the codes only).

    python scripts/sessions/cpu_s13b_gemv.py MODEL.cbk
"""
import collections
import sys
import time

import torch

import trapetum

m = trapetum.load(sys.argv[1])
d = m.decoder
step = d.cpu_step
m.generate(m.encode("hello there"), max_new_tokens=2, ignore_eos=True)  # builds the plan
calls = []
for layer in step._plan.layers:
    for kind, p in layer.blocks:
        if kind == "attention":
            calls += [("qkv", step.fused(p.qkv)), ("o", step.fused(p.o))]
        else:
            calls += [("gate_up", step.fused(p.gate_up, d.config.hidden_act)), ("down", step.fused(p.down))]
calls.append(("head", step.fused(step._plan.head)))
xs = [(k, f, torch.randn(1, f.in_features), torch.empty(1, f.out_features)) for k, f in calls]
nb, nc = collections.defaultdict(int), collections.Counter(k for k, _ in calls)
for k, f, _, _ in xs:
    nb[k] += sum(c.numel() for c, _, _ in f.parts)
for t in (1, 2):
    best = None
    for _ in range(7):
        per = collections.defaultdict(float)
        T0 = time.perf_counter()
        for k, f, x, y in xs:
            t0 = time.perf_counter()
            f.run(x, y, None, t)
            per[k] += time.perf_counter() - t0
        T = time.perf_counter() - T0
        if best is None or T < best[0]:
            best = (T, per)
    T, per = best
    print(f"t={t}: pass {T * 1e3:.2f} ms; " + ", ".join(
        f"{k} {v * 1e3:.2f} ms ({v * 1e6 / nc[k]:.1f} us/call, {nb[k] / v / 1e9:.1f} GB/s codes)" for k, v in per.items()))
