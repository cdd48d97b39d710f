"""The shapes and the benchmark of issue 18 item 4 on the CPU (eval/random_model.py, eval/bench_offload.py): the
DeepSeek-V3 shape is the published config.json as config_from_hf parses it, and routes as DeepSeek's own noaux_tc
(float64 reference, 8 groups, top 4); the random checkpoints' sizes computed from shapes equal the generated
tensors' engine bytes; the Llama-2-70B 2x8 plan (fits 24 GiB whole; a fake budget moves the embedding, nothing
else); the benchmark end to end at tiny widths on the CPU engine (torch fallbacks): a DeepSeek-V3-like slice with
its experts in host RAM and a dense 2x8 model with its embedding there give the all-on-device greedy tokens, the
per-layer times add up and the extrapolation is their arithmetic. The H200 runs: BENCHMARKS.md."""
import json
import math

import pytest
import torch

from trapetum.eval import bench_offload as bo
from trapetum.eval.random_model import FORMATS, random_checkpoint, random_sizes, shape_config
from trapetum.kernels import host_gemv as hg
from trapetum.models.blocks.moe import select_experts
from trapetum.models.families import config_from_hf
from trapetum.runtime import placement as pl

G = pl.GIB
# deepseek-ai/DeepSeek-V3 config.json (the fields config_from_hf reads; quantization_config left out)
V3_CONFIG = json.loads("""{"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false,
 "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
 "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
 "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
 "norm_topk_prob": true, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
 "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
 "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
 "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
 "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": false,
 "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280}""")

# DeepSeek-V3's structure at tiny widths: MLA with q_lora, 16 experts in 8 groups (top 4), top-4, 1 shared
TINY_V3 = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=6, num_heads=4, num_kv_heads=4,
               head_dim=24, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=16,
               num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
               mlp_types=["dense"] * 2 + ["moe"] * 4, attn_scale=24 ** -0.5)
TINY_DENSE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)


def test_deepseek_v3_shape_is_the_published_config():
    cfg = shape_config("deepseek-v3")
    assert cfg == config_from_hf(V3_CONFIG)
    assert (cfg.mlp_types.count("dense"), cfg.mlp_types.count("moe")) == (3, 58) and cfg.mlp_types[:3] == ["dense"] * 3
    sl = shape_config("deepseek-v3", layers=5)
    assert sl.mlp_types == ["dense"] * 3 + ["moe"] * 2 and sl.num_experts == 256 and sl.hidden_size == 7168


def _noaux_tc_reference(logits: torch.Tensor, bias: torch.Tensor, cfg) -> list[dict[int, float]]:
    """DeepSeek-V3's gate (its inference/model.py) in float64, one row at a time: sigmoid scores; bias-corrected
    for the choice; groups ranked by the sum of their two best; the topk_group best groups; the k best experts in
    them; their uncorrected scores renormalized, times routed_scaling_factor. {expert: weight} per row."""
    out = []
    per = cfg.num_experts // cfg.n_group
    for row in logits.double():
        s = torch.sigmoid(row)
        c = (s + bias.double()).tolist()
        groups = sorted(range(cfg.n_group), key=lambda g: -sum(sorted(c[g * per:(g + 1) * per])[-2:]))
        allowed = [e for g in groups[:cfg.topk_group] for e in range(g * per, (g + 1) * per)]
        chosen = sorted(allowed, key=lambda e: -c[e])[:cfg.num_experts_per_tok]
        total = sum(float(s[e]) for e in chosen)
        out.append({e: float(s[e]) / total * cfg.routed_scaling_factor for e in chosen})
    return out


