"""The schemes' reference modules: CodebookLinear forward == dequantize() @ x, dequantize exactness, record
validation (FormatError naming the tensor), RTN; the registry's dispatch."""
from __future__ import annotations

import pytest
import torch

from trapetum.errors import FormatError
from trapetum.kernels.pack import pack_codes, packed_width
from trapetum.quant.kmeans import codebook_linear
from trapetum.quant.rtn import rtn_linear
from trapetum.schemes import registry
from trapetum.schemes.record import QuantRecord
from trapetum.schemes.rtn import rtn_bits_per_weight


def build_linear(record, name="?"):
    return registry.reference_linear(record, None, name, dtype=None, device=None)


def build_embedding(record):
    return registry.reference_embedding(record)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(5, 3), (16, 53), (7, 257)])
def test_dequantize_exact_and_forward(bits, shape):
    out_f, in_f = shape
    g = torch.Generator().manual_seed(bits + in_f)
    codes = torch.randint(0, 1 << bits, (out_f, in_f), generator=g)
    cb = torch.randn(out_f, 1 << bits, generator=g).half()
    bias = torch.randn(out_f, generator=g)
    m = build_linear(QuantRecord("codebook", shape, {"bits": bits},
                                 {"codes": pack_codes(codes, bits), "codebook": cb}, bias))
    W = m.dequantize()
    ref = torch.stack([cb[o].float()[codes[o]] for o in range(out_f)])
    assert torch.equal(W, ref)  # exact: fp16 centroids, gathered
    assert torch.equal(m.weight, ref)
    x = torch.randn(2, 3, in_f, generator=g)
    assert torch.allclose(m(x), x @ ref.T + bias, rtol=1e-5, atol=1e-5)
    assert m.in_features == in_f and m.out_features == out_f
    expect_bpw = packed_width(in_f, bits) * 8 / in_f + (1 << bits) * 16 / in_f
    assert abs(m.bits_per_weight() - expect_bpw) < 1e-9


def test_from_weight_and_record_round_trip():
    W = torch.randn(32, 100)
    m = codebook_linear(W, 4, importance=torch.rand(100))
    m2 = build_linear(m.to_record())
    assert torch.equal(m.dequantize(), m2.dequantize())
    assert float((m.dequantize() - W).norm() / W.norm()) < 0.15
    e = build_embedding(m.to_record())
    ids = torch.tensor([[0, 31], [4, 4]])
    assert torch.equal(e(ids), m.dequantize()[ids])


@pytest.mark.parametrize("mutate,msg", [
    (lambda r: r.params.update(bits=5), "bits"),
    (lambda r: r.params.update(bits=True), "bits"),
    (lambda r: r.tensors.update(codes=r.tensors["codes"][:, :-1]), "codes shape"),
    (lambda r: r.tensors.update(codes=r.tensors["codes"].to(torch.int8)), "uint8"),
    (lambda r: r.tensors.update(codebook=r.tensors["codebook"].float()), "float16"),
    (lambda r: r.tensors.update(codebook=r.tensors["codebook"][:, :8]), "codebook shape"),
    (lambda r: r.tensors.pop("codebook"), "needs tensors"),
    (lambda r: r.tensors.update(extra=torch.zeros(1)), "unexpected"),
    (lambda r: setattr(r, "shape", (8, -1)), "logical shape"),
    (lambda r: setattr(r, "shape", (8,)), "logical shape"),
    (lambda r: setattr(r, "bias", torch.zeros(3)), "bias"),
    (lambda r: setattr(r, "scheme", "mystery"), "unknown quantization scheme"),
    (lambda r: r.tensors.update(codebook=torch.full((8, 16), float("nan")).half()), "non-finite"),
])
def test_build_linear_rejects_malformed(mutate, msg):
    m = codebook_linear(torch.randn(8, 20), 4)
    r = m.to_record()
    mutate(r)
    with pytest.raises(FormatError, match=msg):
        build_linear(r, "x.weight")


def test_rtn_int4_g128():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(16, 300, generator=g)
    m = rtn_linear(W, 4, 128)
    D = m.dequantize()
    # every group's values are on its 16-level grid, and the error is at most half a step
    step = ((W[:, :128].amax(1).clamp(min=0) - W[:, :128].amin(1).clamp(max=0)) / 15)
    assert ((D[:, :128] - W[:, :128]).abs() <= step[:, None] * 0.5 + 1e-3).all()
    assert m.q.max() <= 15
    x = torch.randn(4, 300, generator=g)
    assert torch.allclose(m(x), x @ D.T, atol=1e-5)
    m2 = build_linear(m.to_record())
    assert torch.equal(m2.dequantize(), D)
    assert abs(rtn_bits_per_weight(4, 128) - (4 + 20 / 128)) < 1e-12


def test_registry_maps_weights_to_schemes():
    from trapetum.schemes.codebook import CODEBOOK
    from trapetum.schemes.dense import DENSE
    assert registry.scheme_of(torch.zeros(2, 2)) is DENSE
    assert registry.scheme_of(codebook_linear(torch.randn(8, 20), 4).to_record()) is CODEBOOK
    assert set(registry.SCHEMES) == {"dense", "codebook", "aqlm", "rtn", "ggml"}
    with pytest.raises(FormatError, match="unknown quantization scheme 'dense'"):
        registry.scheme_of(QuantRecord("dense", (2, 2)))
