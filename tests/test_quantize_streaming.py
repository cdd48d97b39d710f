"""Streaming quantization (issue 3: "a 70B source must not need its full size in RAM").

* ``CbkWriter.update`` + ``reserve_bytes``: metadata known only at the end fits the header's reserved
  room (padded with spaces, which our reader and the safetensors library accept), or ``commit`` moves
  the data to make room; a header over the format's limit fails cleanly (no file, no temp file).
* ``quantize_to_cbk`` (streaming through ``CbkWriter``) writes the same file as the in-memory path
  (``quantize_checkpoint`` + ``write_cbk``): same tensors byte for byte, same metadata apart from the
  creation time and the duration.
* Peak memory of the streaming path is about one tensor's work, not the model's output (measured as
  anonymous RSS in a subprocess: torch's CPU allocations are invisible to ``tracemalloc``).
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cbk_helpers import tiny_model, tiny_tokenizer
from trapetum.errors import FormatError
from trapetum.formats import cbk_write
from trapetum.formats.cbk import CbkFile, CbkWriter, QuantSpec, TensorSpec, write_cbk


# ---------------------------------------------------------------------------------------------
# CbkWriter: reserved header room, update(), moving the data when the room is too small
# ---------------------------------------------------------------------------------------------
def _stream(path, cfg, dense, quantized, *, reserve=0, recipe=None, final=None):
    w = CbkWriter(path, config=cfg, tokenizer=tiny_tokenizer(), recipe=recipe or {"method": "test"},
                  provenance={"source": "x"}, reserve_bytes=reserve)
    with w:
        for n, t in dense.items():
            w.declare_dense(n, TensorSpec.of(t))
        for n, r in quantized.items():
            w.declare_quantized(n, QuantSpec.of(r))
        for n, r in reversed(list(quantized.items())):  # any order
            w.put_quantized(n, r)
        for n, t in dense.items():
            w.put_dense(n, t)
        if final is not None:
            w.update(**final)
    return w


def _check_same_tensors(path, dense, quantized):
    f = CbkFile(path)
    assert f.verify() == []
    for n, t in dense.items():
        assert torch.equal(f.tensor(n), t), n
    for n, r in quantized.items():
        g = f.record(n)
        assert all(torch.equal(g.tensors[k], r.tensors[k]) for k in r.tensors), n
    return f


def _big_recipe(n):
    return {"method": "test", "layer_errors": {f"model.layers.{i}.mlp.down_proj": 0.0123456 for i in range(n)}}


def test_update_fits_reserved_room_and_readers_skip_the_padding(tmp_path):
    pytest.importorskip("safetensors")
    cfg, dense, quantized = tiny_model()
    final = {"recipe": _big_recipe(100), "provenance": {"source": "x", "quantize_seconds": 1.5}}
    w = _stream(tmp_path / "a.cbk", cfg, dense, quantized, reserve=16384, final=final)
    assert w.header_moved_bytes == 0
    raw = (tmp_path / "a.cbk").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8:8 + n].decode()
    assert (8 + n) % 8 == 0 and text.endswith(" " * 1000)  # the unused room is trailing spaces
    f = _check_same_tensors(tmp_path / "a.cbk", dense, quantized)
    assert f.recipe == final["recipe"]
    assert f.provenance["quantize_seconds"] == 1.5 and "created" in f.provenance and "tool_version" in f.provenance
    # the safetensors library (Rust parser) reads the padded header too
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(str(tmp_path / "a.cbk"), "pt") as sf:
        assert json.loads(sf.metadata()["trapetum"])["recipe"] == final["recipe"]
        name = next(iter(dense))
        assert torch.equal(sf.get_tensor(name), dense[name])
    assert set(load_file(str(tmp_path / "a.cbk"))) == set(f.tensors_table)


@pytest.mark.parametrize("chunk", [8, 1000, 1 << 24])
def test_update_outgrowing_the_room_moves_the_data(tmp_path, monkeypatch, chunk):
    # chunk 8 / 1000: many steps, each shorter than the growth (and not aligned to anything)
    monkeypatch.setattr(cbk_write, "_MOVE_CHUNK", chunk)
    cfg, dense, quantized = tiny_model()
    final = {"recipe": _big_recipe(300)}  # ~15 KB more than the header declared
    w = _stream(tmp_path / "m.cbk", cfg, dense, quantized, reserve=64, final=final)
    assert w.header_moved_bytes > 0
    f = _check_same_tensors(tmp_path / "m.cbk", dense, quantized)
    assert f.recipe == final["recipe"]
    assert [p.name for p in tmp_path.iterdir()] == ["m.cbk"]


def test_smaller_final_header_is_padded_and_no_reserve_keeps_the_old_layout(tmp_path):
    cfg, dense, quantized = tiny_model()
    write_cbk(tmp_path / "ref.cbk", config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer(),
              recipe={"method": "test"}, provenance={"source": "x"})
    _stream(tmp_path / "s.cbk", cfg, dense, quantized, recipe=_big_recipe(20), final={"recipe": {"method": "test"}})
    a, b = (tmp_path / "ref.cbk").read_bytes(), (tmp_path / "s.cbk").read_bytes()
    fa, fb = CbkFile(tmp_path / "ref.cbk"), CbkFile(tmp_path / "s.cbk")
    assert fb.recipe == {"method": "test"}
    assert a[fa.header_bytes:] == b[fb.header_bytes:]  # same data, same layout
    _check_same_tensors(tmp_path / "s.cbk", dense, quantized)


def test_header_over_the_limit_fails_cleanly(tmp_path, monkeypatch):
    monkeypatch.setattr(cbk_write, "MAX_HEADER_BYTES", 64 * 1024)
    cfg, dense, quantized = tiny_model()
    (tmp_path / "t.cbk").write_bytes(b"old")
    with pytest.raises(ValueError, match="over the 65536-byte limit"):
        _stream(tmp_path / "t.cbk", cfg, dense, quantized, reserve=1000, final={"recipe": _big_recipe(3000)})
    assert [p.name for p in tmp_path.iterdir()] == ["t.cbk"] and (tmp_path / "t.cbk").read_bytes() == b"old"


def test_update_rules(tmp_path):
    cfg, dense, quantized = tiny_model()
    with pytest.raises(ValueError, match="reserve_bytes"):
        CbkWriter(tmp_path / "x.cbk", config=cfg, reserve_bytes=-1)
    with pytest.raises(ValueError, match="not plain JSON"):
        CbkWriter(tmp_path / "x.cbk", config=cfg).update(recipe={"x": float("nan")})
    w = _stream(tmp_path / "u.cbk", cfg, dense, quantized, final={"generation": {"temperature": 0.5}})
    assert CbkFile(tmp_path / "u.cbk").generation == {"temperature": 0.5}
    with pytest.raises(ValueError, match="already committed"):
        w.update(recipe={})
    with pytest.raises(FormatError):  # sanity: the reader still refuses a broken header
        (tmp_path / "b.cbk").write_bytes(b"\x08" + b"\0" * 7 + b"        ")
        CbkFile(tmp_path / "b.cbk")


# ---------------------------------------------------------------------------------------------
# quantize_to_cbk (streaming) == quantize_checkpoint + write_cbk (in memory)
# ---------------------------------------------------------------------------------------------
from test_quantize import _tiny_llama  # noqa: E402  (the tiny HF models of tests/test_quantize.py)


def _in_memory_file(ckpt, recipe, out):
    from trapetum.quant.quantize import quantize_checkpoint, recipe_and_provenance
    qm = quantize_checkpoint(ckpt, recipe, progress=False, log=lambda s: None)
    rd, prov = recipe_and_provenance(ckpt, recipe, qm)
    write_cbk(out, config=qm.config, dense=qm.dense, quantized=qm.quantized, tokenizer=ckpt.tokenizer, recipe=rd,
              provenance=prov, generation=getattr(ckpt, "generation", None) or None)
    return qm


def _assert_same_file(a, b):
    fa, fb = CbkFile(a), CbkFile(b)
    ra, rb = Path(a).read_bytes(), Path(b).read_bytes()
    assert ra[fa.header_bytes:] == rb[fb.header_bytes:]  # every tensor, bit for bit, in the same place
    ta = {n: (t.dtype, t.shape, t.begin - fa.header_bytes) for n, t in fa.tensors_table.items()}
    assert ta == {n: (t.dtype, t.shape, t.begin - fb.header_bytes) for n, t in fb.tensors_table.items()}
    ma, mb = json.loads(json.dumps(fa.meta)), json.loads(json.dumps(fb.meta))
    for m in (ma, mb):
        assert m["provenance"].pop("created") and m["provenance"].pop("quantize_seconds") >= 0
    assert list(ma) == list(mb) and ma == mb
    assert fb.header_bytes >= fa.header_bytes  # the streamed file keeps its reserved room


CASES = {
    "tied-untied-head": dict(tie=True, recipe=dict(bits=4, head_bits=8, embed_bits=None)),
    "tied-shared-table": dict(tie=True, recipe=dict(bits=3, head_bits=8, embed_bits="auto")),
    "overrides": dict(tie=True, recipe=dict(bits=4, head_bits=None, keep_fp16=["model.layers.0.self_attn.q_proj"],
                                            bits_overrides=[("*.mlp.down_proj", 8), ("*.k_proj", 2)])),
    "bias-untied-fp16-kept": dict(tie=False, bias=True, recipe=dict(bits=2, head_bits=8, embed_bits=8,
                                                                    keep_fp16=["*.layers.1.self_attn.q_proj"])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_file_equals_in_memory_file(tmp_path, case):
    from trapetum.api import load_checkpoint
    from trapetum.quant.quantize import Recipe, quantize_to_cbk

    c = CASES[case]
    d = _tiny_llama(tmp_path / "src", tie=c["tie"], bias=c.get("bias", False))
    recipe = Recipe(weighted=False, calib="none", iters=6, **c["recipe"])
    ckpt = load_checkpoint(str(d))
    qm_mem = _in_memory_file(ckpt, recipe, tmp_path / "mem.cbk")
    logged = []
    path, qm = quantize_to_cbk(str(d), tmp_path / "stream.cbk", recipe, progress=False, log=logged.append)
    _assert_same_file(tmp_path / "mem.cbk", path)
    assert not any("outgrew" in m for m in logged)  # the reserved header room was enough
    assert [r["name"] for r in qm.report] == [r["name"] for r in qm_mem.report]
    for which in ("projections", "all"):
        assert qm.bits_per_weight(which) == qm_mem.bits_per_weight(which)
    assert sorted(qm.dense) == sorted(qm_mem.dense) and sorted(qm.quantized) == sorted(qm_mem.quantized)
    assert qm.config == qm_mem.config
    if c.get("bias"):  # requantize from the .cbk (QuantRecords carrying their bias): same again
        src = load_checkpoint(str(path))
        recipe2 = Recipe(bits=4, head_bits=8, weighted=False, calib="none", iters=4)
        _in_memory_file(src, recipe2, tmp_path / "mem2.cbk")
        quantize_to_cbk(src, tmp_path / "stream2.cbk", recipe2, progress=False, log=lambda s: None)
        _assert_same_file(tmp_path / "mem2.cbk", tmp_path / "stream2.cbk")
        assert CbkFile(tmp_path / "stream2.cbk").layers["model.layers.0.self_attn.q_proj.weight"].bias


def test_streamed_weighted_calibration_equals_in_memory(tmp_path):
    from trapetum.api import load_checkpoint
    from trapetum.quant.quantize import Recipe, quantize_to_cbk

    d = _tiny_llama(tmp_path / "src", tie=True)
    recipe = Recipe(bits=4, head_bits=8, calib=None, calib_seqs=2, calib_sample_len=16, iters=6)
    _in_memory_file(load_checkpoint(str(d)), recipe, tmp_path / "mem.cbk")
    quantize_to_cbk(str(d), tmp_path / "stream.cbk", recipe, progress=False, log=lambda s: None)
    _assert_same_file(tmp_path / "mem.cbk", tmp_path / "stream.cbk")


def test_failure_mid_stream_leaves_no_file(tmp_path, monkeypatch):
    from trapetum.quant import quantize as Q

    d = _tiny_llama(tmp_path / "src", tie=True)
    calls = []

    def boom(*a, **k):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("boom")
        return real(*a, **k)
    real = Q.quantize_matrix
    monkeypatch.setattr(Q, "quantize_matrix", boom)
    with pytest.raises(RuntimeError, match="boom"):
        Q.quantize_to_cbk(str(d), tmp_path / "x.cbk",
                          Q.Recipe(weighted=False, calib="none", iters=2), progress=False, log=lambda s: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# ---------------------------------------------------------------------------------------------
# Peak memory: streaming holds about one tensor's work; the in-memory path holds the whole output
# ---------------------------------------------------------------------------------------------
WIDE = dict(family="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=1,
            num_heads=4, num_kv_heads=4, head_dim=64, max_position_embeddings=128)
RUNS = [("stream", 2), ("stream", 16), ("stream", 48), ("memory", 48)]  # the first one warms up


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


def _fast_kmeans(W, K, imp=None, **kw):
    """Stand-in for k-means (this test is about memory, not about centroids): K levels spread
    evenly between each row's min and max."""
    from types import SimpleNamespace
    lo, hi = W.min(1, keepdim=True).values, W.max(1, keepdim=True).values
    codes = ((W - lo) / (hi - lo).clamp_min(1e-12) * (K - 1)).round_().to(torch.uint8)
    codebook = (lo + (hi - lo) * torch.linspace(0, 1, K).unsqueeze(0)).to(torch.float16)
    return SimpleNamespace(codebook=codebook, codes=codes, objective=torch.zeros(W.shape[0], dtype=torch.float64))