def test_deepseek_v3_routing_is_noaux_tc_over_8_groups():
    cfg = shape_config("deepseek-v3")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 256, generator=g) * 2
    bias = torch.randn(256, generator=g) * 0.5  # negative corrected scores too
    w, idx = select_experts(logits, cfg, bias)
    assert w.shape == idx.shape == (200, 8)
    want = _noaux_tc_reference(logits, bias, cfg)
    for m in range(200):
        got = dict(zip(idx[m].tolist(), w[m].tolist()))
        assert set(got) == set(want[m]), m
        assert len({e // 32 for e in got}) <= 4
        for e, x in want[m].items():
            assert got[e] == pytest.approx(x, rel=1e-5)
        assert sum(got.values()) == pytest.approx(2.5, rel=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape, ov, layers", [("llama2-70b", TINY_DENSE, None), ("deepseek-v3", TINY_V3, 3),
                                               ("deepseek-v2-lite", {k: v for k, v in TINY_V3.items()
                                                                     if k != "q_lora_rank"}, None)])
def test_random_sizes_are_the_generated_tensors_engine_bytes(shape, ov, layers, fmt):
    ck = random_checkpoint(shape, fmt, device="cpu", layers=layers, overrides=ov)
    assert random_sizes(shape, fmt, layers, ov) == pl.checkpoint_sizes(ck)


def test_llama2_70b_2x8_fits_24_gib_and_a_smaller_budget_moves_the_embedding():
    """18.2 GB of 2x8 weights (fp16 embedding and head): under 24 GiB at the full context of 4,096 positions the
    plan keeps everything on the GPU; a budget between the needs with and without the table moves only the table;
    below, the refusal."""
    cfg = shape_config("llama2-70b")
    sizes = random_sizes("llama2-70b", "aqlm-2x8")
    assert 18.0e9 < sum(sizes.values()) < 18.4e9 and sizes[pl.EMBED] == 32000 * 8192 * 2
    kv = pl.kv_bytes(cfg, 4096)
    p = pl.plan(sizes, cfg, kv, 24 * G)
    assert not p.offloads and p.gpu_bytes + p.kv_bytes + p.margin < 19.2 * G
    need = bo.needs(sizes, cfg, kv, tied=False)
    assert list(need) == ["everything on the GPU", "embedding in host RAM"]
    assert need["everything on the GPU"] - need["embedding in host RAM"] == pytest.approx(sizes[pl.EMBED] / G)
    mid = (need["everything on the GPU"] + need["embedding in host RAM"]) / 2
    p = pl.plan(sizes, cfg, kv, int(mid * G))
    assert p.embed_host and not p.experts_host and p.gpu_bytes + p.kv_bytes + p.margin <= p.budget
    with pytest.raises(pl.PlacementError, match="even with its embedding in host RAM"):
        pl.plan(sizes, cfg, kv, int((need["embedding in host RAM"] - 0.01) * G))


def test_deepseek_v3_experts_outgrow_this_kind_of_host():
    """The whole V3 at 4 bits: 332 GB of routed experts (5.73 GB a MoE layer): the benchmark runs slices."""
    sizes = random_sizes("deepseek-v3", "cb4")
    experts = sum(n for k, n in sizes.items() if pl.is_routed_expert(k))
    assert 330e9 < experts < 335e9 and math.isclose(experts / 58, 5.729e9, rel_tol=1e-3)


pytestmark = pytest.mark.usefixtures("torch_fallbacks", "one_thread")
needs_host = pytest.mark.skipif(not hg.available(), reason=f"host kernels unavailable: {hg.error()}")


@needs_host
def test_bench_v3_slice_with_host_experts_on_the_cpu():
    """3 of 6 layers (2 dense, 1 MoE): the host-experts row decodes the gpu row's tokens; the synced per-layer
    times add up to the synced step; the extrapolation is embedding + head + 2 dense + 4 MoE means."""
    r = bo.run("deepseek-v3", "cb4", layers=3, steps=4, per_layer=True, device="cpu", overrides=TINY_V3)
    assert list(r["rows"]) == ["gpu", "gpu-eager", "host-experts"] and r["placed"] == "forced"
    hx = r["rows"]["host-experts"]
    assert hx["same_tokens"] == "4/4" and r["rows"]["gpu-eager"]["same_tokens"] == "4/4"
    assert hx["host_layers"] == 1 and hx["host_weight_gb"] > 0 and 0 < hx["host_ms"] < hx["step_ms"]
    p = hx["per_layer"]
    assert [x["kind"] for x in p["layers"]] == ["dense", "dense", "moe"]
    parts = p["embed_ms"] + p["head_ms"] + sum(x["ms"] for x in p["layers"])
    assert parts == pytest.approx(p["step_ms"], rel=1e-6)
    moe = p["layers"][2]
    assert 0 < moe["host_ms"] < moe["ms"] and moe["host_bytes"] > 0
    e = r["extrapolation"]
    dense = (p["layers"][0]["ms"] + p["layers"][1]["ms"]) / 2
    assert (e["layers"], e["dense"], e["moe"]) == (6, 2, 4)
    assert e["step_ms"] == pytest.approx(p["embed_ms"] + p["head_ms"] + 2 * dense + 4 * moe["ms"])
    assert e["host_mb_per_token"] == pytest.approx(4 * moe["host_bytes"] / 1e6)
    full = random_sizes("deepseek-v3", "cb4", None, TINY_V3)
    assert e["expert_host_gb"] == pytest.approx(sum(n for k, n in full.items() if pl.is_routed_expert(k)) / 1e9)
    text = bo.markdown(r)
    assert "| host-experts |" in text and "EXTRAPOLATED, not measured" in text and "6 layers: 2 dense, 4 MoE" in text


@pytest.mark.parametrize("fmt", ["cb4", "fp16"])
def test_bench_dense_model_under_a_fake_budget_moves_the_embedding(fmt):
    """A budget between the needs with and without the table: the planner puts the embedding in host RAM, the
    tokens are the gpu row's; a roomy budget keeps everything, so the row is forced and says why. (2x8 has no
    torch fallback, and its interpreted engine takes most of a minute: its plan is tested above on the sizes, its
    engine with the table in host RAM on the H200; the embedding path does not depend on the projections' scheme.)"""
    cfg = shape_config("llama2-70b", overrides=TINY_DENSE)
    sizes = random_sizes("llama2-70b", fmt, overrides=TINY_DENSE)
    max_len = bo.PROMPT + bo.WARMUP + 4 + 16
    need = bo.needs(sizes, cfg, pl.kv_bytes(cfg, max_len), tied=False)
    mid = (need["everything on the GPU"] + need["embedding in host RAM"]) / 2
    r = bo.run("llama2-70b", fmt, steps=4, gpu_mem=mid, device="cpu", overrides=TINY_DENSE)
    assert list(r["rows"]) == ["gpu", "embed-host"] and r["placed"].startswith("planned under --gpu-mem")
    row = r["rows"]["embed-host"]
    assert row["same_tokens"] == "4/4" and row["host_mb_per_token"] == pytest.approx(64 * 2 / 1e6)
    assert row["host_weight_gb"] == pytest.approx(256 * 64 * 2 / 1e9)
    text = bo.markdown(r)
    assert "GPU budget needed: everything on the GPU" in text and "| embed-host |" in text
    r = bo.run("llama2-70b", fmt, steps=2, gpu_mem=1000, device="cpu", overrides=TINY_DENSE, gpu=False)
    assert list(r["rows"]) == ["embed-host"] and "keeps everything on the GPU" in r["placed"]


def test_bench_refuses_a_slice_larger_than_the_host_ram(monkeypatch):
    monkeypatch.setattr(bo, "_available_host_bytes", lambda: 10 ** 4)
    with pytest.raises(bo.BenchError) as e:
        bo.run("deepseek-v3", "cb4", layers=3, steps=1, device="cpu", overrides=TINY_V3)
    assert "\n" not in str(e.value) and "use fewer --layers" in str(e.value)
