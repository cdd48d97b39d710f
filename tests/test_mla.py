"""Multi-head latent attention families against transformers (fp32): DeepSeek-V2 (no q_lora, group-limited greedy
routing, YaRN with mscale == mscale_all_dim) and DeepSeek-V3 (q_lora, sigmoid scores with the correction bias,
noaux_tc groups, YaRN with mscale != mscale_all_dim); prompts past the original context; the latent KV cache; the
one-line errors of bad latent-attention configs."""
import pytest

import trapetum
from tests.hf_compare import (assert_decode_equals_prefill, assert_greedy_match, assert_logits_match,
                              assert_verify_rows_are_decode_steps, build_models, prompt)
from tests.tiny_models import MOE_FAMILIES, build, family_configs
from trapetum.errors import TrapetumError
from trapetum.models.families import config_from_hf

FAMS = ["deepseek_v2", "deepseek_v3"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory, FAMS)


@pytest.mark.parametrize("family", FAMS)
def test_logits_and_greedy_match_hf(models, family):
    """Prompts inside and past original_max_position_embeddings (64 for V2, 32 for V3): YaRN changes nothing there
    but every frequency is already the scaled one, so both lengths check it."""
    _, hf, m = models[family]
    for n in (24, 80):
        assert_logits_match(m, hf, prompt(n, n))
    assert_greedy_match(m, hf, prompt(40, 2), 16)  # V3: 40 + 16 past its original 32


@pytest.mark.parametrize("family", FAMS)
def test_decode_equals_prefill_and_verify_rows(models, family):
    _, _, m = models[family]
    assert_decode_equals_prefill(m, prompt(20, 3))
    assert_verify_rows_are_decode_steps(m)


def test_config_and_latent_cache(models):
    v2, v3 = models["deepseek_v2"][2].config, models["deepseek_v3"][2].config
    assert (v2.q_lora_rank, v3.q_lora_rank, v2.kv_lora_rank, v2.head_dim, v2.num_kv_heads) == (0, 24, 32, 24, 4)
    assert (v2.router_topk, v2.router_scoring, v2.norm_topk_prob) == ("group_limited_greedy", "softmax", False)
    assert (v3.router_topk, v3.router_scoring, v3.router_bias, v3.norm_topk_prob) == ("noaux_tc", "sigmoid", True, True)
    assert [v2.block_kinds(i) for i in range(3)] == [("mla", "mlp"), ("mla", "moe"), ("mla", "moe")]
    assert v3.shared_expert_intermediate_size == 32
    # softmax scale: hd^-0.5 times mscale(8, 0.8)^2 (V3); V2's mscale_all_dim 0.707 at factor 4
    import math
    ms = 0.1 * 0.8 * math.log(8.0) + 1.0
    assert v3.scale == pytest.approx(24 ** -0.5 * ms * ms)
    cache = models["deepseek_v3"][2].decoder.new_cache(1, 16)
    assert cache.k[0].shape == (1, 1, 16, 32 + 8) and cache.v[0].shape == (1, 1, 16, 0)


def _hf_dict(family, **patch):
    cls, _, kw = family_configs()[family]
    d = cls(**kw).to_dict()
    d.update(patch)
    return d


BAD = [
    ("deepseek_v2", {"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ("deepseek_v2", {"kv_lora_rank": None}, "kv_lora_rank"),
    ("deepseek_v3", {"q_lora_rank": -4}, "q_lora_rank"),
    ("deepseek_v3", {"v_head_dim": 0}, "v_head_dim"),
    ("deepseek_v3", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("deepseek_v3", {"n_group": 3}, "n_group"),
    ("deepseek_v3", {"topk_group": 5}, "topk_group"),
    ("deepseek_v2", {"moe_layer_freq": 0}, "moe_layer_freq"),
]


@pytest.mark.parametrize("family,patch,field", BAD, ids=[f"{b[0]}-{b[2]}" for b in BAD])
def test_bad_config_names_the_field(family, patch, field):
    with pytest.raises(TrapetumError) as e:
        config_from_hf(_hf_dict(family, **patch))
    assert field in str(e.value) and "\n" not in str(e.value)


def test_inconsistent_lora_rank_in_the_weights_is_refused(tmp_path):
    """config.json's kv_lora_rank disagreeing with kv_b_proj's columns: a one-line error naming the tensor."""
    import json
    build("deepseek_v2", tmp_path)
    p = tmp_path / "config.json"
    cfg = json.loads(p.read_text())
    cfg["kv_lora_rank"] = 16
    p.write_text(json.dumps(cfg))
    with pytest.raises(TrapetumError) as e:
        trapetum.load(tmp_path).logits([3, 4, 5])
    assert "kv_" in str(e.value) and "\n" not in str(e.value)


def test_mla_families_listed():
    assert set(FAMS) <= set(MOE_FAMILIES)
