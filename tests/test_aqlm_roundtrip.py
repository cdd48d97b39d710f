"""AQLM directory -> .cbk -> AQLM directory: codes, codebooks and scales byte for byte; CLI; bad input."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from aqlm_helpers import make_aqlm_dir
from trapetum.cli import main
from trapetum.errors import FormatError
from trapetum.quant.convert_aqlm import export_aqlm, import_aqlm
from trapetum.formats.cbk import open_cbk
from trapetum.quant.additive import AdditiveLinear
from trapetum.schemes import registry


def build_linear(record, name):
    return registry.reference_linear(record, None, name, dtype=None, device=None)

ROLES = (".codes", ".codebooks", ".scales")


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("family,M,nbits", [("llama2", 2, 8), ("qwen2", 1, 16), ("llama3", 2, 8)])
def test_round_trip_byte_identical(tmp_path, family, M, nbits):
    src = make_aqlm_dir(tmp_path, family, M, nbits, random_codes=True)
    cbk = tmp_path / "m.cbk"
    import_aqlm(src, cbk)
    f = open_cbk(cbk)
    assert not f.verify()
    n = sum(l.scheme == "aqlm" for l in f.layers.values())
    assert n == 7 * f.config.num_layers
    assert f.layers["lm_head.weight"].scheme == "codebook" and f.layers["lm_head.weight"].params["bits"] == 8
    f.close()
    out = export_aqlm(cbk, tmp_path / "back")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    keys = [k for k in a if k.endswith(ROLES)]
    assert len(keys) == 3 * n
    for k in keys:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert _bytes(a[k]) == _bytes(b[k]), k
    for k in a:  # the rest as the source has it (biases, norms, embedding)
        if not k.endswith(ROLES) and k != "lm_head.weight":
            assert torch.equal(a[k], b[k]), k
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["num_codebooks"] == M and qc["nbits_per_codebook"] == nbits and "lm_head" in qc["linear_weights_not_to_quantize"]
    # second trip: the exported directory imports to the same AQLM bytes
    import_aqlm(out, tmp_path / "m2.cbk")
    g1, g2 = open_cbk(cbk), open_cbk(tmp_path / "m2.cbk")
    for name, l in g1.layers.items():
        for role, stored in l.tensors.items():
            assert _bytes(g1.tensor(stored)) == _bytes(g2.tensor(g2.layers[name].tensors[role]))


def test_cli_and_module(tmp_path):
    src = make_aqlm_dir(tmp_path, "llama2", 2, 8, random_codes=True)
    assert main(["import-aqlm", str(src), "-o", str(tmp_path / "c.cbk")]) == 0
    assert main(["export-aqlm", str(tmp_path / "c.cbk"), "-o", str(tmp_path / "d")]) == 0
    f = open_cbk(tmp_path / "c.cbk")
    rec = f.record("model.layers.1.mlp.down_proj.weight")
    mod = build_linear(rec, "x")
    assert isinstance(mod, AdditiveLinear) and mod.in_features == 96 and mod.out_features == 64
    # W = scales * sum_m codebooks[m][codes mod 256], computed independently here
    idx = rec.tensors["codes"].long() % 256
    cb = rec.tensors["codebooks"].double()[:, :, 0, :]
    W = (cb[0][idx[..., 0]] + cb[1][idx[..., 1]]).reshape(64, 96) * rec.tensors["scales"].double().view(64, 1)
    assert torch.allclose(mod.dequantize(torch.float64), W, rtol=0, atol=1e-12)
    x = torch.randn(3, 96)
    assert torch.allclose(mod(x), x @ mod.weight.T, atol=1e-5)
    assert mod.bits_per_weight() > 2.0


def test_bad_records_and_dirs(tmp_path):
    src = make_aqlm_dir(tmp_path, "llama2", 2, 8, random_codes=True)
    import_aqlm(src, tmp_path / "c.cbk")
    rec = open_cbk(tmp_path / "c.cbk").record("model.layers.0.self_attn.q_proj.weight")
    for mutate in (lambda r: r.tensors.__setitem__("codes", r.tensors["codes"].to(torch.int16)),
                   lambda r: r.tensors.__setitem__("scales", r.tensors["scales"][:3]),
                   lambda r: r.tensors.pop("codebooks"),
                   lambda r: r.params.__setitem__("nbits", 40),
                   lambda r: r.tensors.__setitem__("codebooks", r.tensors["codebooks"].clone().fill_(float("nan")))):
        r = open_cbk(tmp_path / "c.cbk").record("model.layers.0.self_attn.q_proj.weight")
        mutate(r)
        with pytest.raises(FormatError):
            build_linear(r, "q")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="not an AQLM"):
        import_aqlm(src, tmp_path / "x.cbk")
    assert main(["import-aqlm", str(tmp_path / "nothere"), "-o", str(tmp_path / "y.cbk")]) == 1
    # a scalar-only .cbk has nothing to export as AQLM
    assert rec.scheme == "aqlm"


def test_aqlm_dir_loads_directly(tmp_path):
    """trapetum.load / ppl / quantize accept an AQLM directory as a model (routed by load_checkpoint)."""
    import trapetum
    src = make_aqlm_dir(tmp_path, "llama2", 2, 8, random_codes=True)
    m = trapetum.load(src)
    assert isinstance(m.decoder.get_submodule("model.layers.0.mlp.down_proj"), AdditiveLinear)
    import_aqlm(src, tmp_path / "m.cbk")
    c = trapetum.load(tmp_path / "m.cbk")
    ids = list(range(3, 20))
    a, b = m.logits(ids), c.logits(ids)
    assert torch.isfinite(a).all()
    # same additive layers; only the LM head differs (fp16 in the directory, 8-bit codebook in the .cbk)
    assert float((a - b).norm() / b.norm()) < 5e-2
    assert len(m.generate(ids, max_new_tokens=4, ignore_eos=True).token_ids) == 4
