"""scripts/quality_windows.py: one pass gives the first-N and the all-window figures of `trapetum ppl`'s harness."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.tiny_models import build
from trapetum.api import load
from trapetum.eval.perplexity import perplexity, tokenize_file

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("quality_windows", REPO / "scripts" / "quality_windows.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_split_spec():
    qw = _script()
    assert qw.split_spec("m.cbk") == ("m.cbk", None)
    assert qw.split_spec("m.cbk@on") == ("m.cbk", "on")
    assert qw.split_spec("/a@b/m.cbk@x.json") == ("/a@b/m.cbk", "x.json")


def test_first_and_all_windows_equal_the_harness(tmp_path, capsys):
    build("llama2", tmp_path / "m", tokenizer=True)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 37} and more text {i}" for i in range(400)))
    qw = _script()
    out = tmp_path / "r.jsonl"
    assert qw.main([str(tmp_path / "m"), "--text", str(text), "--first", "2", "--ctx", "32", "--json", str(out)]) == 0
    r = json.loads(out.read_text().splitlines()[0])
    model = load(str(tmp_path / "m"))
    ids = tokenize_file(model.tokenizer, text)
    first = perplexity(model.decoder, ids, 32, 2, progress=False)
    every = perplexity(model.decoder, ids, 32, None, progress=False)
    assert r["windows"] == every.windows > 2 and r["first"] == 2
    assert r["nll_first"] == pytest.approx(first.nll, rel=1e-12)
    assert r["nll_all"] == pytest.approx(every.nll, rel=1e-12) and r["tokens_all"] == every.tokens
    assert f"{r['ppl_all']:.3f}" in capsys.readouterr().out
