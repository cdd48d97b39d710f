"""Tiny random Hugging Face models of every supported family, saved as safetensors directories."""
from __future__ import annotations

import torch

VOCAB = 256


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
    }


FAMILIES = list(family_configs())


def build(family: str, path, seed: int = 0):
    """Save a tiny random model of ``family`` to ``path``; return the HF model (fp32, eval)."""
    cfg_cls, model_cls, kw = family_configs()[family]
    torch.manual_seed(seed)
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).eval()
    with torch.no_grad():  # make norms non-trivial so offsets and placement matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif "bias" in n:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model
