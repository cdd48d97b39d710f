"""Mixture-of-experts families against transformers (fp32): Mixtral, Qwen2-MoE (shared expert with its sigmoid gate,
dense mlp_only_layers), Qwen3-MoE (decoder_sparse_step, q/k norms); the routing contract (row-independent, ties to
the lower index, group-limited choice) and the one-line errors of bad MoE configs. DeepSeek's MoE with latent
attention: tests/test_mla.py."""
import json

import pytest
import torch

import trapetum
from tests.hf_compare import (assert_decode_equals_prefill, assert_greedy_match, assert_logits_match,
                              assert_verify_rows_are_decode_steps, build_models, prompt)
from tests.tiny_models import MOE_FAMILIES, build
from trapetum.errors import TrapetumError
from trapetum.models.blocks.moe import select_experts
from trapetum.models.config import ModelConfig
from trapetum.models.families import config_from_hf

FAMS = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory, FAMS)


@pytest.mark.parametrize("family", FAMS)
def test_logits_and_greedy_match_hf(models, family):
    _, hf, m = models[family]
    assert_logits_match(m, hf, prompt(40, 1))
    assert_greedy_match(m, hf, prompt(20, 2), 16)


@pytest.mark.parametrize("family", FAMS)
def test_decode_equals_prefill_and_verify_rows(models, family):
    _, _, m = models[family]
    assert_decode_equals_prefill(m, prompt(20, 3))
    assert_verify_rows_are_decode_steps(m)


def test_layer_kinds_follow_the_config(models):
    kinds = {f: [m.config.block_kinds(i)[1] for i in range(m.config.num_layers)] for f, (_, _, m) in models.items()}
    assert kinds == {"mixtral": ["moe"] * 3, "qwen2_moe": ["moe", "mlp", "moe"],
                     "qwen3_moe": ["mlp", "moe", "mlp", "moe"]}
    c = models["qwen2_moe"][2].config
    assert (c.shared_expert_gate, c.shared_expert_intermediate_size, c.norm_topk_prob) == (True, 48, False)


def _cfg(**kw) -> ModelConfig:
    base = dict(family="t", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                num_kv_heads=2, head_dim=8, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=8,
                mlp_types=["moe"])
    return ModelConfig(**dict(base, **kw)).validate()


ROUTINGS = [dict(), dict(norm_topk_prob=True, routed_scaling_factor=2.0),
            dict(router_topk="group_limited_greedy", n_group=4, topk_group=2),
            dict(router_scoring="sigmoid", router_topk="noaux_tc", n_group=4, topk_group=2, router_bias=True,
                 norm_topk_prob=True)]


@pytest.mark.parametrize("kw", ROUTINGS, ids=["softmax", "renorm", "v2_groups", "v3_noaux"])
def test_routing_is_row_independent(kw):
    """A row's experts and weights are bitwise those it gets alone, whatever the other rows (and batch shape)."""
    cfg = _cfg(**kw)
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(16, generator=g) * 0.1 if cfg.router_bias else None
    for n in (1, 3, 53, 97):
        logits = torch.randn(n, 16, generator=g)
        logits[0, 3] = logits[0, 5] = logits[0].max() + 1  # a tie: the lower index wins
        w, idx = select_experts(logits, cfg, bias)
        assert idx.shape == (n, 4) and w.dtype == torch.float32 and idx.dtype == torch.int64
        for r in range(n):
            w1, i1 = select_experts(logits[r:r + 1], cfg, bias)
            assert torch.equal(i1[0], idx[r]) and torch.equal(w1[0], w[r])
        w3, i3 = select_experts(logits.view(1, n, 16), cfg, bias)
        assert torch.equal(i3[0], idx) and torch.equal(w3[0], w)
        if not cfg.router_bias:
            assert idx[0, 0] == 3 and idx[0, 1] == 5
        assert (idx.sort(-1)[0].diff(dim=-1) > 0).all()  # k distinct experts


