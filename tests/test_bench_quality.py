"""scripts/bench_quality.py: the calibration guard, argument errors (one line, exit 2), bits per weight of GGUF
and .cbk files, the table and the QUALITY.md section; a whole run on SmolLM2 at a tiny size (slow; the llama.cpp
rows when scripts/build_llamacpp_tools.sh's tools are at their default place)."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from real_models import require  # noqa: E402
from test_gguf import hf_tensors, to_gguf_name, write_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_quality.py"
LLAMA_BIN = Path("/tmp/llamacpp-b11312/build/bin")  # scripts/build_llamacpp_tools.sh's default
spec = importlib.util.spec_from_file_location("bench_quality", SCRIPT)
bq = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bq)


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_calibration_never_the_evaluation_text(tmp_path):
    text = tmp_path / "test.txt"
    text.write_text("The opening of the evaluation text. " * 80)
    same = tmp_path / "copy.txt"
    same.write_text(text.read_text())
    inside = tmp_path / "inside.txt"
    inside.write_text("other words\n" + text.read_text() + "\nmore")
    other = tmp_path / "other.txt"
    other.write_text("Entirely different calibration text. " * 80)
    for bad, msg in ((text, "is the evaluation text"), (same, "is the evaluation text"), (inside, "contains")):
        with pytest.raises(bq.BenchError, match=msg):
            bq.check_calibration(bad, text)
    bq.check_calibration(other, text)
    r = _run("--calib", str(text), "--text", str(text), "--llama", "")
    assert r.returncode == 2 and "is the evaluation text" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, msg", [
    (["--llama", "Q4_0"], "--llama-bin DIR is needed"),
    (["--llama-bin", "/nonexistent"], "no llama-quantize"),
    (["--sources", "raw,cooked", "--llama", ""], "--sources must name"),
    (["--ours", "noequals", "--llama", ""], "expected NAME=VALUE"),
    (["--ours", "a=--bits 4", "--ours", "a=--bits 3", "--llama", ""], "given twice"),
    (["--model", "x=/nonexistent.gguf", "--llama", ""], "file not found"),
])
def test_argument_errors(args, msg):
    r = _run(*args)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_llama_perplexity_needed_only_for_a_cross_check(tmp_path):
    """--cross-check '' scores no file with llama-perplexity (the reference neither), so the tool need not exist."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for t in ("llama-quantize", "llama-imatrix"):
        (tools / t).write_text("#!/bin/sh\nexit 1\n")
    base = ["--llama-bin", str(tools), "--model", "x=/nonexistent.gguf"]
    r = _run(*base)  # the default cross-check (Q4_K_M) needs it
    assert r.returncode == 2 and "no llama-perplexity" in r.stderr, r.stderr
    r = _run(*base, "--cross-check", "")
    assert r.returncode == 2 and "llama-perplexity" not in r.stderr and "file not found" in r.stderr, r.stderr


def test_projection_bits_per_weight(tmp_path):
    """GGUF: the projections' stored bytes over their weights (Q4_0: 4.5 bits; F32 32); .cbk: codes + codebooks."""
    Q = gguf.GGMLQuantizationType
    ref = hf_tensors("llama")
    proj = [n for n in ref if n.endswith("_proj.weight")]
    path = write_gguf(tmp_path / "q.gguf", "llama", ref, qtypes={to_gguf_name(n, "llama"): Q.Q4_0 for n in proj})
    from trapetum.formats.gguf import load_gguf
    ck = load_gguf(path)
    n = bq.proj_weights(ck.config)
    assert n == sum(ref[k].size for k in proj)
    assert bq.proj_bytes(path) * 8 / n == pytest.approx(4.5)
    assert bq.source_weights(ck) == sum(t.size for t in ref.values())
    import tiny_models
    cbk = tiny_models.build_cbk("llama2", tmp_path, iters=2)
    from trapetum.formats.detect import load_checkpoint
    cfg = load_checkpoint(str(cbk)).config
    want = 0.0
    from trapetum.models.schema import expected_shapes
    for name, shp in expected_shapes(cfg).items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            want += shp[0] * shp[1] * 4 / 8 + shp[0] * 20  # 4-bit codes + 16 u8 centroids and an fp16 (lo, step) a row
    assert bq.proj_bytes(cbk) == pytest.approx(want, rel=0.02)


def test_first_and_all_windows_from_one_pass(tmp_path):
    """--all-windows scores every window once; the first N windows' figures are their share of that pass, equal
    to a separate first-N run."""
    import argparse
    import tiny_models
    from trapetum.eval.perplexity import perplexity, tokenize_file
    from trapetum.formats.detect import load_checkpoint
    from trapetum.models.decoder import Decoder
    import torch
    from trapetum.quant.quantize import Recipe, quantize_to_cbk
    tiny_models.build("llama2", tmp_path / "src", tokenizer=True)
    cbk = tmp_path / "m.cbk"
    quantize_to_cbk(str(tmp_path / "src"), cbk, Recipe(bits=4, head_bits=8, weighted=False, iters=2).validate(),
                    progress=False, log=lambda s: None)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 97} and more text {i}" for i in range(700)))
    args = argparse.Namespace(device="cpu", ctx=64, windows=3, all_windows=True, greedy_tokens=2)
    res = bq.measure(cbk, args, text, None)
    ck = load_checkpoint(str(cbk))
    dec = Decoder.from_checkpoint(ck, dtype=torch.float32, device="cpu").eval()
    ids = tokenize_file(ck.tokenizer, text)
    first, every = perplexity(dec, ids, 64, 3, progress=False), perplexity(dec, ids, 64, None, progress=False)
    assert every.windows > 3 and res["windows"] == 3 and res["windows_all"] == every.windows
    assert res["ppl"] == pytest.approx(first.ppl, rel=1e-12) and res["tokens"] == first.tokens
    assert res["ppl_all"] == every.ppl and res["ppl"] != res["ppl_all"]