def _measure(out_dir: str) -> None:
    """Run in a fresh interpreter: quantize wide synthetic models of two depths, streaming and in
    memory, and print each run's peak growth of anonymous RSS (sampled every 2 ms)."""
    from trapetum.models.checkpoint import Checkpoint, LazyTensors
    from trapetum.models.schema import expected_shapes
    from trapetum.models.config import ModelConfig
    from trapetum.quant import quantize as Q

    from trapetum.quant import codebook_fit

    torch.set_num_threads(1)
    codebook_fit.kmeans_rows = _fast_kmeans  # quantize_matrix's k-means (codebook_fit.fit_rows)
    recipe = Q.Recipe(bits=8, head_bits=8, embed_bits=None, weighted=False, calib="none", iters=0,
                      codebook="f16", codebook8="f16", head_codebook="f16")  # the byte arithmetic: fp16 codebooks
    Q.quantize_matrix(torch.randn(8, 16), 8, None, recipe, "cpu", None)  # warm up (lazy imports)
    results = []
    for k, (mode, layers) in enumerate(RUNS):
        cfg = ModelConfig(**dict(WIDE, num_layers=layers))
        shapes = expected_shapes(cfg)

        def getter(i, name):  # produced on access, as a lazy loader reads them
            if "norm" in name:
                return lambda: torch.ones(shapes[name])
            return lambda: torch.randn(shapes[name], generator=torch.Generator().manual_seed(i))
        ckpt = Checkpoint(cfg, LazyTensors({n: getter(i, n) for i, n in enumerate(shapes)}, shapes=dict(shapes)),
                          None, "synthetic", "synthetic")
        out = os.path.join(out_dir, f"{k}.cbk")
        base = peak = _rss_anon()
        stop = threading.Event()

        def sample():
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, _rss_anon())
                time.sleep(0.002)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        t0 = time.perf_counter()
        if mode == "stream":
            Q.quantize_to_cbk(ckpt, out, recipe, progress=False, log=lambda s: None)
        else:
            qm = Q.quantize_checkpoint(ckpt, recipe, progress=False, log=lambda s: None)
            write_cbk(out, config=qm.config, dense=qm.dense, quantized=qm.quantized)
            del qm
        peak = max(peak, _rss_anon())
        stop.set()
        th.join()
        projs = [s for n, s in shapes.items() if n.startswith("model.layers.0.") and n.endswith("_proj.weight")]
        layer = sum(o * i + o * 256 * 2 for o, i in projs)  # 8-bit codes + fp16 codebooks
        tensor = max(o * i for o, i in projs)
        results.append({"mode": mode, "layers": layers, "peak_growth": peak - base,
                        "tensor_bytes": CbkFile(out).size_breakdown()["tensor_bytes"], "layer_output_bytes": layer,
                        "largest_projection_weights": tensor, "seconds": round(time.perf_counter() - t0, 2)})
        os.unlink(out)
    print(json.dumps(results))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc RSS figures")
