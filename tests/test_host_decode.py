"""CPU decoding of a .cbk model through the host GEMV (``CodebookLinear.use_host``, ``Decoder.use_host_kernels``,
``trapetum.load(..., threads=)``): no dense copies, logits against the float64 reference decoder, decode end to
end, the same bits for every thread count, the old path behind ``Options(host_kernels=False)``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trapetum
from cbk_helpers import tiny_config, tiny_tokenizer
from trapetum.formats.cbk import write_cbk
from trapetum.formats.detect import load_checkpoint
from trapetum.kernels import host_gemv as hg
from trapetum.kernels.pack import pack_codes
from trapetum.models.decoder import Decoder
from trapetum.models.schema import expected_shapes
from trapetum.schemes.codebook import CodebookLinear
from trapetum.schemes.record import QuantRecord
from trapetum.settings import Options

if not hg.available():
    pytest.skip(f"host kernels unavailable: {hg.error()}", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
PROJ = ("_proj.weight",)


def _record(shape, bits, gen, scale):
    out, inp = shape
    idx = torch.randint(0, 1 << bits, (out, inp), generator=gen)
    cb = (torch.randn(out, 1 << bits, generator=gen) * scale).to(torch.float16)
    return QuantRecord("codebook", (out, inp), {"bits": bits}, {"codes": pack_codes(idx, bits), "codebook": cb})


@pytest.fixture(scope="module")
def cbk(tmp_path_factory):
    """A 4-bit model with awkward widths (hidden 53, MLP 97: K not a multiple of any vector width), q/k/v biases,
    an 8-bit LM head of 257 rows."""
    cfg = tiny_config(vocab_size=257, hidden_size=53, intermediate_size=97, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, qkv_bias=True)
    gen = torch.Generator().manual_seed(5)
    dense, quantized = {}, {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith(PROJ):
            quantized[name] = _record(shape, 4, gen, 0.2)
        elif name == "lm_head.weight":
            quantized[name] = _record(shape, 8, gen, 0.3)
        elif "norm" in name:
            dense[name] = (1 + 0.1 * torch.randn(shape, generator=gen)).to(torch.float16)
        else:
            dense[name] = torch.randn(shape, generator=gen).to(torch.float16)
    path = tmp_path_factory.mktemp("host") / "tiny4.cbk"
    write_cbk(path, config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer())
    return path


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _codebook_modules(dec):
    return [m for m in dec.modules() if type(m) is CodebookLinear]


IDS = [1, 5, 6, 7, 8, 5, 9, 3, 4, 200, 17, 256, 2, 40]


def test_cpu_model_routes_codebook_projections_through_the_host_gemv(cbk):
    m = trapetum.load(cbk)
    mods = _codebook_modules(m.decoder)
    assert len(mods) == 2 * 7 + 1 and all(mod.host is not None for mod in mods)
    m.generate(IDS[:5], max_new_tokens=6, ignore_eos=True)
    assert not any("_dense" in mod.__dict__ for mod in mods)  # no dense copy was made
    old = trapetum.load(cbk, options=Options(host_kernels=False))
    assert all(mod.host is None for mod in _codebook_modules(old.decoder))
    assert _rel(m.logits(IDS), old.logits(IDS)) < 1e-5


def test_prompt_and_decode_logits_match_the_float64_reference(cbk):
    m = trapetum.load(cbk, threads=2)
    ref = Decoder.from_checkpoint(load_checkpoint(str(cbk)), dtype=torch.float64).eval()
    with torch.inference_mode():
        want = ref(torch.tensor([IDS]))[0]
        assert _rel(m.logits(IDS), want) < 1e-5
        dec = m.decoder
        cache = dec.new_cache(1, len(IDS))
        got = [dec(torch.tensor([IDS[:3]]), cache, 0)[0, -1]]
        for p in range(3, len(IDS)):
            got.append(dec(torch.tensor([[IDS[p]]]), cache, p)[0, -1])
    for p, g in zip(range(2, len(IDS)), got):
        assert _rel(g, want[p]) < 1e-5, p


def test_a_long_prompt_takes_the_dequantized_matmul_and_matches_the_reference(cbk):
    ids = [(7 * i + 3) % 257 for i in range(40)]  # more than 16 rows: blocks dequantized in C, torch matmul
    m = trapetum.load(cbk)
    ref = Decoder.from_checkpoint(load_checkpoint(str(cbk)), dtype=torch.float64).eval()
    with torch.inference_mode():
        assert _rel(m.logits(ids), ref(torch.tensor([ids]))[0]) < 1e-5
    assert not any("_dense" in mod.__dict__ for mod in _codebook_modules(m.decoder))


def test_greedy_decode_end_to_end_follows_the_float64_reference(cbk):
    m = trapetum.load(cbk)
    prompt = IDS[:4]
    toks = m.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids
    assert len(toks) == 16
    ref = Decoder.from_checkpoint(load_checkpoint(str(cbk)), dtype=torch.float64).eval()
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + toks]))[0]
    for i, t in enumerate(toks):  # each choice is the float64 argmax, up to a near tie
        row = logits[len(prompt) - 1 + i]
        assert row[t] >= row.max() - 1e-4 * row.abs().max(), (i, t, int(row.argmax()))


def test_the_same_bits_for_every_thread_count(cbk):
    base = trapetum.load(cbk, threads=1).logits(IDS)
    for t in (2, 3, 4):
        m = trapetum.load(cbk, threads=t)
        assert all(mod.host_threads == t for mod in _codebook_modules(m.decoder))
        assert torch.equal(m.logits(IDS), base)
        assert torch.equal(m.logits(IDS), base)  # run to run


def test_without_the_kernels_the_torch_path_decodes(cbk, monkeypatch):
    monkeypatch.setattr(hg, "available", lambda: False)
    m = trapetum.load(cbk)
    assert all(mod.host is None for mod in _codebook_modules(m.decoder))
    assert len(m.generate(IDS[:4], max_new_tokens=4, ignore_eos=True).token_ids) == 4


def test_cli_generate_with_threads_decodes_on_the_host_kernels(cbk):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "trapetum.cli", "generate", str(cbk), "hello world the cat",
                        "--threads", "2", "--max-new-tokens", "5", "--ignore-eos"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr


def test_bench_cpu_runs_both_paths_and_reports_bandwidth(cbk, tmp_path, capsys):
    from trapetum.eval import bench_cpu
    assert bench_cpu.main([str(cbk), "--threads", "1,2", "--tokens", "4", "--rounds", "1", "--bw-mb", "8",
                           "--out", str(tmp_path)]) == 0
    import json
    res = json.loads((tmp_path / "results.json").read_text())
    for k in ("torch t=1", "host t=1", "host t=2", "step t=1", "step t=2", "gemv GB/s t=2", "read GB/s t=1",
              "step gemv GB/s t=1", "step gemv GB/s t=2"):
        assert len(res["runs"][k]) == 1 and res["runs"][k][0] > 0, k
    assert res["gemv_weight_bytes"] > 0 and "| 2 |" in capsys.readouterr().out
    assert res["step_gemv_bytes"] == res["gemv_weight_bytes"]  # the step's fused calls read the same bytes


def test_bench_cpu_from_the_cli(cbk, tmp_path):
    """`trapetum bench cpu` runs the same benchmark; a bad --paths is one line and exit 1."""
    import json

    from trapetum import cli
    assert cli.main(["bench", "cpu", str(cbk), "--threads", "1", "--tokens", "2", "--rounds", "1", "--bw-mb", "8",
                     "--paths", "step", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["runs"]["step t=1"][0] > 0
    assert cli.main(["bench", "cpu", str(cbk), "--paths", "nope"]) == 1
