"""The decode engine (GPU data path) against the reference decoder, on the CPU.

Without CUDA the engine's kernels run their torch fallbacks; the interpreter tests run the real Triton kernels
under TRITON_INTERPRET=1 in a subprocess. Full-size runs happen on the GPU machine (tests/test_engine_gpu.py).
The engine is built from the checkpoint (no reference decoder in between).
"""
import os
import subprocess
import sys

import pytest
import torch

import trapetum
from tests.tiny_models import FAMILIES, build, build_cbk, build_families
from trapetum.formats.detect import load_checkpoint
from trapetum.runtime.engine import GpuEngine
from trapetum.runtime.sampling import GenerationSettings
from trapetum.settings import Options

# fp16 engine against the fp32 reference; Gemma's sandwich norms (4 per layer) round more often.
TOL = {"gemma2": 3e-3, "gemma3": 3e-3}
REPO = os.path.dirname(os.path.dirname(__file__))


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def engine(m, max_len, **opts):
    return GpuEngine(m.checkpoint, max_len, device="cpu", options=Options(**opts))


pytestmark = pytest.mark.usefixtures("torch_fallbacks")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {fam: trapetum.load(d) for fam, d in build_families(tmp_path_factory).items()}


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_matches_reference(tiny, family, fuse):
    m = tiny[family]
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    eng = engine(m, 48, fuse=fuse)
    assert eng.attn_config is not None and eng.attn_config.splits == 0  # dense fp16: fixed chunks
    ref = m.logits(ids)
    tol = TOL.get(family, 2e-3)
    assert rel(eng.prefill(ids[:-4]), ref[-5]) < tol
    # decode the last 4 prompt tokens one by one through the static-buffer step
    for i, t in enumerate(ids[-4:]):
        eng.set_position(t, 16 + i)
        eng.step(greedy=False)
        assert rel(eng.logits, ref[16 + i]) < tol
    # and the same 4 tokens as one verify pass
    eng.prefill(ids[:-4])
    rows = eng.verify(ids[-4:], 16)
    for i in range(4):
        assert rel(rows[i], ref[16 + i]) < tol
    toks = list(eng.tokens(ids, GenerationSettings(max_new_tokens=16), 36))
    assert toks == m.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids


def test_engine_sampling_is_seeded_and_respects_length(tiny):
    m = tiny["llama3"]
    eng = engine(m, 64)
    s = GenerationSettings(max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=40, min_p=0.02,
                           repetition_penalty=1.3, seed=3)
    a = list(eng.tokens([5, 6, 7], s, 13))
    b = list(eng.tokens([5, 6, 7], s, 13))
    assert a == b and len(a) == 10


def test_engine_is_built_from_the_checkpoint_without_a_reference_decoder(tmp_path, monkeypatch):
    """No Decoder is constructed on the engine's path (the model is not materialized twice); a tied dense head is
    the embedding table itself; weight bytes count it once."""
    from trapetum.models import decoder as D
    build("qwen2", tmp_path)  # tied embeddings
    monkeypatch.setattr(D.Decoder, "from_checkpoint", classmethod(lambda *a, **k: pytest.fail("decoder built")))
    eng = GpuEngine(load_checkpoint(tmp_path), 32, device="cpu")
    assert eng.model.head.w.data_ptr() == eng.model.embed.data_ptr()
    from trapetum.models.schema import expected_shapes
    want = 0  # fp16 weights and biases, fp32 norms, the tied head not again
    for name, shp in expected_shapes(eng.cfg).items():
        n = 1
        for d in shp:
            n *= d
        want += n * (4 if "norm" in name else 2)
    assert eng.weight_bytes() == want


