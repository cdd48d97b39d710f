"""The VERIFY contract on the CPU: M rows in one forward give bitwise the logits and KV-cache rows of M decode
steps, and the decode step after them continues identically.

Three executors: the torch reference decoder (TorchOps, rows one by one), the engine on its kernels' torch
fallbacks, and the engine's real Triton kernels under the interpreter (subprocess, small shapes). The GPU checks at
real shapes are tests/test_verify_gpu.py (trapetum.eval.verify_exact).
"""
import os
import subprocess
import sys

import pytest
import torch

import trapetum
from tests.tiny_models import build, build_cbk
from trapetum.eval.verify_exact import check
from trapetum.models.batch import Mode
from trapetum.runtime.engine import GpuEngine
from trapetum.errors import ConfigError
from trapetum.settings import Options

REPO = os.path.dirname(os.path.dirname(__file__))


pytestmark = pytest.mark.usefixtures("torch_fallbacks")  # tests/conftest.py


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for fam in ("llama3", "gemma2", "mistral"):
        d = tmp_path_factory.mktemp(fam)
        build(fam, d)
        out[fam] = trapetum.load(d)
    return out


@pytest.mark.parametrize("family", ["llama3", "gemma2", "mistral"])
def test_reference_verify_rows_equal_decode_steps(models, family):
    """TorchOps in VERIFY mode: row r of a multi-row forward is bitwise the one-token forward at start + r."""
    dec = models[family].decoder
    g = torch.Generator().manual_seed(1)
    for base, m in ((6, 1), (6, 4), (11, 8), (3, 16)):
        prompt = torch.randint(3, 300, (1, base), generator=g)
        rows = torch.randint(3, 300, (1, m), generator=g)
        c1, c2 = dec.new_cache(1, 64), dec.new_cache(1, 64)
        dec(prompt, c1, 0)
        dec(prompt, c2, 0)
        steps = [dec(rows[:, r:r + 1], c1, base + r)[0, 0] for r in range(m)]
        ver = dec(rows, c2, base, mode=Mode.VERIFY)[0]
        assert all(torch.equal(ver[r], steps[r]) for r in range(m)), (base, m)
        for layer in range(len(c1.k)):
            assert torch.equal(c1.k[layer][:, :, :base + m], c2.k[layer][:, :, :base + m])
            assert torch.equal(c1.v[layer][:, :, :base + m], c2.v[layer][:, :, :base + m])


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("family", ["llama3", "gemma2", "mistral"])
def test_engine_verify_rows_equal_decode_steps(models, family, fuse):
    """The engine on its torch fallbacks: every (base, M) bitwise (logits rows, cache rows, next step), state
    scrambled before each checked call; Mistral's sliding window (8) and Gemma-2's softcaps are crossed."""
    eng = GpuEngine(models[family].checkpoint, 64, device="cpu", options=Options(fuse=fuse))
    res = check(eng, rows=(1, 2, 3, 4, 8, 16), bases=(6, 21))
    assert all(r["ok"] for r in res), [r for r in res if not r["ok"]]


def test_engine_verify_codebook_cbk(tmp_path):
    m = trapetum.load(build_cbk("llama3", tmp_path, iters=3))
    eng = GpuEngine(m.checkpoint, 48, device="cpu")
    res = check(eng, rows=(1, 5, 16), bases=(6, 20))
    assert all(r["ok"] for r in res), [r for r in res if not r["ok"]]


@pytest.mark.parametrize("T,max_len", [(29, 48), (16, 16), (1, 48), (29, 31), (30, 30)])
def test_exact_prefill_continues_like_decoding(models, T, max_len):
    """Options.prefill = "exact": the prompt through 16-row verify passes, the last one padded (29 tokens, cache 48:
    two passes; 1 token: one padded pass), or split into 8, 4, 2, 1 rows where 16 would pass the cache's end (29 in
    31, 30 in 30); logits of every row and cache rows are those of decoding the prompt token by token."""
    m = models["llama3"]
    ids = torch.randint(3, 300, (T,), generator=torch.Generator().manual_seed(3))
    ex = GpuEngine(m.checkpoint, max_len, device="cpu", options=Options(prefill="exact"))
    last = ex.prefill(ids).clone()
    dec = GpuEngine(m.checkpoint, max_len, device="cpu")
    steps = []
    for t in range(T):  # every prompt token through a decode step, the first one too
        dec.set_position(ids[t], t)
        dec.step(greedy=False)
        steps.append(dec.logits.clone())
    assert torch.equal(last, dec.logits)
    assert torch.equal(ex.k_cache[:, :, :T], dec.k_cache[:, :, :T]) and torch.equal(ex.v_cache[:, :, :T], dec.v_cache[:, :, :T])
    allrows = ex.prefill(ids, all_logits=True)
    assert allrows.shape == (T, 300) and torch.equal(allrows, torch.stack(steps))


def test_short_prompt_choice(models, tmp_path):
    """GpuEngine.short_exact: only on CUDA, only up to Options.exact_prefill_max tokens, only for codebook layers
    (a dense fp16 model keeps the dequantizing pass everywhere); the option is checked."""
    from trapetum.runtime.engine import _codebook_kind
    cb = GpuEngine(trapetum.load(build_cbk("llama3", tmp_path, iters=3)).checkpoint, 48, device="cpu")
    dense = GpuEngine(models["llama3"].checkpoint, 48, device="cpu")
    assert all(_codebook_kind(p) for p in cb.model.projections()[1:])
    assert not all(_codebook_kind(p) for p in dense.model.projections()[1:])
    assert not cb.short_exact(8)  # the CPU: the default prefill everywhere
    cb.device = torch.device("cuda")  # the rule alone (no CUDA work follows)
    assert cb.short_exact(1) and cb.short_exact(128) and not cb.short_exact(129) and not cb.short_exact(0)
    dense.device = torch.device("cuda")
    assert not dense.short_exact(8)
    with pytest.raises(ConfigError, match="exact_prefill_max"):
        Options(exact_prefill_max=-1)


def test_verify_rejects_bad_rows(models):
    eng = GpuEngine(models["llama3"].checkpoint, 32, device="cpu")
    with pytest.raises(ValueError, match="1 to 16 rows"):
        eng.verify(list(range(3, 20)), 0)
    with pytest.raises(ValueError, match="outside the KV cache"):
        eng.verify([3, 4], 31)


@pytest.mark.slow  # 74 s on the 2-core CPU; the interpreter engine tests of tests/test_engine.py and the verify kernels' own
# interpreter tests stay in the default tier, and the GPU runs this contract compiled (tests/test_verify_gpu.py)
def test_engine_verify_under_triton_interpreter(tmp_path):
    """The real Triton kernels (interpreted): verify rows bitwise equal to decode steps, fixed-chunk and adaptive-split
    attention configs, chunk boundaries crossed (64-position blocks), GQA."""
    pytest.importorskip("triton")
    code = f"""
import trapetum
from tests.tiny_models import build
from trapetum.eval.verify_exact import check
from trapetum.runtime.engine import GpuEngine
from trapetum.errors import ConfigError
from trapetum.settings import Options
build("llama3", {str(tmp_path)!r})
m = trapetum.load({str(tmp_path)!r})
for opts in (Options(), Options(fuse=False, attention="unfused")):
    eng = GpuEngine(m.checkpoint, 80, device="cpu", options=opts)
    res = check(eng, rows=(1, 3, 8), bases=(6, 60))
    assert all(r["ok"] for r in res), [r for r in res if not r["ok"]]
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
