"""The engine's absorbed latent attention (Options.mla = "latent", runtime/engine_latent.py) on DeepSeek-V2 (no
q_lora) and V3 (q_lora, YaRN): the latent cache's shape, against the fp32 reference (prefill, decode steps, verify
rows, 16 greedy tokens) and verify rows bitwise equal to decode steps, on the CPU with the kernels' torch fallbacks
and (slow) with the Triton kernels interpreted. The GPU: tests/test_moe_engine_gpu.py."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trapetum
from tests.test_moe_engine import assert_engine_matches
from tests.tiny_models import build
from trapetum.eval.verify_exact import check
from trapetum.runtime.engine import GpuEngine
from trapetum.settings import Options

REPO = Path(__file__).resolve().parents[1]
LATENT = Options(mla="latent")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for fam in ("deepseek_v2", "deepseek_v3"):
        d = tmp_path_factory.mktemp(fam)
        build(fam, d)
        out[fam] = trapetum.load(d)
    return out


@pytest.mark.usefixtures("torch_fallbacks")
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_latent_engine_matches_reference_and_verify_contract(models, family):
    m = models[family]
    cfg = m.config
    eng = GpuEngine(m.checkpoint, 48, device="cpu", options=LATENT)
    assert eng.kv.k.shape == (cfg.num_layers, 1, 48, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert eng.kv.v.numel() == 0 and eng.kv.nbytes() == eng.kv.k.numel() * 2
    assert_engine_matches(m, eng)
    res = check(eng, rows=(1, 3, 16), bases=(6, 21))
    assert res and all(r["ok"] for r in res), [r for r in res if not r["ok"]]


def test_bad_mla_option_is_a_config_error():
    from trapetum.errors import ConfigError
    with pytest.raises(ConfigError, match="options.mla"):
        Options(mla="absorbed")


@pytest.mark.slow  # every engine kernel interpreted
def test_latent_engine_under_triton_interpreter(tmp_path):
    pytest.importorskip("triton")
    code = f"""
import torch, trapetum
from tests.tiny_models import build
from trapetum.eval.verify_exact import check
from trapetum.runtime.engine import GpuEngine
from trapetum.settings import Options
build("deepseek_v3", {str(tmp_path)!r})
m = trapetum.load({str(tmp_path)!r})
ids = list(range(5, 17))
eng = GpuEngine(m.checkpoint, 24, device="cpu", options=Options(mla="latent"))
assert eng.latent_ws is not None
ref = m.logits(ids)
eng.prefill(ids[:-2])
for i, t in enumerate(ids[-2:]):
    eng.set_position(t, 10 + i)
    eng.step(greedy=False)
    e = float((eng.logits - ref[10 + i]).norm() / ref[10 + i].norm())
    assert e < 2e-3, e
res = check(eng, rows=(1, 3), bases=(6,))
assert all(r["ok"] for r in res), [r for r in res if not r["ok"]]
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