def _row(kind, name, ppl, size, **kw):
    return {"kind": kind, "name": name, "ppl": ppl, "file_bytes": size, "proj_bpw": 4.5, "bpw_file": 5.0,
            "windows": 2, "agree": 7, **kw}


def test_table_and_quality_section(tmp_path):
    args = bq.parse_args(["--llama", "", "--windows", "2", "--out", str(tmp_path)])
    res = {"M/raw/reference": _row("ref", "reference", 20.0, 100e6, llama_ppl=10.0),
           "M/raw/cb4": _row("ours", "cb4", 22.0, 60e6, flags="--bits 4 --calib {calib}"),
           "M/raw/Q4_K_M-imat": _row("llama", "Q4_K_M-imat", 21.0, 50e6, qtype="Q4_K_M", imatrix=True,
                                     llama_ppl=10.5),
           "M/raw/IQ2_XS": {"kind": "llama", "name": "IQ2_XS", "qtype": "IQ2_XS", "imatrix": False,
                            "error": "llama-quantize refuses this type without an importance matrix"}}
    table = bq.fmt_table(res, "M", "raw", args)
    lines = table.splitlines()
    assert len({line.count("|") for line in lines}) == 1  # every row has the header's columns
    assert "22.000 (+10.0%)" in table and "21.000 (+5.0%)" in table and "10.500 (+5.0%)" in table
    assert "`--bits 4 --calib CALIB`" in table and "refuses" in table and "llama.cpp Q4_K_M + imatrix" in table
    q = tmp_path / "QUALITY.md"
    q.write_text("# Quality\n\nearlier text\n")
    bq.write_quality(q, table, "Command: x")
    bq.write_quality(q, table.replace("22.000", "23.000"), "Command: y")  # replaced in place, not appended
    text = q.read_text()
    assert text.count(bq.START) == 1 and "23.000" in text and "22.000 (+10" not in text
    assert text.startswith("# Quality\n\nearlier text\n") and "Command: y" in text


@pytest.mark.slow
def test_whole_run_tiny(tmp_path):
    """SmolLM2 raw and fair at 1 window of 128 tokens: the references and, with the tools, Q4_0 with and without
    an importance matrix and IQ2_XS (refused without one); results and table written. (Our rows go through
    `trapetum quantize`, minutes on a shared CPU; the QUALITY.md run exercises them.)"""
    path = require("smollm2")
    tools = LLAMA_BIN if (LLAMA_BIN / "llama-quantize").is_file() else None
    args = ["--model", f"smol={path}", "--ctx", "128", "--windows", "1", "--greedy-tokens", "2", "--threads", "2",
            "--ours", "", "--out", str(tmp_path / "o"),
            "--imatrix-chunks", "2"]
    args += ["--llama-bin", str(tools), "--llama", "Q4_0,IQ2_XS", "--cross-check", "Q4_0"] if tools else ["--llama", ""]
    r = _run(*args, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    for src in ("raw", "fair"):
        ref = res[f"smol/{src}/reference"]
        assert math.isfinite(ref["ppl"]) and ref["windows"] == 1 and ref["tokens"] == 127
        if tools:
            q = res[f"smol/{src}/Q4_0"]
            assert q["proj_bpw"] == pytest.approx(4.5, abs=0.1) and "llama_ppl" in q
            assert "refuses" in res[f"smol/{src}/IQ2_XS"]["error"]
            # SmolLM2's 576-wide rows are not multiples of 256: llama.cpp falls back to IQ4_NL there, so its
            # IQ2_XS layers come out near 4 bits, still below Q4_0's 4.5
            assert res[f"smol/{src}/IQ2_XS-imat"]["proj_bpw"] < q["proj_bpw"]
    a, b = res["smol/raw/reference"]["nll"], res["smol/fair/reference"]["nll"]
    assert abs(a - b) < 5e-3
    assert all(np.isfinite(r["ppl"]) for r in res.values() if "ppl" in r)
    assert "fair source" in (tmp_path / "o" / "quality.md").read_text()


def test_loader_reads_every_type_llama_quantize_writes_here():
    """The llama.cpp rows are read by our GGUF loader: every tensor type the benchmarked types produce (their
    k-quant / i-quant blocks and the fallbacks for rows not divisible by 256) dequantizes through gguf."""
    from trapetum.formats.gguf import _supported_type
    Q = gguf.GGMLQuantizationType
    for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
              "IQ2_XS", "IQ2_XXS", "IQ2_S", "IQ3_XXS", "IQ3_S", "F16", "F32"):
        assert _supported_type(Q[t]), t
