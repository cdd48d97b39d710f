"""Calibration statistics with one float64 square-sum per distinct projection input (q/k/v share one, gate/up
another): bit for bit the statistics of summing at every projection's hook (the code before the change, kept
here as the reference), for the whole-model and the layer-by-layer collectors, dense and MoE families."""
from __future__ import annotations

import pytest
import torch

import tiny_models
from trapetum.formats.detect import load_checkpoint
from trapetum.models.decoder import Decoder
from trapetum.quant import calibrate


class _EveryCall:
    """The reference: the square sums computed afresh at every hook."""
    calls = 0

    def __call__(self, x):
        type(self).calls += 1
        x2 = x.detach().double().pow(2).reshape(-1, x.shape[-1])
        return x2.sum(0), x2.shape[0]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for fam in ("llama3", "qwen2", "qwen3_moe"):
        d = tmp_path_factory.mktemp(fam)
        tiny_models.build(fam, d)
        out[fam] = load_checkpoint(str(d))
    return out


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3_moe"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_shared_square_sums_equal_per_hook_sums_bitwise(monkeypatch, ckpts, family, layerwise):
    ck = ckpts[family]
    toks = torch.randint(3, ck.config.vocab_size, (5, 19), generator=torch.Generator().manual_seed(1))

    def collect():
        if layerwise:
            return calibrate.collect_input_stats_layerwise(ck, toks, batch=2, progress=False)
        return calibrate.collect_input_stats(Decoder.from_checkpoint(ck).eval(), toks, batch=2, progress=False)

    fast = collect()
    with monkeypatch.context() as m:
        m.setattr(calibrate, "_SquareSums", _EveryCall)
        _EveryCall.calls = 0
        ref = collect()
    assert _EveryCall.calls > 0
    assert sorted(fast) == sorted(ref) and fast.counts == ref.counts
    for k in ref:
        assert torch.equal(fast[k], ref[k]), k


def test_square_sums_are_computed_once_per_input_and_afresh_after_a_change():
    ss = calibrate._SquareSums()
    x = torch.randn(2, 3, 5)
    a, n = ss(x)
    b, _ = ss(x)
    assert n == 6 and torch.equal(a, b) and a is not b  # a copy: a caller adding in place changes nothing here
    a += 1
    assert torch.equal(ss(x)[0], b)
    x.mul_(2)  # changed in place: summed again
    assert torch.allclose(ss(x)[0], b * 4)
    y = x.clone()
    assert torch.equal(ss(y)[0], ss(x)[0])
