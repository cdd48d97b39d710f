"""Tiny models and raw-file helpers for the .cbk tests."""
from __future__ import annotations

import json
import struct

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from trapetum.models.schema import expected_shapes
from trapetum.models.config import ModelConfig
from trapetum.schemes.record import QuantRecord
from trapetum.tokenizer import Tokenizer


def tiny_config(**over) -> ModelConfig:
    kw = dict(family="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    kw.update(over)
    return ModelConfig(**kw)


def tiny_tokenizer() -> Tokenizer:
    words = ["<unk>", "<s>", "</s>", "hello", "world", "the", "cat", "sat", "on", "mat", "é", "日本"]
    tk = HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = Whitespace()
    return Tokenizer(tk, bos_token="<s>", eos_tokens=["</s>"],
                     chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
                     extra_special={"unk_token": "<unk>"})


def codebook_record(shape, bits=4, gen=None, bias=False) -> QuantRecord:
    out, inp = shape
    k = 2 ** bits
    codes = torch.randint(0, 256, (out, inp * bits // 8), dtype=torch.uint8, generator=gen)
    codebook = torch.randn(out, k, generator=gen).to(torch.float16)
    b = torch.randn(out, generator=gen).to(torch.float16) if bias else None
    return QuantRecord("codebook", (out, inp), {"bits": bits, "layout": "row-major"},
                       {"codes": codes, "codebook": codebook}, b)


def tiny_model(cfg: ModelConfig | None = None, seed: int = 0, quantize=("self_attn.q_proj", "mlp.down_proj")):
    """(config, dense, quantized): projections whose names end with one of ``quantize`` become
    codebook records (the LM head 8-bit), every other tensor stays dense in mixed dtypes."""
    cfg = cfg or tiny_config()
    gen = torch.Generator().manual_seed(seed)
    dense, quantized = {}, {}
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    for i, (name, shape) in enumerate(expected_shapes(cfg).items()):
        stem = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and (stem.endswith(quantize) or name == "lm_head.weight"):
            quantized[name] = codebook_record(shape, 8 if name == "lm_head.weight" else 4, gen,
                                              bias=stem.endswith("q_proj") and cfg.qkv_bias)
        elif not (name.endswith(".bias") and stem + ".weight" in quantized):
            dense[name] = torch.randn(shape, generator=gen).to(dtypes[i % 3])
    return cfg, dense, quantized


def split_file(data: bytes):
    """(header dict, data bytes) of a safetensors file."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def join_file(header, body: bytes, pad: bool = True) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def big_model(seed: int = 0):
    """A model of a few MB so that a write takes tens of milliseconds (kill test)."""
    cfg = tiny_config(vocab_size=2048, hidden_size=256, intermediate_size=512, num_layers=4,
                      num_heads=4, num_kv_heads=4, head_dim=64)
    return tiny_model(cfg, seed)
