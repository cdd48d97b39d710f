"""The engine (runtime/engine_ops.py: route / experts / sigmoid_gate / latent_attend) on mixture-of-experts and
latent-attention models, on the CPU with the kernels' torch fallbacks: against the fp32 reference (prefill, decode
steps, verify rows, 16 greedy tokens), the VERIFY contract bitwise (rows route to different experts), and a 4-bit
.cbk against the reference of that .cbk. The same on the GPU: tests/test_moe_engine_gpu.py."""
import pytest
import torch

import trapetum
from tests.tiny_models import MOE_FAMILIES, build, build_cbk
from trapetum.eval.verify_exact import check
from trapetum.runtime.engine import GpuEngine
from trapetum.runtime.sampling import GenerationSettings
from trapetum.settings import Options

pytestmark = pytest.mark.usefixtures("torch_fallbacks")  # tests/conftest.py
TOL = 2e-3  # the fp16 engine against the fp32 reference


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for fam in MOE_FAMILIES:
        d = tmp_path_factory.mktemp(fam)
        build(fam, d)
        out[fam] = trapetum.load(d)
    return out


def assert_engine_matches(m, eng, n_new=16):
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = m.logits(ids)
    assert rel(eng.prefill(ids[:-4]), ref[-5]) < TOL
    for i, t in enumerate(ids[-4:]):
        eng.set_position(t, 16 + i)
        eng.step(greedy=False)
        assert rel(eng.logits, ref[16 + i]) < TOL
    eng.prefill(ids[:-4])
    rows = eng.verify(ids[-4:], 16)
    assert all(rel(rows[i], ref[16 + i]) < TOL for i in range(4))
    toks = list(eng.tokens(ids, GenerationSettings(max_new_tokens=n_new), 20 + n_new))
    assert toks == m.generate(ids, max_new_tokens=n_new, ignore_eos=True).token_ids


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_engine_matches_reference(models, family):
    m = models[family]
    assert_engine_matches(m, GpuEngine(m.checkpoint, 48, device="cpu"))


@pytest.mark.parametrize("vd", [16, 32])
def test_engine_latent_attention_pads(tmp_path, vd):
    """engine_ops.latent_attend when the per-head width P = max(head_dim, v_head_dim) pads v (vd < head_dim, as
    DeepSeek-V2-Lite's 128 < 192) or q and k (vd > head_dim)."""
    build("deepseek_v2", tmp_path, overrides={"v_head_dim": vd})
    m = trapetum.load(tmp_path)
    assert_engine_matches(m, GpuEngine(m.checkpoint, 48, device="cpu"), n_new=4)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_engine_unfused_and_exact_prefill(models, family):
    m = models[family]
    assert_engine_matches(m, GpuEngine(m.checkpoint, 48, device="cpu", options=Options(fuse=False)))
    assert_engine_matches(m, GpuEngine(m.checkpoint, 48, device="cpu", options=Options(prefill="exact")))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_engine_verify_rows_equal_decode_steps(models, family):
    """Logits rows, cache rows and the next step bitwise, for 1 to 16 rows (each row its own experts)."""
    eng = GpuEngine(models[family].checkpoint, 48, device="cpu")
    res = check(eng, rows=(1, 3, 16), bases=(6, 21))
    assert res and all(r["ok"] for r in res), [r for r in res if not r["ok"]]


def test_mla_engine_cache_and_precise_prefill_refusal(models):
    m = models["deepseek_v2"]
    eng = GpuEngine(m.checkpoint, 32, device="cpu")
    cfg = m.config
    assert eng.kv.k.shape == (cfg.num_layers, cfg.num_heads, 32, max(cfg.head_dim, cfg.v_head_dim))
    from trapetum.errors import TrapetumError
    with pytest.raises(TrapetumError) as e:
        GpuEngine(m.checkpoint, 32, device="cpu", options=Options(prefill="precise"))
    assert "precise prefill" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_engine_runs_a_4bit_cbk_like_its_reference(tmp_path, family):
    """A 4-bit .cbk (every expert a codebook projection): the engine against the CPU reference of the same file,
    16 greedy tokens, verify rows bitwise."""
    m = trapetum.load(build_cbk(family, tmp_path, iters=3))
    eng = GpuEngine(m.checkpoint, 48, device="cpu")
    assert_engine_matches(m, eng)
    res = check(eng, rows=(1, 5, 16), bases=(6,))
    assert all(r["ok"] for r in res), [r for r in res if not r["ok"]]


