"""Quantizing mixture-of-experts and latent-attention models to .cbk (issue 17): every expert (shared ones too) and
every MLA projection is an ordinary 4-bit projection; routers, the correction bias and the shared-expert gate stay
exact; calibration statistics per expert over the rows routed to it, with the documented fallback
(quant/calibrate.py, EXPERT_MIN_ROWS) for experts that see few or none; the .cbk loads and generates on the CPU."""
import os
import subprocess
import sys

import pytest
import torch

import trapetum
from tests.tiny_models import build
from trapetum.formats.detect import load_checkpoint
from trapetum.models.schema import layer_projections, moe_names
from trapetum.quant import calibrate
from trapetum.quant.quantize import Recipe, quantize_to_cbk
from trapetum.schemes.codebook import CodebookLinear

REPO = os.path.dirname(os.path.dirname(__file__))


@pytest.fixture(scope="module", params=["qwen2_moe", "deepseek_v3"])
def quantized(request, tmp_path_factory):
    fam = request.param
    d = tmp_path_factory.mktemp(fam)
    build(fam, d / "src", tokenizer=True)
    logs = []
    recipe = Recipe(bits=4, head_bits=8, calib_seqs=2, calib_sample_len=16, iters=5)
    _, qm = quantize_to_cbk(str(d / "src"), d / "m.cbk", recipe, progress=False, log=logs.append)
    return fam, d, qm, logs


def test_every_expert_is_quantized_and_routers_stay_exact(quantized):
    fam, d, qm, logs = quantized
    src = load_checkpoint(d / "src")
    q = trapetum.load(d / "m.cbk")
    cfg = q.config
    assert cfg.moe and (cfg.mla == (fam == "deepseek_v3"))
    for i in range(cfg.num_layers):
        for name in layer_projections(cfg, i):
            assert isinstance(q.decoder.get_submodule(name), CodebookLinear), name
            assert name + ".weight" in qm.quantized
        if cfg.block_kinds(i)[1] == "moe":
            m = moe_names(cfg, i)
            exact = [m["router"] + ".weight"] + [n for n in (m["router_bias"],) if n]
            exact += [m["shared_gate"] + ".weight"] if m["shared_gate"] else []
            for n in exact:
                assert torch.equal(q.checkpoint.tensors[n].float(), src.tensors[n].float()), n
    # the fallback was needed (2 x 16 sampled rows over 8 experts) and said so
    assert any("experts saw fewer than" in s for s in logs), logs


def test_quantized_model_runs_close_to_the_source_and_generates(quantized):
    fam, d, _, _ = quantized
    q, ref = trapetum.load(d / "m.cbk"), trapetum.load(d / "src")
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b = q.logits(ids), ref.logits(ids)
    assert float((a - b).norm() / b.norm()) < 0.25
    # a reload gives the same bits; the CLI's greedy text is the API's
    assert torch.equal(trapetum.load(d / "m.cbk").logits(ids), a)
    text = q.generate("the quick brown fox", max_new_tokens=12, temperature=0, ignore_eos=True).text
    out = subprocess.run([sys.executable, "-m", "trapetum.cli", "generate", str(d / "m.cbk"), "the quick brown fox",
                          "--max-new-tokens", "12", "--temperature", "0"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO), timeout=300)
    assert out.returncode == 0, out.stderr
    text = text.replace("\r", "\n").strip()  # text-mode pipes turn \r into \n
    assert text and text in out.stdout


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_layerwise_calibration_equals_full_model_per_expert(tmp_path, family):
    from trapetum.models.decoder import Decoder
    build(family, tmp_path)
    ck = load_checkpoint(tmp_path)
    toks = torch.randint(3, 300, (3, 24), generator=torch.Generator().manual_seed(5))
    full = calibrate.collect_input_stats(Decoder.from_checkpoint(ck).eval(), toks, batch=2, progress=False)
    lw = calibrate.collect_input_stats_layerwise(ck, toks, batch=2, progress=False)
    i = 0 if family == "qwen2_moe" else 1  # DeepSeek: first_k_dense_replace 1
    assert sorted(full) == sorted(lw) and f"model.layers.{i}.mlp.gate" in lw
    for k in full:
        assert full.counts[k] == lw.counts[k], k
        assert torch.allclose(full[k], lw[k], rtol=1e-5, atol=1e-8), k
    e = [full.counts.get(f"model.layers.{i}.mlp.experts.{j}.gate_proj", 0) for j in range(8)]
    assert sum(e) == 72 * 2  # 72 rows, top-2: each row seen by two experts


