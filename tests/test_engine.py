"""The decode engine (GPU data path) against the reference decoder, on the CPU.

Without CUDA the engine's kernels run their torch fallbacks; one test runs the real Triton
kernels under TRITON_INTERPRET=1 in a subprocess. Full-size runs happen on the GPU machine.
"""
import os
import subprocess
import sys

import pytest
import torch

import trapetum
from tests.tiny_models import FAMILIES, build, build_cbk, build_families
from trapetum.runtime.engine import GpuEngine
from trapetum.runtime.sampling import GenerationSettings


# fp16 engine against the fp32 reference; Gemma's sandwich norms (4 per layer) round more often.
TOL = {"gemma2": 3e-3, "gemma3": 3e-3}


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(autouse=True)
def torch_fallbacks(monkeypatch, request):
    """Kernels' torch fallbacks on the CPU (the interpreter test below runs the Triton code)."""
    if not torch.cuda.is_available() and "interpreter" not in request.node.name:
        monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {fam: trapetum.load(d) for fam, d in build_families(tmp_path_factory).items()}


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_matches_reference(tiny, family, fuse):
    m = tiny[family]
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    eng = GpuEngine(m.decoder, 48, fuse=fuse)
    assert eng.attn_config is not None and eng.attn_config.splits == 0  # dense fp16: fixed chunks
    ref = m.logits(ids)
    tol = TOL.get(family, 2e-3)
    assert rel(eng.prefill(ids[:-4]), ref[-5]) < tol
    # decode the last 4 prompt tokens one by one through the static-buffer step
    for i, t in enumerate(ids[-4:]):
        eng.set_position(t, 16 + i)
        eng.step(greedy=False)
        assert rel(eng.logits, ref[16 + i]) < tol
    toks = list(eng.tokens(ids, GenerationSettings(max_new_tokens=16), 36))
    assert toks == m.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids


def test_engine_sampling_is_seeded_and_respects_length(tiny):
    m = tiny["llama3"]
    eng = GpuEngine(m.decoder, 64)
    s = GenerationSettings(max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=40, min_p=0.02,
                           repetition_penalty=1.3, seed=3)
    a = list(eng.tokens([5, 6, 7], s, 13))
    b = list(eng.tokens([5, 6, 7], s, 13))
    assert a == b and len(a) == 10


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
eng = GpuEngine(m.decoder, 16)
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
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_engine_fused_attention_under_triton_interpreter(tmp_path):
    """The decode step's fused RoPE + KV append + attention kernel and merge kernel (interpreted; also the
    one-launch inline merge, TRAPETUM_ATTN=inline-merge) against the three-launch path (TRAPETUM_ATTN=unfused): the same logits and KV
    caches bit for bit, steps crossing the sliding window and a 64-position chunk boundary (Gemma-2: GQA,
    softcap, alternating sliding layers), counters back at zero."""
    pytest.importorskip("triton")
    code = f"""
import collections, os, torch, trapetum
import trapetum.runtime.engine as E
from tests.tiny_models import build
build("gemma2", {str(tmp_path)!r})
m = trapetum.load({str(tmp_path)!r})
calls = collections.Counter()  # which attention entry point each mode's steps called
def spy(name, f):
    def call(*a, **kw):
        calls[name, kw.get("inline_merge")] += 1
        return f(*a, **kw)
    return call
E.decode_attention_fused = spy("fused", E.decode_attention_fused)
E.decode_attention = spy("split", E.decode_attention)
expect = {{"split": ("fused", False), "inline-merge": ("fused", True), "unfused": ("split", None)}}
ids = [(7 * i) % 290 + 5 for i in range(66)]
runs = []
for mode, entry in expect.items():
    os.environ["TRAPETUM_ATTN"] = mode
    calls.clear()
    eng = E.GpuEngine(m.decoder, 72)
    eng.prefill(ids[:62])
    steps = []
    for t in range(62, 66):
        eng.set_position(ids[t], t)
        eng.step(greedy=False)
        steps.append(eng.logits.clone())
    assert set(calls) == {{entry}}, (mode, calls)
    assert not eng.ws.counters.any()
    runs.append((steps, eng.k_cache.clone(), eng.v_cache.clone()))
a, ka, va = runs[-1]
for b, kb, vb in runs[:-1]:
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(ka, kb) and torch.equal(va, vb)
ref = m.logits(ids)
e = max(float((x - ref[62 + i]).norm() / ref[62 + i].norm()) for i, x in enumerate(a))
assert e < 3e-3, e
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("family", ["llama3", "gemma2"])
def test_engine_runs_quantized_cbk(tmp_path, family):
    """A .cbk from the quantizer (4-bit projections, 8-bit head) through the engine's codebook path."""
    out = build_cbk(family, tmp_path)
    m = trapetum.load(out)
    eng = GpuEngine(m.decoder, 40)
    assert all(type(p).__name__ == "CodebookProj" for L in eng.layers for p in L.qkv + [L.o, L.down])
    assert eng.layers[0].gate_up.interleaved is not None and type(eng.head).__name__ == "CodebookProj"
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
    eng = GpuEngine(m.decoder, 64)
    w = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(5))
    ref, n = window_nll(m.decoder, w)
    pre, n1 = window_nll(eng, w)
    dec, n2 = window_nll(eng, w, decode=True)
    assert n == n1 == n2 == 39
    assert abs(pre - ref) / n < 2e-3 and abs(dec - pre) / n < 2e-3


