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
    }


FAMILIES = list(family_configs())


def build(family: str, path, seed: int = 0, tokenizer: bool = False):
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


def build_cbk(family: str, tmp_path, iters: int = 5) -> Path:
    """A tiny ``family`` model saved under tmp_path/src and quantized (4-bit projections, 8-bit head,
    unweighted, ``iters`` k-means rounds) to tmp_path/m.cbk; returns the .cbk path."""
    from trapetum.quant.quantize import Recipe, quantize_to_cbk
    build(family, Path(tmp_path) / "src")
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
