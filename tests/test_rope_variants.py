"""RoPE scaling types against transformers (fp32): longrope on a partial rotary (Phi-3 / Phi-4-mini's form), YaRN
(Qwen2), dynamic NTK (Llama). Prompts and generations cross each original context; the cos / sin of
models/rope.py against transformers' rotary module at lengths on both sides of the threshold; the engine's tables
(RopeSpec.table) against the reference's."""
import pytest
import torch

import trapetum
from tests.hf_compare import (assert_decode_equals_prefill, assert_greedy_match, assert_logits_match,
                              assert_verify_rows_are_decode_steps, build_models, prompt)
from tests.tiny_models import MOE_FAMILIES, ROPE_FAMILIES, build, family_configs
from trapetum.errors import TrapetumError
from trapetum.models.families import config_from_hf
from trapetum.models.layers import rotaries

# family -> the length past which the variant changes behaviour (original context / max_position_embeddings)
THRESHOLD = {"phi3_longrope": 64, "qwen2_yarn": 32, "llama_dynamic": 48, "deepseek_v2": 64, "deepseek_v3": 32}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory, ROPE_FAMILIES)


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_logits_match_hf_on_both_sides_of_the_threshold(models, family):
    _, hf, m = models[family]
    t = THRESHOLD[family]
    for n in (t - 8, t, t + 1, t + 30):
        assert_logits_match(m, hf, prompt(n, n))


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_greedy_matches_hf_across_the_threshold(models, family):
    """Generation from a prompt below the threshold to past it: each decode step rotates with the frequencies of
    its own length, as transformers' cached generation does."""
    _, hf, m = models[family]
    t = THRESHOLD[family]
    assert_greedy_match(m, hf, prompt(t - 6, 7), 16)


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_decode_equals_prefill_and_verify_rows(models, family):
    _, _, m = models[family]
    assert_decode_equals_prefill(m, prompt(20, 3))
    assert_verify_rows_are_decode_steps(m)


def _hf_model(family, tmp_path_factory, models):
    if family in models:
        return models[family][1], models[family][2].config
    d = tmp_path_factory.mktemp(family)
    return build(family, d), trapetum.load(d).config


@pytest.mark.parametrize("family", ROPE_FAMILIES + ["deepseek_v2", "deepseek_v3"])
def test_cos_sin_match_transformers(models, tmp_path_factory, family):
    """Rotary.cos_sin of a pass of length n against transformers' rotary_emb, and the engine's table rows (decode
    steps at p: seq_len p + 1; a pass: seq_len n) against the reference's."""
    hf, cfg = _hf_model(family, tmp_path_factory, models)
    rope, _ = rotaries(cfg)
    t = THRESHOLD[family]
    for n in (1, 3, t - 1, t, t + 1, t + 53):
        pos = torch.arange(n)
        x = torch.zeros(1, n, 8)
        with torch.no_grad():
            out = hf.model.rotary_emb(x, pos[None])
        # DeepSeek-V2's module returns exp(i f) x attention factor as one complex tensor [1, n, dim/2]
        hc, hs = (out.real, out.imag) if torch.is_tensor(out) else out
        c, s = rope.cos_sin(pos)
        half = rope.dim // 2
        # DeepSeek's interleaved form uses the first half of the rotate-half table
        assert torch.allclose(c[:, :half], hc[0, :, :half], atol=1e-6, rtol=0), (n, family)
        assert torch.allclose(s[:, :half], hs[0, :, :half], atol=1e-6, rtol=0), (n, family)
        tc, ts = rope.spec.table(n, seq_len=n)
        assert torch.allclose(tc.double(), c[:, :half].double(), atol=2e-6) and torch.allclose(
            ts.double(), s[:, :half].double(), atol=2e-6)
    dc, ds = rope.spec.table(t + 20)
    for p in (0, t - 1, t, t + 19):
        c, s = rope.cos_sin(torch.tensor([p]))
        assert torch.allclose(dc[p].double(), c[0, :half].double(), atol=2e-6), p
        assert torch.allclose(ds[p].double(), s[0, :half].double(), atol=2e-6), p


def test_rope_type_spellings():
    cls, _, kw = family_configs()["phi3_longrope"]
    d = cls(**kw).to_dict()
    for old in ("su", "yarn"):  # Phi-3's first names for longrope
        rs = dict(d["rope_parameters"] if "rope_parameters" in d else d["rope_scaling"])
        rs.pop("rope_type", None)
        d2 = dict(d, rope_scaling=dict(rs, type=old))
        d2.pop("rope_parameters", None)
        assert config_from_hf(d2).rope_scaling["rope_type"] == "longrope"
    assert config_from_hf(d).context_length == d["max_position_embeddings"]
    cls, _, kw = family_configs()["llama_dynamic"]
    assert config_from_hf(cls(**kw).to_dict()).context_length == 96  # dynamic NTK: 48 x factor 2


@pytest.mark.parametrize("patch,field", [
    ({"short_factor": [1.0, 2.0]}, "short_factor"),
    ({"long_factor": None}, "long_factor"),
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
])
def test_bad_longrope_names_the_field(patch, field):
    cls, _, kw = family_configs()["phi3_longrope"]
    d = cls(**kw).to_dict()
    rs = dict(d.pop("rope_parameters", None) or d["rope_scaling"])
    rs.update(patch)
    d["rope_scaling"] = rs
    if "original_max_position_embeddings" in patch:
        d["original_max_position_embeddings"] = patch["original_max_position_embeddings"]
    with pytest.raises(TrapetumError) as e:
        config_from_hf(d)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_rope_families_listed():
    assert not set(ROPE_FAMILIES) & set(MOE_FAMILIES)


@pytest.mark.usefixtures("torch_fallbacks")
@pytest.mark.parametrize("prefill", ["default", "precise"])
@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_engine_matches_reference_across_the_threshold(models, family, prefill):
    """The engine (kernels' torch fallbacks) against the fp32 reference: a prompt pass past the threshold (its own
    tables, GpuEngine.pass_rope), decode steps and a verify pass that cross it (the decode-step tables)."""
    from trapetum.runtime.engine import GpuEngine
    from trapetum.settings import Options
    _, _, m = models[family]
    t = THRESHOLD[family]
    eng = GpuEngine(m.checkpoint, t + 24, device="cpu", options=Options(prefill=prefill))
    ids = prompt(t + 10, 11)
    ref = m.logits(ids)
    assert float((eng.prefill(ids, all_logits=True) - ref).norm() / ref.norm()) < 2e-3
    # decode steps from below the threshold to past it, as the reference's cached steps
    short = ids[:t - 3]
    dec = m.decoder
    cache = dec.new_cache(1, t + 24)
    with torch.no_grad():
        dec(torch.tensor([short]), cache, 0)
        steps = [dec(torch.tensor([[ids[p]]]), cache, p)[0, -1] for p in range(t - 3, t + 6)]
    eng.prefill(short)
    for i, p in enumerate(range(t - 3, t + 6)):
        eng.set_position(ids[p], p)
        eng.step(greedy=False)
        assert float((eng.logits - steps[i]).norm() / steps[i].norm()) < 2e-3, p
    eng.prefill(short)
    rows = eng.verify(ids[t - 3:t + 6], t - 3)
    for i in range(9):
        assert float((rows[i] - steps[i]).norm() / steps[i].norm()) < 2e-3, i