def test_streaming_peak_memory_does_not_grow_with_the_model(tmp_path):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072",
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    code = f"from test_quantize_streaming import _measure; _measure({str(tmp_path)!r})"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    _, small, big, mem = json.loads(r.stdout.strip().splitlines()[-1])
    print(small, big, mem, sep="\n")
    layer = big["layer_output_bytes"]
    assert mem["tensor_bytes"] == big["tensor_bytes"] > 40 * layer
    # the in-memory path holds the whole output (the measurement sees it)...
    assert mem["peak_growth"] > big["tensor_bytes"] * 0.9
    # ...streaming three times as many layers costs no more than a layer or two of extra peak
    assert big["peak_growth"] - small["peak_growth"] < 2 * layer
    assert big["peak_growth"] < 0.25 * big["tensor_bytes"]


def test_record_bias_is_planned_or_refused(tmp_path):
    """A QuantRecord source carries its bias inside the record: the plan peeks at records (known
    formats: .cbk, AQLM, or a non-dtype format label) and never drops a bias it did not expect."""
    from dataclasses import replace

    from cbk_helpers import tiny_config
    from trapetum.errors import ConfigError
    from trapetum.formats.cbk import load_cbk
    from trapetum.models.checkpoint import LazyTensors
    from trapetum.quant.quantize import Recipe, plan_quantization, quantize_checkpoint

    cfg, dense, quantized = tiny_model(tiny_config(qkv_bias=True))
    write_cbk(tmp_path / "src.cbk", config=cfg, dense=dense, quantized=quantized)
    ck = load_cbk(tmp_path / "src.cbk")
    recipe = Recipe(bits=4, head_bits=8, weighted=False, calib="none", iters=2)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert plan_quantization(ck, recipe).quantized[q].bias == TensorSpec("F16", (cfg.num_heads * cfg.head_dim,))
    qm = quantize_checkpoint(ck, recipe, progress=False, log=lambda s: None)
    assert torch.equal(qm.quantized[q].bias, quantized[q].bias)
    T = ck.tensors
    labelled = replace(ck, source_format="other", tensors=LazyTensors(T._getters, dict(T.formats), dict(T.shapes)))
    assert plan_quantization(labelled, recipe).quantized[q].bias is not None
    bare = replace(ck, source_format="other", tensors=LazyTensors(T._getters))
    with pytest.raises(ConfigError, match="carries a bias the plan did not expect"):
        quantize_checkpoint(bare, recipe, progress=False, log=lambda s: None)


