"""The torch-free half of the .cbk reader (formats/cbk_header.py, formats/cbk_contents.py) against the torch reader
(formats/cbk.py): the same description, the same `info` output, the same `verify` verdicts and lines; the numpy
content check never passes a file that the torch check refuses (issue 22: `info` and `verify` import no torch)."""
from __future__ import annotations

import io
import math
import subprocess
import sys
from argparse import Namespace
from contextlib import redirect_stdout

import pytest
import torch

from tests.cbk_helpers import tiny_model, tiny_tokenizer
from trapetum.formats import cbk_contents
from trapetum.formats.cbk import DTYPES, CbkFile, open_cbk, write_cbk
from trapetum.formats.cbk_contents import contents_pass, verify_file
from trapetum.formats.cbk_header import CbkHeader
from trapetum.formats.cbk_spec import DTYPE_SIZES, TensorSpec
from trapetum.quant.codebook_fit import fit_rows
from trapetum.kernels.pack import pack_codes
from trapetum.schemes.record import QuantRecord

Q = "model.layers.0.self_attn.q_proj.weight"  # [32, 32] in tiny_config
NAN, INF = float("nan"), float("inf")


def _model(storage: str = "u8", seed: int = 0):
    """tiny_model with its codebook layers fitted in ``storage`` (the head "shared", 5 rows a group)."""
    cfg, dense, quantized = tiny_model(seed=seed)
    g = torch.Generator().manual_seed(seed)
    for name, r in list(quantized.items()):
        R, C = r.shape
        bits = r.params["bits"]
        st = "shared" if name == "lm_head.weight" else storage
        _, codes, stored, params = fit_rows(torch.randn(R, C, generator=g), bits, None, storage=st, group_rows=5,
                                            iters=2)
        quantized[name] = QuantRecord("codebook", (R, C), params, {"codes": pack_codes(codes, bits), **stored}, r.bias)
    return cfg, dense, quantized


def _write(path, cfg, dense, quantized, **kw):
    return write_cbk(path, config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer(), **kw)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("hdr")
    return {st: _write(d / f"{st}.cbk", *_model(st), recipe={"bits": 4, "layer_errors": {Q: 0.1}},
                       provenance={"source": "tiny"}, generation={"temperature": 0.7}) for st in ("u8", "f16", "shared")}


def test_dtype_table_matches_torch():
    assert set(DTYPES) == set(DTYPE_SIZES)
    for name, dt in DTYPES.items():
        assert torch.empty((), dtype=dt).element_size() == DTYPE_SIZES[name]
        assert TensorSpec.of(torch.zeros(2, 3, dtype=dt)) == TensorSpec(name, (2, 3))
    with pytest.raises(ValueError, match="cannot be stored"):
        TensorSpec.of(torch.zeros(2, dtype=torch.complex64))


def test_torch_schemes_are_the_registry_less_codebook():
    from trapetum.schemes.registry import SCHEMES
    assert set(SCHEMES) == {"dense", "codebook", *cbk_contents.TORCH_SCHEMES}


@pytest.mark.parametrize("storage", ["u8", "f16", "shared"])
def test_description_is_the_checkpoint_less_its_tensors(good, storage):
    full = open_cbk(good[storage]).to_checkpoint()
    with CbkHeader(good[storage]) as h:
        desc = h.description()
    assert len(full.tensors) > 0 and len(desc.tensors) == 0
    assert desc.config == full.config and desc.meta == full.meta and desc.generation == full.generation
    assert desc.tensors.formats == full.tensors.formats and desc.tensors.shapes == full.tensors.shapes
    assert desc.tensor_formats() == full.tensor_formats()
    assert (desc.source, desc.source_format) == (full.source, full.source_format)
    assert desc.tokenizer.to_dict() == full.tokenizer.to_dict()


def _info(model, json_out: bool) -> str:
    from trapetum.commands import info
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert info.run(Namespace(model=str(model), json=json_out, gpu_mem=None, ctx=None)) == 0
    return buf.getvalue()


@pytest.mark.parametrize("json_out", [False, True])
def test_info_prints_what_the_torch_reader_gave(good, monkeypatch, json_out):
    """`info` on the header only prints byte for byte what it prints from the torch reader's checkpoint."""
    from trapetum.formats import detect
    light = _info(good["u8"], json_out)
    assert ('"sizes"' if json_out else "\nfile ") in light and "provenance" in light
    monkeypatch.setattr(detect, "describe_checkpoint", detect.load_checkpoint)
    assert _info(good["u8"], json_out) == light