@pytest.mark.parametrize("quantized", [False, True], ids=["fp16", "cbk"])
def test_engine_shares_weights_with_the_decoder(tmp_path, quantized):
    """Building the engine makes no second copy of the weights: single projections are used as they are,
    and the decoder's q/k/v point into the engine's fused tensor (logits unchanged)."""
    from trapetum.models.decoder import Decoder
    if quantized:
        src = build_cbk("llama3", tmp_path, iters=3)
    else:
        build("llama3", tmp_path / "src")
        src = tmp_path / "src"
    from trapetum.api import load_checkpoint
    dec = Decoder.from_checkpoint(load_checkpoint(src), dtype=torch.float16)
    ids = torch.tensor([list(range(5, 17))])
    before = dec(ids)
    eng = GpuEngine(dec, 32)
    a = dec.model.layers[1].self_attn
    attr = "codes" if quantized else "weight"
    fused = eng.layers[1].qkv[0].codes if quantized else eng.layers[1].qkv[0].w
    assert getattr(a.q_proj, attr).data_ptr() == fused.data_ptr()
    assert getattr(a.k_proj, attr).data_ptr() == fused[a.q_proj.out_features:].data_ptr()
    o = eng.layers[1].o.codes if quantized else eng.layers[1].o.w
    assert getattr(a.o_proj, attr).data_ptr() == o.data_ptr()
    assert torch.equal(dec(ids), before)


def test_engine_takes_over_private_codes(tmp_path):
    """own_weights=True frees the decoder's codes that only the engine's own layouts serve (here the
    interleaved gate/up copy; on the GPU also tiled 4-bit and packed 2x8 codes): same logits after,
    the bytes are gone, and the decoder refuses forward() with a clear error."""
    from trapetum.errors import UnsupportedError
    out = build_cbk("llama3", tmp_path, iters=3)
    m = trapetum.load(out)
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = m.logits(ids)
    keep = GpuEngine(m.decoder, 32).prefill(ids, all_logits=True)
    gate = m.decoder.model.layers[0].mlp.gate_proj
    n_gate = gate.codes.numel()
    eng = GpuEngine(m.decoder, 32, own_weights=True)
    assert eng.released_bytes >= 2 * n_gate * len(m.decoder.model.layers) and gate.codes.numel() == 0
    assert m.decoder.model.layers[0].self_attn.q_proj.codes.numel() > 0  # shared with the engine: kept
    assert torch.equal(eng.prefill(ids, all_logits=True), keep)
    assert rel(keep, ref) < 2e-3
    with pytest.raises(UnsupportedError, match="GPU engine"):
        m.decoder(torch.tensor([ids]))
    assert m.decoder.released is not None and "MB" in m.decoder.released
    assert GpuEngine(trapetum.load(out).decoder, 32, own_weights=False).released_bytes == 0
