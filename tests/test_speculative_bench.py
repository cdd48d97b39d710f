"""The speculative benchmark's code paths on the CPU (engine on its torch fallbacks, tiny shapes): the modeled part
(scripted acceptance over PARD and draft-model drafters) and the real-model part (a tiny HF model, n-gram and a
draft model); every arm's outputs identical to plain, the tables written. The GPU run is the lead's
(``python -m trapetum.eval.bench_spec``)."""
import json

import pytest
import torch

from tests.tiny_models import build
from trapetum.eval import bench_spec, random_model

TINY = dict(family="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=512)


@pytest.fixture(autouse=True)
def cpu(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_modeled_part_smoke(tmp_path, monkeypatch):
    monkeypatch.setitem(random_model.SHAPES, "tiny-t", TINY)
    monkeypatch.setitem(random_model.SHAPES, "tiny-d", dict(TINY, num_layers=1))
    rc = bench_spec.main(["--out", str(tmp_path), "--device", "cpu", "--layers", "2", "--target", "tiny-t:cb4",
                          "--draft", "tiny-d:fp16", "--pard-k", "3,7", "--draft-k", "3", "--alpha", "0.5,1.0",
                          "--prompts", "2", "--new-tokens", "24", "--reps", "2", "--max-prompt", "32"])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {r["arm"]: r for r in res["modeled"]["rows"]}
    # plain + (PARD 2 K + draft 1 K) x 2 alphas x the pipelined and synchronous loops
    assert len(rows) == 1 + (2 + 1) * 2 * 2 and all(r["identical"] == r["runs"] == 4 for r in rows.values())
    full, sync = rows["pard K=7 alpha=1"], rows["pard K=7 alpha=1 sync"]
    assert full["per_token"] == 1.0 and full["tokens_per_round"] > 4  # an oracle at K = 7: 8 tokens a round
    assert (full["loop"], sync["loop"]) == ("pipelined", "sync") and sync["tokens_per_round"] == full["tokens_per_round"]
    half = rows["draft K=3 alpha=0.5"]
    assert 0.25 < half["per_token"] < 0.75
    assert "pard K=7 alpha=1" in (tmp_path / "results.md").read_text()


def test_real_part_smoke(tmp_path):
    src, other = tmp_path / "t", tmp_path / "d"
    build("qwen2", src, seed=0, tokenizer=True)
    build("qwen2", other, seed=0, tokenizer=True)  # the same weights: a drafter that is always right
    for d in (src, other):  # the tiny tokenizer spends ~300 tokens on a prompt: a longer context
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=1024)))
    rc = bench_spec.main(["--out", str(tmp_path / "out"), "--skip-modeled", "--device", "cpu", "--real", str(src),
                          "--real-draft", f"ngram,{other}", "--real-k", "2", "--real-new-tokens", "10",
                          "--real-prompts", "4"])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = res["real"]["rows"]
    assert [r["draft"] for r in rows] == ["plain", "ngram", str(other)]
    assert all(r["pooled"]["identical"] == 4 for r in rows)
    assert rows[2]["pooled"]["acceptance"] == 1.0 and set(rows[2]["by_kind"]) == {"edit", "summarize"}
