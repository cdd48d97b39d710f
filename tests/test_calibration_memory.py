"""Bounded-memory sampled calibration (issue 3: "a 70B source must not need its full size in RAM").

* ``calibrate.streamed_decoder`` (one block, or the embedding, or the head in memory at a time)
  samples exactly the tokens the whole fp32 model samples: same seed, same sampling code, same
  float32 operations; for dense sources of several families and for a quantized ``.cbk`` source.
"""
from __future__ import annotations

import pytest
import torch

import tiny_models
from test_quantize import _tiny_llama
from trapetum.api import load_checkpoint
from trapetum.models.decoder import Decoder
from trapetum.quant import calibrate
from trapetum.quant.quantize import Recipe, quantize_to_cbk

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("tiny"), tie=True)


@pytest.fixture(scope="module")
def family_ckpt(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            d = tmp_path_factory.mktemp(family)
            tiny_models.build(family, d)
            cache[family] = load_checkpoint(str(d))
        return cache[family]
    return get


def _both(ck, bos, seed=0, n=4, length=24):
    kw = {"n_seqs": n, "seq_len": length, "seed": seed, "progress": False}
    full = calibrate.sampled_calibration_tokens(Decoder.from_checkpoint(ck).eval(), bos, **kw)
    streamed = calibrate.sampled_calibration_tokens(calibrate.streamed_decoder(ck), bos, **kw)
    return full, streamed


# untied; tied + qkv bias; softcaps, sliding window, sandwich norms, embedding scale
@pytest.mark.parametrize("family", ["llama3", "qwen2", "gemma2"])
@pytest.mark.parametrize("bos", [1, None])
def test_streamed_sampler_equals_full_sampler(family_ckpt, family, bos):
    full, streamed = _both(family_ckpt(family), bos, seed=7)
    assert full.shape == (4, 24) and len(set(full.flatten().tolist())) > 10  # really sampled
    assert torch.equal(full, streamed)


def test_streamed_sampler_equals_full_sampler_on_a_cbk_source(tiny_dir, tmp_path):
    # quantized records: codebook projections, one 8-bit table shared by embedding and head
    recipe = Recipe(bits=4, head_bits=8, weighted=False, calib="none", iters=3)
    path, _ = quantize_to_cbk(str(tiny_dir), tmp_path / "q.cbk", recipe, progress=False, log=lambda s: None)
    full, streamed = _both(load_checkpoint(str(path)), 1)
    assert torch.equal(full, streamed)