def test_routing_matches_a_float64_reference():
    """Group-limited V3 routing against a direct float64 formulation (groups by their two best corrected scores)."""
    cfg = _cfg(router_scoring="sigmoid", router_topk="noaux_tc", n_group=4, topk_group=2, router_bias=True,
               norm_topk_prob=True, routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(257, 16, generator=g), torch.randn(16, generator=g) * 0.3
    w, idx = select_experts(logits, cfg, bias)
    s = torch.sigmoid(logits.double())
    for r in range(257):
        c = s[r] + bias.double()
        groups = c.view(4, 4).topk(2, -1)[0].sum(-1).topk(2)[1].tolist()
        allowed = [e for e in range(16) if e // 4 in groups]
        chosen = sorted(allowed, key=lambda e: -float(c[e]))[:4]
        assert sorted(idx[r].tolist()) == sorted(chosen)
        ref = s[r, idx[r]] / s[r, idx[r]].sum() * 2.5
        assert torch.allclose(w[r].double(), ref, rtol=1e-6)


BAD = [
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("qwen2_moe", {"mlp_only_layers": "all"}, "mlp_only_layers"),
    ("qwen3_moe", {"moe_intermediate_size": 0}, "moe_intermediate_size"),
]


@pytest.mark.parametrize("family,patch,field", BAD, ids=[b[2] for b in BAD])
def test_bad_moe_config_names_the_field(family, patch, field):
    from tests.tiny_models import family_configs
    cls, _, kw = family_configs()[family]
    d = cls(**kw).to_dict()
    d.update(patch)
    with pytest.raises(TrapetumError) as e:
        config_from_hf(d)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_missing_expert_tensor_names_it(tmp_path):
    from safetensors.torch import load_file, save_file
    build("mixtral", tmp_path)
    f = tmp_path / "model.safetensors"
    t = load_file(f)
    gone = [k for k in t if "experts.3" in k and "layers.1" in k]
    assert gone
    for k in gone:
        del t[k]
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(TrapetumError) as e:
        trapetum.load(tmp_path).logits([3, 4, 5])
    assert "layers.1.mlp.experts.3" in str(e.value) and "\n" not in str(e.value)
    assert json.loads((tmp_path / "config.json").read_text())["num_local_experts"] == 4


def test_moe_families_listed():
    assert set(FAMS) <= set(MOE_FAMILIES)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_info_shows_experts_and_active_parameters(tmp_path, family):
    """trapetum info: the parameter count is transformers' (plus DeepSeek-V3's correction bias, a buffer there), the
    active count leaves out the unchosen experts of each MoE layer; the CLI prints both."""
    import os
    import subprocess
    import sys
    from trapetum.api import describe
    from trapetum.formats.detect import load_checkpoint
    hf = build(family, tmp_path)
    info = describe(load_checkpoint(tmp_path))
    cfg = load_checkpoint(tmp_path).config
    n_moe = cfg.mlp_types.count("moe")
    extra = n_moe * cfg.num_experts if cfg.router_bias else 0
    assert info["parameters"] == sum(p.numel() for p in hf.parameters()) + extra
    layer = f".layers.{cfg.mlp_types.index('moe')}."
    expert = sum(p.numel() for n, p in hf.named_parameters() if ".experts.0." in n and layer in n)
    if expert == 0:  # transformers 5 stacks a layer's experts: [E, ...] tensors
        expert = sum(p.numel() // cfg.num_experts for n, p in hf.named_parameters()
                     if ".experts." in n and layer in n and "shared" not in n)
    assert expert == 3 * cfg.hidden_size * cfg.moe_intermediate_size
    moe = info["moe"]
    assert moe["experts"] == 8 and moe["top_k"] == cfg.num_experts_per_tok
    assert moe["active_parameters_per_token"] == info["parameters"] - n_moe * (8 - moe["top_k"]) * expert
    assert ("mla" in info) == (family == "deepseek_v3")
    out = subprocess.run([sys.executable, "-m", "trapetum.cli", "info", str(tmp_path)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))), timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"{moe['active_parameters_per_token']:,} parameters per token" in out.stdout
    assert f"8 routed, top-{moe['top_k']}" in out.stdout
    assert ("kv_lora_rank 32" in out.stdout) == (family == "deepseek_v3")


def test_benchmark_shapes_of_the_issue():
    """eval/random_model's MoE shapes (bench_e2e --models deepseek-v2-lite / mixtral-8x7b): valid configs with the
    published sizes (no tensor is generated: they are lazy)."""
    from trapetum.api import describe
    from trapetum.eval.random_model import random_checkpoint
    v2 = describe(random_checkpoint("deepseek-v2-lite", "cb4", device="cpu"))
    assert round(v2["parameters"] / 1e9, 1) == 15.7 and v2["moe"]["top_k"] == 6 and v2["mla"]["kv_lora_rank"] == 512
    mx = describe(random_checkpoint("mixtral-8x7b", "cb4", device="cpu"))
    assert round(mx["parameters"] / 1e9, 1) == 46.7 and round(mx["moe"]["active_parameters_per_token"] / 1e9, 1) == 12.9
    two = random_checkpoint("deepseek-v2-lite", "cb4", device="cpu", layers=2)
    assert two.config.mlp_types == ["dense", "moe"]
    assert isinstance(two.tensors["model.layers.1.mlp.gate.weight"], torch.Tensor)  # routers stay dense
