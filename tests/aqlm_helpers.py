"""Tiny AQLM directories for tests: a tiny transformers model whose projections are quantized by our
additive quantizer (or filled with random codes) and saved in the Hugging Face AQLM layout."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tiny_models import build
from trapetum.formats.aqlm import _quant_config, write_aqlm_dir
from trapetum.kernels.additive_layout import index_to_codes
from trapetum.quant.additive import quantize_additive
from trapetum.formats.hf import _tokenizer

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def make_aqlm_dir(root: Path, family: str = "llama2", M: int = 2, nbits: int = 8, random_codes: bool = False,
                  seed: int = 0, iters: int = 1) -> Path:
    """A tiny HF model of ``family`` saved as an AQLM directory ``root/aqlm-<family>-<M>x<nbits>``."""
    src = root / f"hf-{family}"
    if not src.exists():
        build(family, src, seed=seed, tokenizer=True)
    cfg = json.loads((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    K = 1 << nbits
    for k, v in sd.items():
        p = k.rsplit(".", 1)[0]
        if k.endswith(".weight") and p.endswith(PROJ):
            o, i = v.shape
            if random_codes:
                codes = index_to_codes(torch.randint(0, K, (o, i // 8, M), generator=g), nbits)
                cb = (torch.randn(M, K, 1, 8, generator=g) * 0.5).half()
                sc = (torch.rand(o, 1, 1, 1, generator=g) * 0.1 + 0.01).half()
            else:
                r = quantize_additive(v.float(), None, num_codebooks=M, nbits=nbits, iters=iters, seed=seed,
                                      kmeans_iters=3)
                codes, cb, sc = r.codes, r.codebooks, r.scales
            out[p + ".codes"], out[p + ".codebooks"], out[p + ".scales"] = codes, cb, sc
        else:
            out[k] = v.half() if v.is_floating_point() and "norm" not in k else v
    not_q = ["lm_head.weight"]
    cfg["quantization_config"] = _quant_config({"num_codebooks": M, "nbits": nbits, "in_group_size": 8,
                                                "out_group_size": 1}, not_q)
    tok = _tokenizer(src, {})
    return write_aqlm_dir(root / f"aqlm-{family}-{M}x{nbits}{'-rand' if random_codes else ''}", cfg, out, tok)
