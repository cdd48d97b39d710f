"""Session 13 (issue 18): resident memory of a CPU decode: ``trapetum.load(MODEL)``, 16 greedy tokens at one thread,
then /proc/self/status's VmHWM / VmRSS and the tokens (run from each tree's root with PYTHONPATH at it).

    python scripts/sessions/cpu_s13_rss.py MODEL.cbk
"""
import sys
import time

import torch

import trapetum

t0 = time.time()
m = trapetum.load(sys.argv[1])
ids = m.encode("The history of the printing press begins")
torch.set_num_threads(1)
out = m.generate(ids, max_new_tokens=16, ignore_eos=True)
print(trapetum.__file__, "load+generate", round(time.time() - t0, 1), "s", out.tokens_per_s, "tok/s")
print(list(out.token_ids))
for line in open("/proc/self/status"):
    if line.startswith(("VmRSS", "VmHWM")):
        print(" ", line.strip())