def test_engine_under_triton_interpreter(tmp_path):
    """The engine's real Triton kernels (interpreted on the CPU) agree with the reference."""
    pytest.importorskip("triton")
    code = f"""
import torch, trapetum
from tests.tiny_models import build
from trapetum.runtime.engine import GpuEngine
build("gemma3", {str(tmp_path)!r})
m = trapetum.load({str(tmp_path)!r})
ids = list(range(5, 17))
eng = GpuEngine(m.checkpoint, 16, device="cpu")
ref = m.logits(ids)
lg = eng.prefill(ids[:-2])
assert float((lg - ref[-3]).norm() / ref[-3].norm()) < 3e-3
for i, t in enumerate(ids[-2:]):
    eng.set_position(t, 10 + i)
    eng.step(greedy=False)
    e = float((eng.logits - ref[10 + i]).norm() / ref[10 + i].norm())
    assert e < 3e-3, e
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.slow  # 35 s on the CPU (CI budget); test_engine_under_triton_interpreter stays in the fast tier
def test_engine_fused_attention_under_triton_interpreter(tmp_path):
    """The decode step's fused RoPE + KV append + attention kernel and merge kernel (interpreted) against the
    unfused path (Options.attention = "unfused": RoPE + KV append, then split-KV attention): the same logits and KV
    caches bit for bit, steps crossing the sliding window and a 64-position chunk boundary (Gemma-2: GQA, softcap,
    alternating sliding layers)."""
    pytest.importorskip("triton")
    code = f"""
import torch, trapetum
from tests.tiny_models import build
from trapetum.runtime.engine import GpuEngine
from trapetum.settings import Options
build("gemma2", {str(tmp_path)!r})
m = trapetum.load({str(tmp_path)!r})
ids = [(7 * i) % 290 + 5 for i in range(66)]
runs = []
for mode in ("fused", "unfused"):
    eng = GpuEngine(m.checkpoint, 72, device="cpu", options=Options(attention=mode))
    eng.prefill(ids[:62])
    steps = []
    for t in range(62, 66):
        eng.set_position(ids[t], t)
        eng.step(greedy=False)
        steps.append(eng.logits.clone())
    runs.append((steps, eng.k_cache.clone(), eng.v_cache.clone()))
(a, ka, va), (b, kb, vb) = runs
assert all(torch.equal(x, y) for x, y in zip(a, b))
assert torch.equal(ka, kb) and torch.equal(va, vb)
ref = m.logits(ids)
e = max(float((x - ref[62 + i]).norm() / ref[62 + i].norm()) for i, x in enumerate(a))
assert e < 3e-3, e
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("family", ["llama3", "gemma2"])
def test_engine_runs_quantized_cbk(tmp_path, family):
    """A .cbk from the quantizer (4-bit projections, 8-bit head) through the engine's codebook path."""
    out = build_cbk(family, tmp_path)
    m = trapetum.load(out)
    eng = engine(m, 40)
    layers = eng.model.layers
    assert all(p.kind == "codebook" for L in layers for p in (L.attention.qkv, L.attention.o, L.mlp.down))
    assert layers[0].mlp.gate_up.kind == "codebook" and eng.model.head.kind == "codebook"
    assert eng.attn_config is None  # quantized: choose_config picks at launch (splits with >= 32 kv heads)
    ids = torch.randint(3, 300, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = m.logits(ids)
    assert rel(eng.prefill(ids[:-1]), ref[-2]) < TOL.get(family, 2e-3)
    eng.set_position(ids[-1], 15)
    eng.step(greedy=False)
    assert rel(eng.logits, ref[-1]) < TOL.get(family, 2e-3)
    toks = list(eng.tokens(ids, GenerationSettings(max_new_tokens=12), 28))
    assert toks == m.generate(ids, max_new_tokens=12, ignore_eos=True).token_ids


def test_engine_scores_windows_like_the_reference(tiny):
    """Perplexity through the engine (prefill, and step by step) equals the reference decoder's."""
    from trapetum.eval.perplexity import window_nll
    m = tiny["qwen2"]
    eng = engine(m, 64)
    w = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(5))
    ref, n = window_nll(m.decoder, w)
    pre, n1 = window_nll(eng, w)
    dec, n2 = window_nll(eng, w, decode=True)
    assert n == n1 == n2 == 39
    assert abs(pre - ref) / n < 2e-3 and abs(dec - pre) / n < 2e-3


def test_options_do_not_come_from_the_environment_once_built(tiny, monkeypatch):
    """Library defaults are the production settings whatever TRAPETUM_* say; the edge (trapetum.load) reads them."""
    monkeypatch.setenv("TRAPETUM_FUSE", "0")
    m = tiny["llama2"]
    assert GpuEngine(m.checkpoint, 16, device="cpu").options.fuse is True
    assert Options.from_env().fuse is False