def test_expert_fallback_blends_toward_the_layer():
    from trapetum.models.config import ModelConfig
    cfg = ModelConfig(family="t", vocab_size=32, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=4, num_experts=3, num_experts_per_tok=1, moe_intermediate_size=2,
                      mlp_types=["moe"]).validate()
    m = moe_names(cfg, 0)
    M = calibrate.EXPERT_MIN_ROWS
    router = torch.tensor([1.0, 2.0, 3.0, 4.0])
    stats, counts = {m["router"]: router}, {m["router"]: 2 * M}
    rows = {0: 2 * M, 1: M // 4, 2: 0}  # plenty, few, none
    for e, n in rows.items():
        ex = m["experts"][e]
        if n:
            for r in ("gate", "up"):
                stats[ex[r]], counts[ex[r]] = torch.full((4,), 10.0 + e), n
            stats[ex["down"]], counts[ex["down"]] = torch.full((2,), 100.0 + e), n
    s = calibrate.Stats(stats, counts)
    note = calibrate.expert_fallback(s, cfg)
    assert note and "2 of 3 experts" in note
    ex0, ex1, ex2 = m["experts"]
    assert torch.equal(s[ex0["gate"]], torch.full((4,), 10.0))  # untouched
    assert torch.allclose(s[ex2["gate"]], router) and torch.allclose(s[ex2["up"]], router)
    down_mean = (100.0 * 2 * M + 101.0 * (M // 4)) / (2 * M + M // 4)
    assert torch.allclose(s[ex2["down"]], torch.full((2,), down_mean))
    f = 0.25
    assert torch.allclose(s[ex1["gate"]], f * 11.0 + (1 - f) * router)
    assert torch.allclose(s[ex1["down"]], torch.full((2,), f * 101.0 + (1 - f) * down_mean))


@pytest.mark.slow
def test_additive_2x8_quantizes_every_expert(tmp_path):
    """AQLM 2x8 (the additive driver) over a MoE + MLA model: every projection of layer_projections is an additive
    record, the routers stay exact, and the .cbk runs on the CPU with the same bits on a reload."""
    from trapetum.quant.additive import AdditiveLinear
    from trapetum.quant.additive_driver import AdditiveRecipe, quantize_additive_to_cbk
    build("deepseek_v2", tmp_path / "src")
    recipe = AdditiveRecipe(scheme="aqlm-2x8", weighted=False, calib="none", beam=1, iters=1, beam_steps=1,
                            kmeans_iters=2)
    path, qm = quantize_additive_to_cbk(str(tmp_path / "src"), tmp_path / "m.cbk", recipe, progress=False,
                                        log=lambda s: None)
    q = trapetum.load(path)
    cfg = q.config
    names = [n for i in range(cfg.num_layers) for n in layer_projections(cfg, i)]
    assert any(".experts." in n for n in names) and any("kv_b_proj" in n for n in names)
    for n in names:
        assert isinstance(q.decoder.get_submodule(n), AdditiveLinear), n
    src = load_checkpoint(tmp_path / "src")
    assert torch.equal(q.checkpoint.tensors["model.layers.1.mlp.gate.weight"].float(),
                       src.tensors["model.layers.1.mlp.gate.weight"].float())
    ids = list(range(3, 23))
    a = q.logits(ids)
    assert torch.isfinite(a).all() and torch.equal(trapetum.load(path).logits(ids), a)
