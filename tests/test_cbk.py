"""The .cbk file: round trip, safetensors compatibility, atomic writes under SIGKILL, verify, versions."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from cbk_helpers import codebook_record, join_file, split_file, tiny_config, tiny_model, tiny_tokenizer
from trapetum import cli
from trapetum.errors import FormatError
from trapetum.formats.cbk import (CbkWriter, QuantSpec, TensorSpec, load_cbk, open_cbk, size_breakdown,
                                  verify_cbk, write_cbk)
from trapetum.schemes.record import QuantRecord

RECIPE = {"bits": 4, "head_bits": 8, "calib": "self-sampled", "iters": 10}
PROVENANCE = {"source": "tiny-random", "source_sha256": "ab" * 32}


def write_tiny(path, cfg=None, **kw):
    cfg, dense, quantized = tiny_model(cfg)
    write_cbk(path, config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer(), recipe=RECIPE,
              provenance=PROVENANCE, **kw)
    return cfg, dense, quantized


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)


@pytest.mark.parametrize("variant", ["plain", "qkv_bias_tied"])
def test_round_trip_bit_identical(tmp_path, variant):
    cfg = tiny_config() if variant == "plain" else tiny_config(qkv_bias=True, tie_word_embeddings=True)
    path = tmp_path / "m.cbk"
    cfg, dense, quantized = write_tiny(path, cfg, generation={"temperature": 0.7, "top_p": 0.9})
    ck = load_cbk(path)
    assert ck.source_format == "cbk" and ck.source == str(path)
    assert ck.config == cfg and ck.config.to_dict() == cfg.to_dict()
    assert set(ck.tensors) == set(dense) | set(quantized)
    for name, t in dense.items():
        assert same(ck.tensors[name], t), name
    for name, r in quantized.items():
        got = ck.tensors[name]
        assert isinstance(got, QuantRecord)
        assert (got.scheme, got.shape, got.params) == (r.scheme, tuple(r.shape), r.params)
        assert set(got.tensors) == set(r.tensors)
        assert all(same(got.tensors[k], r.tensors[k]) for k in r.tensors)
        assert (got.bias is None) == (r.bias is None) and (r.bias is None or same(got.bias, r.bias))
    if variant == "qkv_bias_tied":
        assert "lm_head.weight" not in ck.tensors
        assert ck.tensors["model.layers.0.self_attn.q_proj.weight"].bias is not None  # quantized with bias
        assert "model.layers.0.self_attn.k_proj.bias" in ck.tensors  # dense bias
    formats = ck.tensor_formats()
    assert formats["model.layers.0.self_attn.q_proj.weight"] == "codebook-4bit"
    assert formats["model.layers.0.self_attn.k_proj.weight"] in ("F16", "BF16", "F32")
    assert ck.tensors.shapes["model.layers.1.mlp.down_proj.weight"] == (32, 48)
    # tokenizer, recipe, provenance, generation
    tok = tiny_tokenizer()
    assert ck.tokenizer.to_dict() == tok.to_dict()
    assert ck.tokenizer.encode("hello world the cat 日本") == tok.encode("hello world the cat 日本")
    assert ck.tokenizer.bos_id == tok.bos_id and ck.tokenizer.eos_ids == tok.eos_ids
    assert ck.meta["recipe"] == RECIPE
    prov = ck.meta["provenance"]
    assert prov["source"] == "tiny-random" and prov["source_sha256"] == "ab" * 32
    assert prov["tool_version"] and prov["created"].endswith("Z")
    assert ck.generation == {"temperature": 0.7, "top_p": 0.9}
    assert ck.meta["sizes"]["file_bytes"] == path.stat().st_size
    assert open_cbk(path).verify() == []


def test_safetensors_library_reads_it(tmp_path):
    path = tmp_path / "m.cbk"
    _, dense, quantized = write_tiny(path)
    tensors = load_file(path)
    for name, t in dense.items():
        assert same(tensors[name], t)
    for name, r in quantized.items():
        prefix = name[:-len(".weight")]
        for role, t in r.tensors.items():
            assert same(tensors[f"{prefix}.{role}"], t)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["trapetum"])["format"] == "trapetum-cbk"
    assert json.loads(meta["trapetum"])["version"] == 1
    # the header is padded so that every tensor is aligned to its element size
    cbk = open_cbk(path)
    assert cbk.header_bytes % 8 == 0
    assert all(t.begin % torch.empty((), dtype=tensors[t.name].dtype).element_size() == 0
               for t in cbk.tensors_table.values())


def test_tensors_are_lazy_copy_on_write_views(tmp_path):
    path = tmp_path / "m.cbk"
    _, dense, _ = write_tiny(path)
    before = path.read_bytes()
    cbk = open_cbk(path)
    t = cbk.tensor("model.embed_tokens.weight")
    t.mul_(2)  # writing to a loaded tensor must never reach the file
    assert path.read_bytes() == before
    assert same(cbk.tensor("model.embed_tokens.weight"), dense["model.embed_tokens.weight"])
    assert cbk.verify() == []


def test_size_breakdown(tmp_path):
    path = tmp_path / "m.cbk"
    cfg, dense, quantized = write_tiny(path)
    s = size_breakdown(path)
    assert set(s["kinds"]) == {"attention", "mlp", "embedding", "lm_head", "norms"}
    head = s["kinds"]["lm_head"]  # 8-bit codes [64, 32] + fp16 codebook [64, 256]
    assert head["bytes"] == 64 * 32 + 64 * 256 * 2 and head["weights"] == 64 * 32
    assert head["bits_per_weight"] == pytest.approx(8 * head["bytes"] / head["weights"])
    assert head["formats"] == {"codebook-8bit": 1}
    assert s["kinds"]["embedding"]["bits_per_weight"] == 16.0
    assert s["tensor_bytes"] + s["header_bytes"] == s["file_bytes"] == path.stat().st_size
    assert s["weights"] == sum(torch.Size(shape).numel() for shape in
                               __import__("trapetum.models.schema", fromlist=["x"]).expected_shapes(cfg).values())


def test_streaming_writer_out_of_order(tmp_path):
    """Declare specs first, then put tensors in any order (a quantizer working layer by layer)."""
    cfg, dense, quantized = tiny_model()
    path = tmp_path / "m.cbk"
    with CbkWriter(path, config=cfg, tokenizer=None) as w:
        for name, t in dense.items():
            w.declare_dense(name, TensorSpec.of(t))
        for name, r in quantized.items():
            w.declare_quantized(name, QuantSpec.of(r))
        for name, r in reversed(list(quantized.items())):
            w.put_quantized(name, r)
        for name, t in reversed(list(dense.items())):
            w.put_dense(name, t)
    cbk = open_cbk(path)
    assert cbk.verify() == [] and cbk.tokenizer is None
    assert all(same(cbk.tensor(n), t) for n, t in dense.items())


def _listing(d):
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("problem", ["shape_vs_config", "missing_tensor", "wrong_put", "exception_midway"])
def test_failed_write_leaves_nothing(tmp_path, problem):
    path = tmp_path / "m.cbk"
    write_tiny(path)
    old = path.read_bytes()
    cfg, dense, quantized = tiny_model(seed=1)
    if problem == "shape_vs_config":
        dense["model.norm.weight"] = torch.zeros(31)
    elif problem == "missing_tensor":
        del dense["model.layers.1.mlp.up_proj.weight"]
    if problem in ("shape_vs_config", "missing_tensor"):
        with pytest.raises(ValueError, match="model.norm.weight|up_proj"):
            write_cbk(path, config=cfg, dense=dense, quantized=quantized)
    else:
        with pytest.raises((ValueError, RuntimeError)):
            with CbkWriter(path, config=cfg) as w:
                for name, t in dense.items():
                    w.declare_dense(name, TensorSpec.of(t))
                for name, r in quantized.items():
                    w.declare_quantized(name, QuantSpec.of(r))
                w.put_dense("model.norm.weight", dense["model.norm.weight"])
                if problem == "wrong_put":
                    w.put_dense("model.embed_tokens.weight", torch.zeros(3))
                raise RuntimeError("source went away")
    assert _listing(tmp_path) == ["m.cbk"] and path.read_bytes() == old


def test_tampered_tensor_fails_verify(tmp_path, capsys):
    path = tmp_path / "m.cbk"
    write_tiny(path)
    assert cli.main(["verify", str(path)]) == 0
    assert capsys.readouterr().out.startswith("OK ")
    cbk = open_cbk(path)
    victim = cbk.tensors_table["model.layers.1.self_attn.q_proj.codebook"]
    data = bytearray(path.read_bytes())
    data[(victim.begin + victim.end) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    problems = open_cbk(path).verify()  # structure is intact: it opens, verify finds the tensor
    assert len(problems) == 1
    assert "model.layers.1.self_attn.q_proj.codebook" in problems[0] and "checksum mismatch" in problems[0]
    assert cli.main(["verify", str(path)]) == 1
    out, err = capsys.readouterr()
    assert not out and all(line.startswith("trapetum: error: ") for line in err.splitlines()), err
    assert "model.layers.1.self_attn.q_proj.codebook" in err and "FAILED" in err
    # a malformed file is a problem for verify too, never a traceback: one line on stderr
    path.write_bytes(bytes(data[:100]))
    assert cli.main(["verify", str(path)]) == 1
    out, err = capsys.readouterr()
    assert not out and len(err.splitlines()) == 1 and err.startswith("trapetum: error: ") and str(path) in err


@pytest.mark.parametrize("version", [3, 0, 99])
def test_other_version_refused(tmp_path, version):
    path = tmp_path / "m.cbk"
    write_tiny(path)
    header, body = split_file(path.read_bytes())
    meta = json.loads(header["__metadata__"]["trapetum"])
    meta["version"] = version
    header["__metadata__"]["trapetum"] = json.dumps(meta)
    path.write_bytes(join_file(header, body))
    with pytest.raises(FormatError) as e:
        open_cbk(path)
    assert str(e.value) == f"{path} has .cbk version {version}; this build reads versions 1 and 2"
    _, problems = verify_cbk(path)
    assert problems == [str(e.value)]


# ---------------------------------------------------------------------------------------------
# Kill test: SIGKILL a writer at random points; the target is absent or complete and valid.
# ---------------------------------------------------------------------------------------------
def _check_target(path) -> int | None:
    """None if the target is absent, else the seed of the complete, valid file found there."""
    if not path.exists():
        return None
    cbk = open_cbk(path)  # raises FormatError on a partial file
    assert cbk.verify() == []
    return cbk.recipe["seed"]


def test_sigkill_during_write_is_atomic(tmp_path):
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cbk_writer_child.py")), "--serve"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    try:
        assert server.stdout.readline().strip() == "ready"

        def run(path, seed, kill_after=None):
            server.stdin.write(f"{path} {seed}\n")
            server.stdin.flush()
            pid = int(server.stdout.readline().split()[1])
            if kill_after is not None:
                time.sleep(kill_after)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # already finished and reaped
                    pass
            _, _, code, elapsed = server.stdout.readline().split()
            assert int(code) in ((0,) if kill_after is None else (0, -signal.SIGKILL)), code
            return float(elapsed)

        old = tmp_path / "old.cbk"
        write_time = min(run(old, 0) for _ in range(3))
        old_bytes = old.read_bytes()
        rng = random.Random(1234)
        outcomes = {"absent": 0, "new": 0, "old kept": 0, "replaced": 0}
        for trial in range(1, 101):
            path = tmp_path / f"t{trial}.cbk"
            overwrite = trial % 4 == 0  # an existing file survives intact or is replaced by a complete one
            if overwrite:
                path.write_bytes(old_bytes)
            run(path, trial, kill_after=rng.uniform(0, 1.3 * write_time))
            seed = _check_target(path)
            if overwrite:
                assert seed in (0, trial)
                outcomes["old kept" if seed == 0 else "replaced"] += 1
            else:
                assert seed in (None, trial)
                outcomes["absent" if seed is None else "new"] += 1
            for leftover in tmp_path.glob(f".{path.name}.*.tmp"):  # a killed writer leaves its temp file
                leftover.unlink()
            path.unlink(missing_ok=True)
    finally:
        server.stdin.close()
        server.wait(10)
        server.stdout.close()
    print(f"write {write_time * 1000:.0f} ms; outcomes {outcomes}")
    assert outcomes["absent"] >= 5 and outcomes["new"] >= 5, outcomes  # kills landed on both sides
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.cbk"]


def test_every_dtype_round_trips(tmp_path):
    """Tensors of a quantized layer keep their dtype and bytes, whatever the dtype."""
    from trapetum.formats.cbk import DTYPES
    cfg, dense, quantized = tiny_model()
    rng = random.Random(7)
    roles = {}
    for name, dtype in DTYPES.items():
        size = torch.empty((), dtype=dtype).element_size()
        raw = bytes(rng.randrange(2) for _ in range(6 * size)) if dtype == torch.bool else rng.randbytes(6 * size)
        roles[f"t_{name.lower()}"] = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(2, 3)
    roles["empty"] = torch.empty(0, 5, dtype=torch.float16)
    roles["scalar"] = torch.tensor(3.5, dtype=torch.float32)
    quantized[Q := "model.layers.0.mlp.up_proj.weight"] = QuantRecord("test", (48, 32), {"nested": {"a": [1, 2]}},
                                                                      roles)
    del dense[Q]
    write_cbk(tmp_path / "d.cbk", config=cfg, dense=dense, quantized=quantized)
    got = open_cbk(tmp_path / "d.cbk").record(Q)
    assert got.params == {"nested": {"a": [1, 2]}}
    for role, t in roles.items():
        assert same(got.tensors[role], t), role


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_streaming_write_memory_is_one_tensor(tmp_path):
    """A 224 MB file written through CbkWriter from tensors made one at a time: resident memory grows by
    about one tensor (32 MB), not by the file (what makes a file bigger than RAM writable)."""
    from trapetum.models.schema import expected_shapes
    cfg = tiny_config(vocab_size=8192, hidden_size=2048, intermediate_size=4096, num_layers=2, num_heads=16,
                      num_kv_heads=16, head_dim=128)
    shapes = expected_shapes(cfg)
    base = _rss()
    peak = 0
    with CbkWriter(tmp_path / "big.cbk", config=cfg) as w:
        for name, shape in shapes.items():
            w.declare_dense(name, TensorSpec("F16", shape))
        for i, (name, shape) in enumerate(shapes.items()):
            w.put_dense(name, torch.full(shape, float(i), dtype=torch.float16))
            peak = max(peak, _rss() - base)
    size = (tmp_path / "big.cbk").stat().st_size
    assert size > 200 * 2**20
    assert peak < 80 * 2**20, f"resident memory grew by {peak / 2**20:.0f} MiB writing {size / 2**20:.0f} MiB"
    cbk = open_cbk(tmp_path / "big.cbk")
    assert cbk.tensor("model.layers.1.mlp.down_proj.weight")[0, 0].item() == \
        list(shapes).index("model.layers.1.mlp.down_proj.weight")


def test_rewritten_by_safetensors_or_reordered_still_valid(tmp_path):
    """The metadata hash leaves offsets out: a file re-saved by safetensors, or with its tensors in
    another order (here one that misaligns F16 tensors after an odd-sized U8 one), stays valid."""
    from safetensors.torch import save_file
    cfg, dense, quantized = tiny_model()
    q = "model.layers.0.mlp.up_proj.weight"
    quantized[q] = QuantRecord("test", (48, 32), {}, {"odd": torch.arange(3, dtype=torch.uint8),
                                                      "w": torch.randn(48, 32).half()})
    del dense[q]
    path = tmp_path / "m.cbk"
    write_cbk(path, config=cfg, dense=dense, quantized=quantized)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    resaved = tmp_path / "resaved.cbk"
    save_file(load_file(path), resaved, metadata=metadata)
    header, body = split_file(path.read_bytes())
    names = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])
    names.remove("model.layers.0.mlp.up_proj.odd")
    names.insert(0, "model.layers.0.mlp.up_proj.odd")  # everything after it is misaligned
    pos, chunks = 0, []
    for n in names:
        b, e = header[n]["data_offsets"]
        chunks.append(body[b:e])
        header[n]["data_offsets"] = [pos, pos + e - b]
        pos += e - b
    reordered = tmp_path / "reordered.cbk"
    reordered.write_bytes(join_file(header, b"".join(chunks)))
    for p in (resaved, reordered):
        cbk = open_cbk(p)
        assert cbk.verify() == []
        assert all(same(cbk.tensor(n), t) for n, t in dense.items())
        assert all(same(cbk.record(q).tensors[r], t) for r, t in quantized[q].tensors.items())
    assert open_cbk(reordered).tensors_table["model.embed_tokens.weight"].begin % 2 == 1


def test_writer_refuses_bad_arguments(tmp_path):
    cfg, dense, quantized = tiny_model()
    path = tmp_path / "m.cbk"
    with pytest.raises(ValueError, match="recipe is not plain JSON"):
        write_cbk(path, config=cfg, dense=dense, quantized=quantized, recipe={"x": float("nan")})
    with pytest.raises(ValueError, match="declared twice"):  # a quantized layer's bias also given dense
        bias = {"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}
        q = dict(quantized)
        q["model.layers.0.self_attn.q_proj.weight"] = codebook_record((32, 32), bias=True)
        write_cbk(path, config=tiny_config(qkv_bias=True), dense={**dense, **bias}, quantized=q)
    with pytest.raises(ValueError, match="bad tensor role"):
        w = CbkWriter(path, config=cfg)
        w.declare_quantized("model.layers.0.self_attn.q_proj.weight",
                            QuantSpec("codebook", (32, 32), {}, {"bias": TensorSpec("F16", (32,))}))
    w.abort()
    assert _listing(tmp_path) == []