def test_streamed_file_equals_in_memory_file_gemma3(tmp_path):
    """qk-norm and sandwich norms inside the layers, a tied 8-bit table (the default "auto")."""
    import tiny_models
    from trapetum.api import load_checkpoint
    from trapetum.quant.quantize import Recipe, quantize_to_cbk

    tiny_models.build("gemma3", tmp_path / "src")
    recipe = Recipe(bits=4, head_bits=8, weighted=False, calib="none", iters=3)
    _in_memory_file(load_checkpoint(str(tmp_path / "src")), recipe, tmp_path / "mem.cbk")
    quantize_to_cbk(str(tmp_path / "src"), tmp_path / "stream.cbk", recipe, progress=False, log=lambda s: None)
    _assert_same_file(tmp_path / "mem.cbk", tmp_path / "stream.cbk")
    assert "model.layers.0.self_attn.q_norm.weight" in CbkFile(tmp_path / "stream.cbk").dense


@pytest.mark.parametrize("R,C,bits", [(300, 97, 3), (5, 1025, 4), (257, 53, 2), (64, 64, 8)])
def test_chunked_packing_and_errors_equal_whole_matrix(monkeypatch, R, C, bits):
    """quantize_matrix packs and measures row chunk by row chunk (bounded float64 work): same codes
    as packing the whole matrix, same errors as kmeans.weighted_error up to rounding."""
    from trapetum.quant import quantize as Q
    from trapetum.quant.kmeans import kmeans_rows, weighted_error
    from trapetum.kernels.pack import pack_codes

    monkeypatch.setattr(Q, "_POST_CHUNK", 1000)  # several chunks, rows not dividing evenly
    g = torch.Generator().manual_seed(R + C)
    W, imp = torch.randn(R, C, generator=g), torch.rand(C, generator=g)
    recipe = Q.Recipe(iters=2)
    rec, err = Q.quantize_matrix(W, bits, imp, recipe, "cpu", None)
    res = kmeans_rows(W, 1 << bits, imp, iters=2, starts=recipe.starts)
    Wq = torch.gather(res.codebook.float(), 1, res.codes.long())
    assert torch.equal(rec.tensors["codes"], pack_codes(res.codes, bits))
    assert torch.equal(rec.tensors["codebook"], res.codebook)
    assert err["rel_err"] == pytest.approx(weighted_error(W, Wq), rel=1e-12)
    assert err["rel_err_weighted"] == pytest.approx(weighted_error(W, Wq, imp), rel=1e-12)


def test_header_reserve_covers_worst_case_layer_errors():
    """80 layers (a 70B model): the end-of-run recipe additions, escaped twice as in the header
    (JSON text inside a JSON string), fit the reserve with the slack left for the rest."""
    from trapetum.quant.quantize import PROJ_SUFFIXES, QuantPlan, _header_reserve

    names = [f"model.layers.{i}.{s}" for i in range(80) for s in PROJ_SUFFIXES] + ["lm_head"]
    plan = QuantPlan(None, {}, {n + ".weight": None for n in names}, [])
    extra = {"bits_per_weight": {"projections": 4.123456, "all": 12.123456},
             "layer_errors": {n: 1.234567e-05 for n in names}}
    size = len(json.dumps(json.dumps(extra, separators=(",", ":"))))
    assert size + 2048 < _header_reserve(plan) < 3 * size + 8192  # enough, and not wasteful
