"""The quantizer benchmark's machinery (random lazy checkpoint, random statistics) on a tiny shape."""
import trapetum.eval.bench_e2e as bench_e2e
from trapetum.cli import main
from trapetum.eval.bench_quantize import run


def test_bench_quantize_tiny_shape(monkeypatch, capsys):
    monkeypatch.setitem(bench_e2e.SHAPES, "tiny-test", dict(
        family="llama", vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=256))
    r = run("tiny-test", "cpu", None, layers=2)
    assert r["layers"] == 2 and r["seconds"] > 0 and r["file_bytes"] > 0
    assert main(["bench", "quantize", "--shape", "nope"]) == 1
    assert "unknown shape" in capsys.readouterr().err
