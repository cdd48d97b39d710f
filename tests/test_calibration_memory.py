"""Bounded-memory sampled calibration (issue 3: "a 70B source must not need its full size in RAM").

* ``calibrate.streamed_decoder`` (one block, or the embedding, or the head in memory at a time)
  samples exactly the tokens the whole fp32 model samples: same seed, same sampling code, same
  float32 operations; for dense sources of several families and for a quantized ``.cbk`` source.
* Over the memory budget (``mem_budget_gb``), ``calibration_stats`` and ``quantize_to_cbk`` take the
  bounded path: the whole model is never built (``Decoder.from_checkpoint`` only ever sees one-block or
  block-less views, each dropped before the next is built) and the statistics equal those of the
  whole-model path.
* The budget: the parameter, else half of the free memory; the library never reads the environment:
  ``trapetum quantize`` passes ``Options.from_env().calib_mem_gb`` (TRAPETUM_CALIB_MEM_GB). The fp32 size
  estimate is that of the decoder ``Decoder.from_checkpoint`` builds.
"""
from __future__ import annotations

import weakref

import pytest
import torch

import tiny_models
from test_quantize import _tiny_llama
from trapetum import cli
from trapetum.errors import ConfigError
from trapetum.formats.detect import load_checkpoint
from trapetum.models.decoder import Decoder
from trapetum.quant import calibrate
from trapetum.quant.quantize import Recipe, calibration_stats, quantize_to_cbk
from trapetum.settings import Options

RECIPE = {"calib_seqs": 3, "calib_sample_len": 20, "iters": 5}


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


def _spy_builds(monkeypatch):
    """Decoder.from_checkpoint, watched: refuses a view with more than one block, and records how many
    decoders it built are alive at once (a built part must be dropped before the next is built)."""
    real = Decoder.from_checkpoint.__func__
    seen = {"calls": 0, "peak": 0, "alive": []}

    def spy(cls, ck, *a, **k):
        assert ck.config.num_layers <= 1, f"the whole model ({ck.config.num_layers} blocks) was built"
        seen["alive"] = [r for r in seen["alive"] if r() is not None]
        dec = real(cls, ck, *a, **k)
        seen["alive"].append(weakref.ref(dec))
        seen["calls"] += 1
        seen["peak"] = max(seen["peak"], len(seen["alive"]))
        return dec
    monkeypatch.setattr(Decoder, "from_checkpoint", classmethod(spy))
    return seen


@pytest.fixture
def spy_builds(monkeypatch):
    return _spy_builds(monkeypatch)


def test_over_budget_stats_are_bounded_and_equal_the_whole_model_stats(tiny_dir, monkeypatch):
    monkeypatch.setenv(calibrate.MEM_ENV, "0.000001")  # read by the CLI only: no effect here
    ck = load_checkpoint(str(tiny_dir))
    recipe = Recipe(**RECIPE)
    logs: list[str] = []
    full = calibration_stats(ck, recipe, progress=False, log=logs.append, mem_budget_gb=1e6)
    assert not any("over the memory budget" in s for s in logs) and "whole model" in logs[-1]
    logs.clear()
    with monkeypatch.context() as m:
        seen = _spy_builds(m)
        bounded = calibration_stats(ck, recipe, progress=False, log=logs.append, mem_budget_gb=1e-6)
    assert "over the memory budget" in logs[0] and "SLOW" in logs[0] and "layer by layer" in logs[-1]
    assert seen["peak"] == 1 and seen["calls"] > ck.config.num_layers * (RECIPE["calib_sample_len"] - 1)
    assert sorted(full) == sorted(bounded) and len(full) == 2 * 7 + 1
    for k in full:
        assert torch.allclose(full[k], bounded[k], rtol=1e-5, atol=1e-8), k


def test_quantize_to_cbk_over_the_budget_never_builds_the_whole_model(tiny_dir, tmp_path, spy_builds):
    logs: list[str] = []
    recipe = Recipe(bits=4, head_bits=8, **RECIPE)
    path, qm = quantize_to_cbk(str(tiny_dir), tmp_path / "b.cbk", recipe, progress=False, log=logs.append,
                               mem_budget_gb=1e-6)
    assert path.is_file() and any("over the memory budget" in s for s in logs)
    assert spy_builds["peak"] == 1 and spy_builds["calls"] > 0
    assert all(0 <= r["rel_err"] < 0.2 for r in qm.report)


def test_memory_budget_and_size_estimate(tiny_dir, family_ckpt, monkeypatch):
    monkeypatch.delenv(calibrate.MEM_ENV, raising=False)
    free = calibrate.memory_budget("cpu")
    assert 0 < free < float("inf")  # half of MemAvailable
    budget = Options.from_env({calibrate.MEM_ENV: "2.5"}).calib_mem_gb  # what the CLI passes
    assert calibrate.memory_budget("cpu", budget) == 2.5e9
    assert calibrate.memory_budget("cpu", budget_gb=1) == 1e9  # the parameter wins
    monkeypatch.setattr(calibrate, "_free_bytes", lambda device: 8e9)
    monkeypatch.setenv(calibrate.MEM_ENV, "2.5")
    assert calibrate.memory_budget("cpu") == 4e9  # the library does not read the environment
    with pytest.raises(ConfigError, match=calibrate.MEM_ENV):
        Options.from_env({calibrate.MEM_ENV: "lots"})
    for ck in (load_checkpoint(str(tiny_dir)), family_ckpt("llama3")):  # tied and untied
        params = {p.data_ptr(): p.numel() for p in Decoder.from_checkpoint(ck).parameters()}
        assert calibrate.model_fp32_bytes(ck) == 4 * sum(params.values())


class _Called(Exception):
    pass


@pytest.mark.parametrize("scheme, driver", [("scalar", "trapetum.quant.quantize.quantize_to_cbk"),
                                            ("aqlm-2x8", "trapetum.quant.additive_driver.quantize_additive_to_cbk")])
def test_quantize_command_passes_the_env_budget(tmp_path, monkeypatch, capsys, scheme, driver):
    seen = {}

    def spy(*a, **k):
        seen.update(k)
        raise _Called
    monkeypatch.setattr(driver, spy)
    (tmp_path / "src").mkdir()  # quantize checks that the source exists before anything else (issue 22)
    argv = ["quantize", str(tmp_path / "src"), "-o", str(tmp_path / "o.cbk"), "--scheme", scheme, "--quiet"]
    monkeypatch.setenv(calibrate.MEM_ENV, "0.5")
    with pytest.raises(_Called):
        cli.main(argv)
    assert seen["mem_budget_gb"] == 0.5
    monkeypatch.delenv(calibrate.MEM_ENV)
    with pytest.raises(_Called):
        cli.main(argv)
    assert seen["mem_budget_gb"] is None
    monkeypatch.setenv(calibrate.MEM_ENV, "lots")
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trapetum: error: ") and calibrate.MEM_ENV in err[0]