def _hostile(tmp_path, case: str):
    """A file whose checksums match but whose contents hold ``case``."""
    cfg, dense, quantized = _model("u8", seed=3)
    r = quantized[Q]
    t = dict(r.tensors)
    params = dict(r.params)
    if case == "dense_nan_f32":
        name = next(n for n, v in dense.items() if v.dtype == torch.float32)
        dense[name] = dense[name].clone().index_fill_(0, torch.tensor([0]), NAN)
    elif case in ("dense_inf_bf16", "dense_nan_f16"):
        dt = torch.bfloat16 if case == "dense_inf_bf16" else torch.float16
        name = next(n for n, v in dense.items() if v.dtype == dt and v.dim() == 2)
        dense[name] = dense[name].clone()
        dense[name][1, 2] = INF if dt == torch.bfloat16 else NAN
    elif case == "range_inf":
        t["codebook_range"] = t["codebook_range"].clone()
        t["codebook_range"][4, 1] = INF
    elif case in ("decode_overflow", "decode_near_fp16_max", "decode_below_margin"):
        lo = {"decode_overflow": 60000.0, "decode_near_fp16_max": 65400.0, "decode_below_margin": 64992.0}[case]
        rng = torch.zeros_like(t["codebook_range"])
        rng[:, 0] = lo
        rng[:, 1] = 100.0 if case == "decode_overflow" else 0.0
        t["codebook_range"] = rng
    elif case == "codes_int8":
        t["codes"] = t["codes"].view(torch.int8)
    elif case == "codes_shape":
        t["codes"] = t["codes"][:, :-1].contiguous()
    elif case == "u8_shape":
        t["codebook_u8"] = t["codebook_u8"][:, :8].contiguous()
    elif case == "bits_9":
        params["bits"] = 9
    elif case == "bits_true":
        params["bits"] = True
    elif case == "storage_unknown":
        params["codebook"] = "fp8"
    elif case == "group_rows_given":
        params["group_rows"] = 4
    elif case == "shared_group_zero":
        quantized["lm_head.weight"].params["group_rows"] = 0
    elif case == "shared_scale_nan":
        h = quantized["lm_head.weight"]
        h.tensors["row_scale"] = h.tensors["row_scale"].clone()
        h.tensors["row_scale"][3] = NAN
    elif case == "f16_codebook_nan":
        cfg, dense, quantized = _model("f16", seed=3)
        cb = quantized[Q].tensors["codebook"].clone()
        cb[0, 0] = NAN
        quantized[Q].tensors["codebook"] = cb
        return _write(tmp_path / f"{case}.cbk", cfg, dense, quantized)
    elif case == "extra_role":
        t["extra"] = torch.zeros(3, dtype=torch.float16)
    elif case == "aqlm_layer":
        quantized[Q] = QuantRecord("aqlm", (32, 32), {"num_codebooks": 1, "nbits": 8, "in_group_size": 8,
                                                       "out_group_size": 1},
                                   {"codes": torch.zeros(32, 4, 1, dtype=torch.int8),
                                    "codebooks": torch.randn(1, 256, 1, 8).half(),
                                    "scales": torch.ones(32, 1, 1, 1).half()})
        return _write(tmp_path / f"{case}.cbk", cfg, dense, quantized)
    elif case == "unknown_scheme":
        quantized[Q] = QuantRecord("future", (32, 32), {"x": 1}, {"blob": torch.zeros(7, dtype=torch.uint8)})
        return _write(tmp_path / f"{case}.cbk", cfg, dense, quantized)
    elif case != "intact":
        raise AssertionError(case)
    quantized[Q] = QuantRecord("codebook", r.shape, params, t, r.bias)
    return _write(tmp_path / f"{case}.cbk", cfg, dense, quantized)


CASES = ["intact", "dense_nan_f32", "dense_inf_bf16", "dense_nan_f16", "range_inf", "decode_overflow",
         "decode_near_fp16_max", "decode_below_margin", "codes_int8", "codes_shape", "u8_shape", "bits_9", "bits_true",
         "storage_unknown", "group_rows_given", "shared_group_zero", "shared_scale_nan", "f16_codebook_nan",
         "extra_role", "aqlm_layer", "unknown_scheme"]
SOUND = {"intact", "decode_near_fp16_max", "decode_below_margin", "aqlm_layer", "unknown_scheme"}  # the torch check passes


@pytest.mark.parametrize("case", CASES)
def test_verify_file_gives_the_torch_verdict(tmp_path, case):
    """verify_file == CbkFile.verify (lines and all); the numpy check passes a file only when the torch check
    does, and passes the plain ones (no torch needed for them)."""
    path = _hostile(tmp_path, case)
    want = CbkFile(path).verify()
    assert (want == []) == (case in SOUND), want
    h, got = verify_file(path)
    assert got == want
    shown = contents_pass(h)
    assert not shown or want == [], f"{case}: the numpy check passed a file the torch check refuses: {want}"
    # what it leaves to torch: problems, another scheme, a decode too near the fp16 range to call
    assert shown == (case in ("intact", "unknown_scheme", "decode_below_margin")), case


def test_verify_file_checksum_mismatch_first(good, tmp_path):
    data = bytearray(good["u8"].read_bytes())
    f = open_cbk(good["u8"])
    t = f.tensors_table["model.layers.1.mlp.down_proj.codes"]
    data[t.begin] ^= 1
    bad = tmp_path / "bad.cbk"
    bad.write_bytes(bytes(data))
    h, problems = verify_file(bad)
    assert problems == CbkFile(bad).verify() and len(problems) == 1 and "checksum mismatch" in problems[0]


def test_near_margin_decodes_are_finite_in_fp16():
    """DECODE_MARGIN is below the fp16 overflow point with room for any float32 rounding difference."""
    m = cbk_contents.DECODE_MARGIN
    assert math.isfinite(float(torch.tensor(m * (1 + 1e-6)).half())) and m < 65504


def test_verify_command_on_a_hostile_file_prints_the_torch_lines(tmp_path):
    path = _hostile(tmp_path, "range_inf")
    want = CbkFile(path).verify()
    r = subprocess.run([sys.executable, "-m", "trapetum.cli", "verify", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [f"trapetum: error: {w}" for w in want] + [
        f"trapetum: error: FAILED {path}: 1 problem"]
