"""The quantizer benchmark's machinery (random lazy checkpoint, random statistics) on a tiny shape."""
import pytest
import torch

import trapetum.eval.bench_e2e as bench_e2e
import trapetum.eval.random_model as random_model
from trapetum.cli import main
from trapetum.eval.bench_quantize import run


def test_bench_quantize_tiny_shape(monkeypatch, capsys):
    monkeypatch.setitem(random_model.SHAPES, "tiny-test", dict(
        family="llama", vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=256))
    r = run("tiny-test", "cpu", None, layers=2)
    assert r["layers"] == 2 and r["seconds"] > 0 and r["file_bytes"] > 0
    g = run("tiny-test", "cpu", None, layers=2, gptq=True)  # the --gptq recipe, random Hessians
    assert g["layers"] == 2 and "GPTQ" in g["recipe"] and abs(g["file_bytes"] - r["file_bytes"]) < 4096  # recipe text
    assert main(["bench", "quantize", "--shape", "nope"]) == 1
    assert "unknown shape" in capsys.readouterr().err


def test_bench_quantize_additive_tiny_shape(monkeypatch, capsys, tmp_path):
    """--scheme aqlm-2x8 runs the additive driver on the random model: one JSON line with the timing,
    size, settings and per-layer times; the extrapolation to the full depth is labelled an estimate;
    the written file verifies and loads."""
    import json

    import trapetum
    monkeypatch.setitem(random_model.SHAPES, "tiny-test", dict(
        family="llama", vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=256))
    out = tmp_path / "m.cbk"
    small = dict(iters=1, beam=1, kmeans_iters=2)  # the benchmark itself uses the driver defaults
    r = run("tiny-test", "cpu", None, layers=2, scheme="aqlm-2x8", keep=out, additive_settings=small)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == r
    assert r["scheme"] == "aqlm-2x8" and r["layers"] == 2 and r["device"] == "cpu" and r["gpu"] is None
    assert r["seconds"] > 0 and r["file_bytes"] == out.stat().st_size and r["verified"] is True
    assert len(r["per_layer_seconds"]) == 2 and all(t > 0 for t in r["per_layer_seconds"])
    assert r["settings"]["scheme"] == "aqlm-2x8" and r["settings"]["beam"] == 1 and r["settings"]["iters"] == 1
    ex = r["extrapolation"]
    assert ex["ESTIMATE_NOT_MEASURED"] is True and ex["full_layers"] == 3 and ex["estimated_seconds"] > 0
    assert not (tmp_path / "m.cbk.parts").exists()
    m = trapetum.load(str(out))
    assert m is not None
    assert main(["bench", "quantize", "--shape", "nope", "--scheme", "aqlm-2x8"]) == 1  # the CLI takes --scheme


@pytest.mark.slow  # 32 s on the CPU (CI budget); the additive tiny-shape run stays in the fast tier
def test_bench_quantize_additive_resumes_a_killed_run(monkeypatch, capsys, tmp_path):
    """--work keeps the driver's parts: a run stopped after one computed layer leaves it there; the same
    command then computes only the rest (layers_resumed counts the other), and the file equals an
    uninterrupted run's tensors. --work is refused for the cb4 scheme (it does not resume)."""
    import json

    import pytest
    import trapetum
    from trapetum.eval.bench_quantize import work_cbk
    monkeypatch.setitem(random_model.SHAPES, "tiny-test", dict(
        family="llama", vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=256))
    small = dict(iters=1, beam=1, kmeans_iters=2)
    keep = work_cbk(str(tmp_path / "w"), "aqlm-2x8")
    with pytest.raises(KeyboardInterrupt):
        run("tiny-test", "cpu", None, scheme="aqlm-2x8", keep=keep, additive_settings=small, stop_after=1)
    assert len(list((tmp_path / "w" / "model.cbk.parts").glob("layer_*.safetensors"))) == 1
    r = run("tiny-test", "cpu", None, scheme="aqlm-2x8", keep=keep, additive_settings=small)
    assert r["layers"] == 3 and r["layers_resumed"] == 1 and len(r["per_layer_seconds"]) == 2
    assert "resumed_note" in r and "extrapolation" not in r and r["verified"] is True
    ref = run("tiny-test", "cpu", None, scheme="aqlm-2x8", keep=tmp_path / "ref.cbk", additive_settings=small)
    assert ref["layers_resumed"] == 0 and "resumed_note" not in ref
    a, b = trapetum.load(str(keep)), trapetum.load(str(tmp_path / "ref.cbk"))
    sa, sb = a.decoder.state_dict(), b.decoder.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    capsys.readouterr()
    assert main(["bench", "quantize", "--shape", "tiny-test", "--work", str(tmp_path / "x")]) == 1
    assert "--work" in capsys.readouterr().err
    json.dumps(r)


def test_bench_e2e_names_an_unknown_attention_config(capsys):
    """--attn-configs is checked against the attention candidates before anything runs (exit 2, the name)."""
    assert bench_e2e.main(["--attn-configs", "c64-w4-m64w4d32,c7-nonsense"]) == 2
    assert "unknown config 'c7-nonsense'" in capsys.readouterr().out
