"""Tiny random Hugging Face models of every supported family, saved as safetensors directories."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
TEXT = "/work/shared/data/tinyshakespeare/input.txt"


def save_tokenizer(path, vocab=VOCAB):
    """Train a small byte-level BPE tokenizer and save HF tokenizer files next to a tiny model."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    try:
        text = Path(TEXT).read_text()[:60000]
    except OSError:
        text = "the quick brown fox jumps over the lazy dog. " * 200
    tk.train_from_iterator([text], trainer)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", 1)])
    path = Path(path)
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))
    return tk


def family_configs():
    import transformers as T
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {
        "llama2": (T.LlamaConfig, T.LlamaForCausalLM, dict(common, num_key_value_heads=4)),
        "llama3": (T.LlamaConfig, T.LlamaForCausalLM, dict(
            common, rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(common, sliding_window=8)),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(common, tie_word_embeddings=True)),
        "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(
            common, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, num_hidden_layers=4)),
        "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(
            common, head_dim=16, sliding_window=8, query_pre_attn_scalar=16, num_hidden_layers=7,
            rope_local_base_freq=10000.0, rope_theta=1000000.0)),
        "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(common)),
        **moe_family_configs(common),
        **rope_family_configs(common),
    }


def moe_family_configs(common: dict) -> dict:
    """Mixture-of-experts and latent-attention families (issue 17): every routing variant, dense layers among the
    experts, shared experts, MLA with and without q_lora, YaRN with mscale / mscale_all_dim."""
    import transformers as T
    mla = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)
    ds = dict(common, **mla, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
              first_k_dense_replace=1)
    return {
        "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(common, num_local_experts=4, num_experts_per_tok=2)),
        "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, dict(
            common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            mlp_only_layers=[1], norm_topk_prob=False)),
        "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(
            common, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
            decoder_sparse_step=2, num_hidden_layers=4)),
        # DeepSeek-V2: no q_lora, group-limited greedy routing, YaRN with mscale == mscale_all_dim (V2's values)
        "deepseek_v2": (T.DeepseekV2Config, T.DeepseekV2ForCausalLM, dict(
            ds, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                          "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})),
        # DeepSeek-V3: q_lora, sigmoid scores with the correction bias, noaux_tc groups, renormalized and scaled;
        # YaRN with mscale != mscale_all_dim (an attention factor on cos / sin besides the softmax scale)
        "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, dict(
            ds, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
            rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                          "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})),
    }


def rope_family_configs(common: dict) -> dict:
    """Dense families with the RoPE variants (issue 17): longrope on a partial rotary (Phi-4-mini's form), YaRN,
    dynamic NTK; each original context is shorter than the test prompts."""
    import transformers as T
    g = torch.Generator().manual_seed(5)
    half = int(16 * 0.75) // 2
    short = (1.0 + torch.rand(half, generator=g)).tolist()
    long = (1.0 + 8 * torch.rand(half, generator=g)).tolist()
    return {
        "phi3_longrope": (T.Phi3Config, T.Phi3ForCausalLM, dict(
            common, partial_rotary_factor=0.75, original_max_position_embeddings=64,
            rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long})),
        "qwen2_yarn": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(
            common, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})),
        "llama_dynamic": (T.LlamaConfig, T.LlamaForCausalLM, dict(
            common, max_position_embeddings=48, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    }


MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
ROPE_FAMILIES = ["phi3_longrope", "qwen2_yarn", "llama_dynamic"]
# the dense families every suite runs (the families above have their own: tests/test_moe*.py, test_mla*, test_rope*)
FAMILIES = [f for f in family_configs() if f not in MOE_FAMILIES + ROPE_FAMILIES]


def build(family: str, path, seed: int = 0, tokenizer: bool = False, overrides: dict | None = None):
    """Save a tiny random model of ``family`` (config fields ``overrides`` replaced) to ``path``; return the HF
    model (fp32, eval)."""
    cfg_cls, model_cls, kw = family_configs()[family]
    torch.manual_seed(seed)
    cfg = cfg_cls(**dict(kw, **(overrides or {})))
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).eval()
    with torch.no_grad():  # make norms non-trivial so offsets and placement matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif "bias" in n:
                p.normal_(0, 0.1)
            elif n.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)  # decisive routing: no near-ties for an fp16 engine to flip
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        save_tokenizer(path)
    return model


def build_families(tmp_path_factory, families=None) -> dict:
    """One saved tiny model per family under the pytest tmp_path_factory: {family: directory}."""
    out = {}
    for fam in families or FAMILIES:
        d = tmp_path_factory.mktemp(fam)
        build(fam, d)
        out[fam] = d
    return out


def build_cbk(family: str, tmp_path, iters: int = 5, overrides: dict | None = None) -> Path:
    """A tiny ``family`` model (``build``'s overrides) saved under tmp_path/src and quantized (4-bit projections,
    8-bit head, unweighted, ``iters`` k-means rounds) to tmp_path/m.cbk; returns the .cbk path."""
    from trapetum.quant.quantize import Recipe, quantize_to_cbk
    build(family, Path(tmp_path) / "src", overrides=overrides)
    out = Path(tmp_path) / "m.cbk"
    quantize_to_cbk(str(Path(tmp_path) / "src"), out, Recipe(bits=4, head_bits=8, weighted=False, iters=iters).validate(),
                    progress=False, log=lambda s: None)
    return out


def additive_checkpoint(family: str, path, fmt: str = "aqlm-2x8", seed: int = 0, device: str = "cuda"):
    """A tiny ``family`` checkpoint saved at ``path`` whose attention and MLP projections are replaced by random AQLM
    records of the same shapes (eval/random_model.random_aqlm, seeded): a 2-bit model without a quantizer run."""
    import torch

    from trapetum.eval.random_model import random_aqlm
    from trapetum.formats.detect import load_checkpoint
    build(family, path)
    ck = load_checkpoint(path)
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = dict(ck.tensors.items())
    for name, t in list(tensors.items()):
        if name.endswith("_proj.weight"):
            tensors[name] = random_aqlm(t.shape[0], t.shape[1], fmt, device, g)
    ck.tensors = tensors
    return ck