@pytest.mark.slow  # ~45 s each: every engine kernel interpreted
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_expert_kernels_in_engine_under_triton_interpreter(tmp_path, monkeypatch, family):
    """The engine's rows with the expert GEMVs (kernels/expert_gemv.py, interpreted): fp16 and 4-bit .cbk experts
    stacked, only the chosen experts run (the all-experts loop is not entered), the reference within 2e-3 and
    verify rows bitwise equal to decode steps."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the GPU runs these in tests/test_moe_engine_gpu.py")
    for path in (None, build_cbk(family, tmp_path / "q", iters=2)):
        if path is None:
            build(family, tmp_path / "d")
            path = tmp_path / "d"
        m = trapetum.load(path)
        eng = GpuEngine(m.checkpoint, 24, device="cpu")
        sets = [w.experts for L in eng.model.layers for kind, w in L.blocks if kind == "moe"]
        assert sets and all(s.stack is not None for s in sets)
        assert {s.stack.scheme for s in sets} == ({"fp16"} if path.name == "d" else {"codebook"})
        calls = []
        run = type(sets[0].stack).run
        monkeypatch.setattr(type(sets[0].stack), "run", lambda self, *a, **k: calls.append(1) or run(self, *a, **k))
        ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(0)).tolist()
        ref = m.logits(ids)
        eng.prefill(ids[:-2])
        assert not calls  # prefill keeps its path
        for i, t in enumerate(ids[-2:]):
            eng.set_position(t, 10 + i)
            eng.step(greedy=False)
            assert rel(eng.logits, ref[10 + i]) < TOL
        assert len(calls) == 2 * len(sets)
        res = check(eng, rows=(1, 3), bases=(6,))
        assert res and all(r["ok"] for r in res), [r for r in res if not r["ok"]]
        monkeypatch.undo()


def _2x8_engine_against_reference(tmp_path, device):
    """A tiny Qwen2-MoE whose projections (experts included) are random AQLM 2x8 records: the experts stacked for
    kernels/expert_gemv_2x8.py, decode steps against the float32 reference of the same checkpoint, verify rows
    bitwise equal to decode steps."""
    from tests.tiny_models import additive_checkpoint
    from trapetum.models.decoder import Decoder
    ck = additive_checkpoint("qwen2_moe", tmp_path / "src", device=device)
    eng = GpuEngine(ck, 24, device=device)
    sets = [w.experts for L in eng.model.layers for kind, w in L.blocks if kind == "moe"]
    assert sets and all(s.stack is not None and s.stack.scheme == "2x8" for s in sets)
    ref = Decoder.from_checkpoint(ck, dtype=torch.float32, device=device)
    ids = list(range(5, 17))
    want = ref(torch.tensor([ids], device=device))[0]
    eng.prefill(ids[:-2])
    for i, t in enumerate(ids[-2:]):
        eng.set_position(t, 10 + i)
        eng.step(greedy=False)
        assert rel(eng.logits.cpu(), want[10 + i].cpu()) < 3e-3
    res = check(eng, rows=(1, 3), bases=(6,))
    assert res and all(r["ok"] for r in res), [r for r in res if not r["ok"]]


@pytest.mark.slow  # every engine kernel interpreted
def test_2x8_experts_in_engine_under_triton_interpreter(tmp_path):
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the GPU runs this in tests/test_moe_engine_gpu.py")
    _2x8_engine_against_reference(tmp_path, "cpu")

