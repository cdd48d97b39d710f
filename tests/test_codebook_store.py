"""Compact codebook storage (.cbk version 2, schemes/codebook_store.py, quant/codebook_fit.py): exact decode, the
fits against float64 references, versions, and hostile compact records."""
from __future__ import annotations

import json

import pytest
import torch

from cbk_helpers import join_file, split_file, tiny_model, tiny_tokenizer
from trapetum.errors import FormatError
from trapetum.formats.cbk import open_cbk, verify_cbk, write_cbk
from trapetum.formats.cbk_spec import header_digest
from trapetum.kernels.pack import pack_codes
from trapetum.quant.codebook_fit import fit_rows, fit_shared, to_u8
from trapetum.quant.kmeans import kmeans_rows
from trapetum.schemes.codebook_store import check_compact, decode_shared, decode_u8, expand
from trapetum.schemes.record import QuantRecord
from trapetum.schemes.registry import dequantize

SHAPES = [(1, 3), (3, 53), (53, 97), (97, 1), (257, 53)]


def werr(W, book, codes, w=None):
    """float64 relative weighted error of the weights the codes and codebook give."""
    d = W.double() - torch.gather(book.double(), 1, codes.long())
    w = torch.ones(W.shape[1], dtype=torch.float64) if w is None else w.double()
    return float(((d * d * w).sum() / (W.double() ** 2 * w).sum().clamp_min(1e-300)).sqrt())


