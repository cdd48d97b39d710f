"""Which kernels make 2x8 decode differ with programmatic dependent launch? (session 4 diagnostic)

Builds the tiny llama3 model with random 2x8 projections (as tests/test_engine_gpu.py's PDL test), decodes
6 graph steps per TRAPETUM_PDL mode (two fresh engines per mode) and prints which modes agree bitwise.
    python scripts/sessions/pdl_diag.py
"""
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import trapetum  # noqa: E402
from tests.tiny_models import build, randomize_additive  # noqa: E402
from trapetum.runtime.engine import GpuEngine  # noqa: E402

tmp = Path(tempfile.mkdtemp())
build("llama3", tmp / "src")
ids = list(range(5, 21))


def run(mode, fmt="aqlm-2x8"):
    os.environ["TRAPETUM_PDL"] = mode
    eng = GpuEngine(randomize_additive(trapetum.load(tmp / "src", device="cuda").decoder, fmt), 64)
    out = [eng.prefill(ids).clone()]
    for i in range(6):
        eng.set_position(len(ids) + i, len(ids) + i)
        eng.step(greedy=False)
        out.append(eng.logits.clone())
    torch.cuda.synchronize()
    return torch.stack(out)


res = {m: [run(m), run(m)] for m in ("0", "1", "cuda", "triton")}
base = res["0"][0]
for m, (a, b) in res.items():
    same_run = torch.equal(a, b)
    vs_off = [bool(torch.equal(a[i], base[i])) for i in range(a.shape[0])]
    err = float((a - base).abs().max())
    print(f"TRAPETUM_PDL={m}: run-to-run equal {same_run}; equal to PDL=0 per step {vs_off}; max abs diff {err:.3g}")
