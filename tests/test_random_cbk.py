"""eval/random_cbk.py: a .cbk of random weights with a real tokenizer, at a tiny shape on the CPU: the file holds
exactly random_model.py's tensors, the tokenizer's vocab size and a provenance that says random weights; it loads
and generates like any .cbk (API and `trapetum generate`); the tokenizer survives export and the file bit for bit
in its behaviour (encode, decode, bos / eos, chat template); bad input is one line and a non-zero exit."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_models import save_tokenizer
from trapetum.eval.random_cbk import export_tokenizer, main, read_tokenizer_source, write_random_cbk
from trapetum.eval.random_model import random_checkpoint
from trapetum.formats.cbk import open_cbk
from trapetum.schemes.record import QuantRecord

TINY = dict(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            max_position_embeddings=256)
ROOT = Path(__file__).resolve().parents[1]
TEXT = "the king's horse, and THE QUEEN: ünï 42"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(d, vocab=280)
    return d


@pytest.fixture(scope="module")
def cbk(tok_dir, tmp_path_factory):
    tk = read_tokenizer_source(tok_dir / "tokenizer.json")
    out = tmp_path_factory.mktemp("cbk") / "r.cbk"
    return write_random_cbk(out, tk, shape="llama2-7b", fmt="cb4", device="cpu", overrides=TINY,
                            tokenizer_source="tokenizer.json"), tk


def test_file_holds_the_random_checkpoint(cbk):
    path, tk = cbk
    f = open_cbk(path)
    ck = f.to_checkpoint()
    assert ck.config.vocab_size == tk.vocab_size == 280 and ck.config.hidden_size == 64
    prov = f.meta["provenance"]
    assert prov["random_weights"] is True and prov["source_format"] == "random" and "random weights" in prov["source"]
    assert f.meta["recipe"]["random_weights"] is True
    ref = random_checkpoint("llama2-7b", "cb4", "cpu", overrides={"vocab_size": 280, **TINY})
    assert set(ck.tensors) == set(ref.tensors)
    for n in ref.tensors:
        a, b = ck.tensors[n], ref.tensors[n]
        if isinstance(b, QuantRecord):
            assert (a.scheme, tuple(a.shape), a.params["bits"]) == (b.scheme, tuple(b.shape), b.params["bits"]), n
            assert all(torch.equal(a.tensors[r], b.tensors[r]) for r in b.tensors), n
        else:
            assert torch.equal(a, b), n
    assert ck.tensors["lm_head.weight"].params["bits"] == 8 and ck.tensors["model.layers.0.mlp.up_proj.weight"].params["bits"] == 4


def test_tokenizer_round_trip(cbk, tok_dir, tmp_path):
    path, tk = cbk
    exported = read_tokenizer_source(export_tokenizer(tk, tmp_path / "exp") / "tokenizer.json")
    for other in (read_tokenizer_source(path), exported, read_tokenizer_source(tok_dir)):
        ids = other.encode(TEXT)
        assert ids == tk.encode(TEXT) and other.decode(ids) == tk.decode(ids)
        assert (other.bos_id, other.eos_ids, other.chat_template) == (tk.bos_id, tk.eos_ids, tk.chat_template)
        assert other.vocab_size == 280


def test_loads_and_generates(cbk):
    import trapetum
    path, _ = cbk
    m = trapetum.load(str(path))
    out = m.generate("the king", max_new_tokens=4, ignore_eos=True)
    assert len(out.token_ids) == 4 and all(0 <= t < 280 for t in out.token_ids)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "trapetum.cli", "generate", str(path), "the king", "-n", "4"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main(["--tokenizer", str(tmp_path / "nope.json"), "--out", str(tmp_path / "x.cbk")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nope.json" in err
    (tmp_path / "vocab.json").write_text("{}")
    assert main(["--tokenizer", str(tmp_path / "vocab.json"), "--out", str(tmp_path / "x.cbk")]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "x.cbk").exists()


def test_load_bench_serves_the_file(cbk, tmp_path):
    """`trapetum bench load` against `trapetum serve F.cbk` (the CPU batch scheduler, --max-batch 4): every
    request of both levels answered with all its tokens (scripts/sessions/gpu_load.sh runs this on the H200)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import json
    path, _ = cbk
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    j = tmp_path / "load.json"
    r = subprocess.run([sys.executable, "-m", "trapetum.cli", "bench", "load", "--model", str(path), "--clients",
                        "1,3", "--max-tokens", "8", "--max-batch", "4", "--per-client", "3", "--threads", "1",
                        "--json", str(j)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    levels = json.loads(j.read_text())["levels"]
    assert [(x["clients"], x["requests"], x["errors"]) for x in levels] == [(1, 8, 0), (3, 9, 0)]
    assert all(x["output_tokens"] == 8 * x["requests"] for x in levels)
    assert "| 3 | 9 (0) |" in r.stdout