def nearest_ref(W, book):
    """float64 reference: index of the nearest centroid (ties: the lower one) of each weight."""
    d = (W.double().unsqueeze(2) - book.double().unsqueeze(1)).abs()  # [R, C, K]
    return d.argmin(2)


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_float64(shape):
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    R, _ = shape
    q = torch.randint(0, 256, (R, 16), dtype=torch.uint8, generator=g).sort(1).values
    rng = torch.stack([torch.randn(R, generator=g), torch.rand(R, generator=g) * 0.01], 1).to(torch.float16)
    ref = (rng.double()[:, :1] + rng.double()[:, 1:] * q.double())
    got = decode_u8(q, rng)
    assert got.dtype == torch.float16 and float((got.double() - ref).norm() / ref.norm()) < 1e-3
    T = torch.randn(-(-R // 4), 256, generator=g).sort(1).values.to(torch.float16)
    s = (torch.rand(R, generator=g) + 0.1).to(torch.float16)
    ref = s.double().unsqueeze(1) * T.double()[torch.arange(R) // 4]
    got = decode_shared(T, s, 4)
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-3
    assert bool((got[:, 1:] >= got[:, :-1]).all())  # positive scales keep each row ascending


@pytest.mark.parametrize("shape", SHAPES)
def test_u8_close_to_fp16_centroids(shape):
    g = torch.Generator().manual_seed(shape[1])
    W = torch.randn(shape, generator=g) * (torch.rand(shape[0], 1, generator=g) + 0.05)
    w = torch.rand(shape[1], generator=g) + 0.01
    ref = kmeans_rows(W, 16, w)
    book, codes, stored, params = fit_rows(W, 4, w, storage="u8")
    assert params == {"bits": 4, "codebook": "u8"} and set(stored) == {"codebook_u8", "codebook_range"}
    assert torch.equal(book, decode_u8(stored["codebook_u8"], stored["codebook_range"]))
    assert torch.equal(codes.long(), nearest_ref(W, book)) or werr(W, book, codes, w) <= werr(
        W, book, nearest_ref(W, book), w) + 1e-12  # nearest (ties may resolve either way)
    e16, e8 = werr(W, ref.codebook, ref.codes, w), werr(W, book, codes, w)
    assert e8 <= e16 * 1.02 + 1e-3  # 8-bit centroids on the row's range: within 2% of fp16 ones


def test_to_u8_covers_the_range():
    book = torch.tensor([[-1.0, 0.3, 2.0], [0.5, 0.5, 0.5], [1e-3, 2e-3, 7e-3]]).to(torch.float16)
    q, rng, dec = to_u8(book)
    assert torch.equal(dec[:, 0], book[:, 0]) and bool((dec[:, -1].float() >= book[:, -1].float() - 1e-6).all())
    assert float((dec.float() - book.float()).abs().max()) <= float(rng[:, 1].float().max()) / 2 + 1e-6


@pytest.mark.parametrize("shape,G", [((1, 53), 1), ((53, 97), 4), ((257, 53), 64), ((97, 3), 200)])
def test_shared_fit(shape, G):
    g = torch.Generator().manual_seed(G)
    scale = torch.rand(shape[0], 1, generator=g) * 3 + 0.01
    W = torch.randn(shape, generator=g) * scale
    w = torch.rand(shape[1], generator=g) + 0.01
    T, s, book, codes = fit_shared(W, 16, w, G)
    assert T.shape == (-(-shape[0] // G), 16) and s.shape == (shape[0],) and codes.dtype == torch.uint8
    assert torch.equal(book, decode_shared(T, s, G))
    e = werr(W, book, codes, w)
    _, _, book0, codes0 = fit_shared(W, 16, w, G, rounds=0)  # the start alone: the alternation must not hurt
    assert e <= werr(W, book0, codes0, w) + 1e-9
    # rows that differ only in scale are served as well as one row by its own table
    assert e < 0.2


def test_shared_alternation_helps_on_scaled_rows():
    """Rows with different scales and a skewed distribution: the least-squares rounds lower the weighted error
    of the RMS-normalized start (a test that fails if the rounds do nothing)."""
    g = torch.Generator().manual_seed(3)
    W = torch.randn(64, 128, generator=g).pow(3) * torch.logspace(-2, 0, 64).unsqueeze(1)
    w = torch.rand(128, generator=g) ** 4 + 1e-3
    e0 = werr(W, *fit_shared(W, 16, w, 16, rounds=0)[2:], w)
    e3 = werr(W, *fit_shared(W, 16, w, 16, rounds=3)[2:], w)
    assert e3 < e0 * 0.99


def _compact_model(storage: str):
    cfg, dense, quantized = tiny_model()
    g = torch.Generator().manual_seed(1)
    for name in list(quantized):
        r = quantized[name]
        R, C = r.shape
        bits = r.params["bits"]
        W = torch.randn(R, C, generator=g)
        st = "shared" if name == "lm_head.weight" else storage
        book, codes, stored, params = fit_rows(W, bits, None, storage=st, group_rows=5)
        quantized[name] = QuantRecord("codebook", (R, C), params, {"codes": pack_codes(codes, bits), **stored},
                                      r.bias)
    return cfg, dense, quantized


@pytest.mark.parametrize("storage", ["u8", "shared", "f16"])
def test_file_round_trip_and_version(tmp_path, storage):
    cfg, dense, quantized = _compact_model(storage)
    path = write_cbk(tmp_path / "c.cbk", config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer())
    f = open_cbk(path)
    assert f.meta["version"] == 2  # the head is "shared" in every case
    assert verify_cbk(path)[1] == []
    for name, r in quantized.items():
        back = f.record(name)
        assert torch.equal(dequantize(back), dequantize(expand(r)))
    # an all-fp16 file stays version 1 (older builds read it)
    cfg, dense, q16 = tiny_model()
    p1 = write_cbk(tmp_path / "v1.cbk", config=cfg, dense=dense, quantized=q16, tokenizer=tiny_tokenizer())
    assert open_cbk(p1).meta["version"] == 1


def _rewrite(path, edit):
    header, body = split_file(path.read_bytes())
    meta = json.loads(header["__metadata__"]["trapetum"])
    edit(meta, header)
    text = json.dumps(meta)
    table = {n: (e["dtype"], e["shape"], *e["data_offsets"]) for n, e in header.items() if n != "__metadata__"}
    header["__metadata__"] = {"trapetum": text, "trapetum_sha256": header_digest(text, table)}
    path.write_bytes(join_file(header, body))


def test_version1_with_compact_codebook_refused(tmp_path):
    cfg, dense, quantized = _compact_model("u8")
    path = write_cbk(tmp_path / "c.cbk", config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer())
    _rewrite(path, lambda meta, header: meta.__setitem__("version", 1))
    with pytest.raises(FormatError, match="stores its codebook compactly"):
        open_cbk(path)


L = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("edit,match", [
    (lambda p: p.__setitem__("codebook", "fp8"), "codebook storage must be one of"),
    (lambda p: p.__setitem__("codebook", 3), "codebook storage must be one of"),
    (lambda p: p.__setitem__("group_rows", 4), "group_rows is given"),
    (lambda p: p.update(codebook="shared", group_rows=4), "needs tensors"),
])
def test_hostile_params(tmp_path, edit, match):
    cfg, dense, quantized = _compact_model("u8")
    path = write_cbk(tmp_path / "c.cbk", config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer())
    _rewrite(path, lambda meta, header: edit(meta["layers"][L]["params"]))
    f = None
    try:
        f = open_cbk(path)
    except FormatError as e:
        assert match in str(e)
        return
    problems = f.verify()
    assert len(problems) == 1 and match in problems[0] and str(path) in problems[0]


@pytest.mark.parametrize("case", ["group_zero", "group_bool", "group_str", "scale_inf", "overflow", "u8_dtype",
                                  "range_shape", "shared_rows"])
def test_hostile_compact_records(case):
    R, K = 6, 16
    codes = torch.zeros(R, 2, dtype=torch.uint8)
    T = torch.linspace(-1, 1, K).to(torch.float16).repeat(2, 1)
    s = torch.ones(R, dtype=torch.float16)
    params = {"bits": 4, "codebook": "shared", "group_rows": 3}
    tensors = {"codes": codes, "codebook_shared": T, "row_scale": s}
    want = {"group_zero": "group_rows must be", "group_bool": "group_rows must be", "group_str": "group_rows must be",
            "scale_inf": "row_scale holds non-finite", "overflow": "decodes to non-finite",
            "u8_dtype": "codebook_u8 must be uint8", "range_shape": "codebook_range shape",
            "shared_rows": "codebook_shared shape"}[case]
    if case.startswith("group"):
        params["group_rows"] = {"group_zero": 0, "group_bool": True, "group_str": "3"}[case]
    elif case == "scale_inf":
        s[2] = float("inf")
    elif case == "overflow":
        tensors["codebook_shared"] = torch.full((2, K), 60000.0, dtype=torch.float16)
        s[:] = 60000.0
    elif case == "shared_rows":
        tensors["codebook_shared"] = T[:1]
    else:
        params = {"bits": 4, "codebook": "u8"}
        tensors = {"codes": codes, "codebook_u8": torch.zeros(R, K, dtype=torch.uint8),
                   "codebook_range": torch.zeros(R, 2, dtype=torch.float16)}
        if case == "u8_dtype":
            tensors["codebook_u8"] = torch.zeros(R, K, dtype=torch.int8)
        else:
            tensors["codebook_range"] = torch.zeros(R, 3, dtype=torch.float16)
    rec = QuantRecord("codebook", (R, 4), params, tensors)
    with pytest.raises(FormatError, match=want):
        check_compact(rec, "x", R, K)


def test_cbk_sizes_script_accounts_for_every_byte(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("cbk_sizes", Path(__file__).parents[1] / "scripts" / "cbk_sizes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg, dense, quantized = _compact_model("u8")
    path = write_cbk(tmp_path / "c.cbk", config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer())
    d = mod.breakdown(str(path))
    assert sum(b for _, _, b, _ in d["rows"]) + d["header"]["bytes"] == path.stat().st_size
    roles = {r for _, r, _, _ in d["rows"]}
    assert {"codes", "codebook_u8", "codebook_range", "codebook_shared", "row_scale", "dense"} <= roles
    assert mod.main([str(path)]) == 0 and "codebook_shared" in capsys.readouterr().out
