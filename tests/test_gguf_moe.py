"""GGUF mixture-of-experts and latent-attention models (formats/gguf_moe.py): tiny GGUFs written with
gguf.GGUFWriter from the tiny HF models' weights the way llama.cpp's converter lays them out (stacked experts, the
shared expert, the router's correction bias, DeepSeek's kv_b whole or split into k_b / v_b), loaded and compared
with the HF load: every tensor exact, the config's MoE / MLA fields, the logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import trapetum  # noqa: E402
from tests.tiny_models import build  # noqa: E402
from trapetum.errors import ConfigError  # noqa: E402
from trapetum.formats.detect import load_checkpoint  # noqa: E402
from trapetum.formats.gguf import load_gguf  # noqa: E402

ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "deepseek_v2": "deepseek2",
        "deepseek_v3": "deepseek2"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
         "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
         "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
         "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj": "attn_kv_a_mqa",
         "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K row permutation for the llama arch."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(ck, arch: str, split_kv_b: bool) -> dict[str, np.ndarray]:
    """The canonical tensors of ``ck`` under llama.cpp's names and layouts."""
    cfg = ck.config
    out: dict[str, np.ndarray] = {}
    stacks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name in ck.tensors:
        t = ck.tensors[name].float().numpy()
        if not name.startswith("model.layers."):
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = t
            continue
        _, _, i, rest = name.split(".", 3)
        if ".experts." in rest:
            _, _, e, proj, _ = rest.split(".")
            stacks.setdefault((int(i), proj), {})[int(e)] = t
            continue
        if rest == "mlp.gate.e_score_correction_bias":
            out[f"blk.{i}.exp_probs_b.bias"] = t
            continue
        base, suffix = rest.rsplit(".", 1)
        if arch == "llama" and base in ("self_attn.q_proj", "self_attn.k_proj"):
            t = _permute(t, cfg.num_heads if "q_proj" in base else cfg.num_kv_heads)
        if base == "self_attn.kv_b_proj" and split_kv_b:
            H, nope, vd, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
            kv = t.reshape(H, nope + vd, r)
            out[f"blk.{i}.attn_k_b.weight"] = np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1))
            out[f"blk.{i}.attn_v_b.weight"] = np.ascontiguousarray(kv[:, nope:])
            continue
        out[f"blk.{i}.{LAYER[base]}.{suffix}"] = t
    for (i, proj), es in stacks.items():
        out[f"blk.{i}.ffn_{proj.split('_')[0]}_exps.weight"] = np.stack([es[e] for e in sorted(es)])
    return out


def write(path, family: str, ck, split_kv_b: bool = False, drop: str | None = None, meta_over=None):
    cfg, arch = ck.config, ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
            "feed_forward_length": cfg.intermediate_size, "block_count": cfg.num_layers,
            "attention.head_count": cfg.num_heads, "attention.head_count_kv": cfg.num_kv_heads,
            "attention.key_length": cfg.head_dim, "attention.value_length": cfg.v_head_dim or cfg.head_dim,
            "rope.freq_base": float(cfg.rope_theta), "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
            "vocab_size": cfg.vocab_size, "expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok,
            "expert_weights_norm": cfg.norm_topk_prob}
    if arch != "llama":
        meta["expert_feed_forward_length"] = cfg.moe_intermediate_size
    if arch == "qwen2moe":
        meta["expert_shared_feed_forward_length"] = cfg.shared_expert_intermediate_size
    if arch == "deepseek2":
        rs = cfg.rope_scaling
        meta.update({"attention.kv_lora_rank": cfg.kv_lora_rank, "rope.dimension_count": cfg.qk_rope_head_dim,
                     "expert_shared_count": cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size,
                     "leading_dense_block_count": cfg.mlp_types.index("moe"),
                     "expert_weights_scale": float(cfg.routed_scaling_factor),
                     "expert_gating_func": 2 if cfg.router_scoring == "sigmoid" else 1,
                     "expert_group_count": cfg.n_group, "expert_group_used_count": cfg.topk_group,
                     "rope.scaling.type": "yarn", "rope.scaling.factor": float(rs["factor"]),
                     "rope.scaling.original_context_length": rs["original_max_position_embeddings"],
                     "rope.scaling.yarn_log_multiplier": 0.1 * rs["mscale_all_dim"]})
        if cfg.q_lora_rank:
            meta["attention.q_lora_rank"] = cfg.q_lora_rank
    meta.update(meta_over or {})
    for k, v in meta.items():
        key = f"{arch}.{k}"
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        else:
            w.add_uint32(key, v)
    for n, t in gguf_tensors(ck, arch, split_kv_b).items():
        if n != drop:
            w.add_tensor(n, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


CASES = [("mixtral", False), ("qwen2_moe", False), ("qwen3_moe", False), ("deepseek_v2", False),
         ("deepseek_v2", True), ("deepseek_v3", True)]
FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "mlp_types", "router_scoring", "router_topk",
          "n_group", "topk_group", "router_bias", "norm_topk_prob", "routed_scaling_factor",
          "shared_expert_intermediate_size", "shared_expert_gate", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
          "v_head_dim", "head_dim", "num_kv_heads", "qkv_bias", "qk_norm", "rope_interleave")


@pytest.mark.parametrize("family,split", CASES, ids=[f"{f}{'-split_kv_b' if s else ''}" for f, s in CASES])
def test_gguf_twin_matches_the_hf_load(tmp_path, family, split):
    build(family, tmp_path / "hf")
    if family == "deepseek_v3":  # GGUF has one YaRN mscale (llama.cpp: mscale = mscale_all_dim): make them equal
        import json
        p = tmp_path / "hf" / "config.json"
        c = json.loads(p.read_text())
        rs = c.get("rope_parameters") or c["rope_scaling"]
        rs["mscale"] = rs["mscale_all_dim"]
        p.write_text(json.dumps(c))
    hf = load_checkpoint(tmp_path / "hf")
    g = load_gguf(write(tmp_path / "m.gguf", family, hf, split_kv_b=split))
    assert set(g.tensors) == set(hf.tensors)
    for n in hf.tensors:
        torch.testing.assert_close(g.tensors[n], hf.tensors[n].float(), rtol=0, atol=0, msg=n)
    for f in FIELDS:
        assert getattr(g.config, f) == getattr(hf.config, f), f
    assert g.config.scale == pytest.approx(hf.config.scale, rel=1e-6)
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b = trapetum.load(tmp_path / "m.gguf").logits(ids), trapetum.load(tmp_path / "hf").logits(ids)
    assert float((a - b).abs().max() / b.abs().max()) < 1e-5


@pytest.mark.parametrize("family,drop,over,field", [
    ("qwen3_moe", "blk.1.ffn_up_exps.weight", None, "mlp.experts.0.up_proj"),
    ("deepseek_v2", "blk.0.attn_v_b.weight", None, "attn_v_b"),
    ("mixtral", None, {"expert_used_count": 9}, "num_experts_per_tok"),
    ("deepseek_v2", None, {"attention.kv_lora_rank": 16}, "kv_lora_rank"),
    ("deepseek_v3", None, {"expert_group_used_count": 5}, "topk_group"),
])
def test_bad_gguf_names_the_field(tmp_path, family, drop, over, field):
    build(family, tmp_path / "hf")
    hf = load_checkpoint(tmp_path / "hf")
    p = write(tmp_path / "m.gguf", family, hf, split_kv_b=family == "deepseek_v2", drop=drop, meta_over=over)
    with pytest.raises(ConfigError) as e:
        load_gguf(p)
    assert field in str(e.value) and "\n" not in str(e.value)
