"""GPTQ with per-row codebooks (trapetum/quant/gptq.py) against float64 references on tiny shapes, and the
``--gptq`` recipe end to end: it must lower the Hessian-weighted output error of plain E[x^2]-weighted k-means."""
from __future__ import annotations

import pytest
import torch

from trapetum.quant.codebook_fit import project_centroids
from trapetum.quant.gptq import gptq_assign, gptq_refine, hessian_objective, prepare_hessian, refit_codebooks
from trapetum.quant.kmeans import kmeans_rows
from trapetum.schemes.codebook_store import decode_u8

SHAPES = [(1, 3), (3, 53), (53, 97), (97, 1), (257, 53), (5, 257)]


def problem(R, C, seed, corr=0.6):
    """W [R, C] and the second moment H [C, C] of correlated inputs (n = 4 C + 16 samples)."""
    g = torch.Generator().manual_seed(seed)
    n = 4 * C + 16
    mix = torch.eye(C, dtype=torch.float64) + corr * torch.randn(C, C, generator=g, dtype=torch.float64) / C ** 0.5
    X = torch.randn(n, C, generator=g, dtype=torch.float64) @ mix * (torch.rand(C, generator=g) + 0.2).double()
    H = X.T @ X / n
    W = torch.randn(R, C, generator=g)
    return W, H.float()


def deq(book, codes):
    return torch.gather(book.double(), 1, codes.long())


def gptq_reference(W, H, book, damp=0.01):
    """The OBQ form of GPTQ in float64, no Cholesky and no blocks: quantize column i to its nearest centroid, move
    the not yet quantized columns by -err_i Hinv[i, j] / Hinv[i, i], drop i from the inverse."""
    Hd = prepare_hessian(H, damp)
    Hinv = torch.linalg.inv(Hd)
    Wd = W.double().clone()
    cb = book.double()
    R, C = W.shape
    codes = torch.empty(R, C, dtype=torch.long)
    for i in range(C):
        a = (Wd[:, i:i + 1] - cb).abs().argmin(1)
        codes[:, i] = a
        err = (Wd[:, i] - cb[torch.arange(R), a]) / Hinv[i, i]
        Wd[:, i + 1:] -= err.unsqueeze(1) * Hinv[i, i + 1:].unsqueeze(0)
        Hinv = Hinv - Hinv[:, i:i + 1] @ Hinv[i:i + 1, :] / Hinv[i, i]
    return codes


@pytest.mark.parametrize("shape", SHAPES)
def test_assign_matches_float64_reference(shape):
    W, H = problem(*shape, seed=sum(shape))
    book = kmeans_rows(W, 16, torch.diagonal(H)).codebook
    ref = gptq_reference(W, H, book)
    for block in (1, 3, 128):
        got = gptq_assign(W, H, book, block=block)
        agree = float((deq(book, got) == deq(book, ref)).double().mean())  # the same weights (duplicate centroids)
        assert agree >= 0.99, (block, agree)
        o_ref, o_got = hessian_objective(W, deq(book, ref), H).sum(), hessian_objective(W, deq(book, got), H).sum()
        assert abs(float(o_got - o_ref)) <= 1e-3 * float(o_ref) + 1e-12


@pytest.mark.parametrize("shape", SHAPES)
def test_refit_is_the_least_squares_optimum(shape):
    W, H = problem(*shape, seed=7 + sum(shape))
    K = 8
    res = kmeans_rows(W, K, torch.diagonal(H))
    c = refit_codebooks(W, H, res.codes, res.codebook, ridge=0.0 + 1e-12)
    # float64 reference: per row, least squares in the H-metric with the explicit one-hot A (lstsq on L^T A)
    L = torch.linalg.cholesky(prepare_hessian(H, 1e-9))
    Hm = H.double()
    for r in range(shape[0]):
        A = torch.nn.functional.one_hot(res.codes[r].long(), K).double()  # [C, K]
        used = A.sum(0) > 0
        sol = torch.linalg.lstsq(L.T @ A[:, used], L.T @ W[r].double().unsqueeze(1)).solution.squeeze(1)
        obj = lambda cc: float((W[r].double() - A @ cc) @ Hm @ (W[r].double() - A @ cc))  # noqa: E731
        full = res.codebook[r].double().clone()
        full[used] = sol
        assert obj(c[r]) <= obj(full) * (1 + 1e-6) + 1e-12
        assert torch.allclose(c[r][~used], res.codebook[r].double()[~used], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("storage", ["f16", "u8"])
def test_refine_lowers_the_output_error_of_kmeans(shape, storage):
    W, H = problem(*shape, seed=3 * sum(shape))
    res = kmeans_rows(W, 16, torch.diagonal(H))  # today's recipe: E[x^2]-weighted k-means
    book, stored = project_centroids(res.codebook, storage)
    codes = torch.stack([torch.searchsorted(((book[r, :-1].float() + book[r, 1:].float()) / 2).contiguous(),
                                            W[r].contiguous()) for r in range(shape[0])])
    start = hessian_objective(W, deq(book, codes), H)
    b2, c2, st2, info = gptq_refine(W, H, book, codes, lambda c: project_centroids(c, storage), stored, rounds=2)
    assert b2.dtype == torch.float16 and c2.dtype == torch.uint8 and bool((b2[:, 1:] >= b2[:, :-1]).all())
    # the stored tensors decode to the centroids the codes were chosen for
    assert torch.equal(decode_u8(st2["codebook_u8"], st2["codebook_range"]) if storage == "u8" else st2["codebook"], b2)
    end = hessian_objective(W, deq(b2, c2), H)
    assert bool((end <= start * (1 + 1e-12)).all())  # never worse, row by row
    assert info["objective"] == pytest.approx(float(end.sum()), rel=1e-9)
    if shape[1] >= 16 and shape[0] >= 3:
        assert float(end.sum()) < 0.9 * float(start.sum())  # the point of it: correlated inputs


def test_quantize_gptq_end_to_end(tmp_path):
    """--gptq on a tiny model: recorded in the recipe, and every projection's Hessian objective on the
    calibration's own statistics at or below the plain k-means file's, lower in total."""
    import tiny_models
    from trapetum.formats.detect import load_checkpoint
    from trapetum.quant import calibrate
    from trapetum.quant.quantize import Recipe, quantize_to_cbk
    from trapetum.schemes.registry import dequantize

    src = tmp_path / "src"
    tiny_models.build("llama2", src, tokenizer=True)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 37} token{i % 11}" for i in range(3000)))
    kw = dict(bits=3, calib=str(text), calib_seqs=4, calib_len=64, iters=10)
    log = []
    pg, qg = quantize_to_cbk(str(src), tmp_path / "g.cbk", Recipe(**kw, gptq=True), progress=False, log=log.append)
    pk, qk = quantize_to_cbk(str(src), tmp_path / "k.cbk", Recipe(**kw), progress=False, log=lambda s: None)
    fg = load_checkpoint(str(pg))
    assert fg.meta["recipe"]["gptq"] is True and "GPTQ" in fg.meta["recipe"]["method"]
    ck = load_checkpoint(str(src))
    toks = calibrate.file_calibration_tokens(ck.tokenizer, text, 4, 64)
    stats = calibrate.collect_input_stats_layerwise(ck, toks, progress=False, hessians=True)
    fk = load_checkpoint(str(pk))
    tot_g = tot_k = 0.0
    for name, H in stats.hessians.items():
        W = ck.tensors[name + ".weight"].float()
        eg = float(hessian_objective(W, dequantize(fg.tensors[name + ".weight"]), H).sum())
        ek = float(hessian_objective(W, dequantize(fk.tensors[name + ".weight"]), H).sum())
        assert eg <= ek * (1 + 1e-6), name
        tot_g, tot_k = tot_g + eg, tot_k + ek
    assert tot_g < 0.97 * tot_k


def test_layerwise_hessians_share_inputs_and_match_square_sums(tmp_path):
    import tiny_models
    from trapetum.formats.detect import load_checkpoint
    from trapetum.quant import calibrate

    src = tmp_path / "src"
    tiny_models.build("llama2", src, tokenizer=True)
    ck = load_checkpoint(str(src))
    toks = torch.randint(3, 200, (3, 16), generator=torch.Generator().manual_seed(0))
    st = calibrate.collect_input_stats_layerwise(ck, toks, batch=2, progress=False, hessians=True)
    H = st.hessians
    p = "model.layers.0."
    assert H[p + "self_attn.q_proj"] is H[p + "self_attn.k_proj"] is H[p + "self_attn.v_proj"]
    assert H[p + "mlp.gate_proj"] is H[p + "mlp.up_proj"] and H[p + "mlp.down_proj"] is not H[p + "mlp.up_proj"]
    for name, h in H.items():
        assert torch.allclose(torch.diagonal(h), st[name], rtol=1e-5, atol=1e-8)
        assert torch.allclose(h, h.T)
    assert "lm_head" not in H
    assert calibrate.collect_input_stats_layerwise(ck, toks, progress=False).hessians is None


def test_gptq_needs_calibration():
    from trapetum.errors import ConfigError
    from trapetum.quant.quantize import Recipe
    with pytest.raises(ConfigError, match="--gptq needs calibration"):
        Recipe(gptq=True, calib="none").validate()
    with pytest.raises(ConfigError, match="use --codebook u8 or f16"):
        Recipe(gptq=True, codebook="shared").validate()


def refit_session11(W, H, codes, book, ridge=1e-9, rows=256):
    """Session 11's refit (torch.linalg.solve, the start book copied to the device per chunk)."""
    R, C = W.shape
    K = book.shape[1]
    dev = W.device
    Hd = H.to(dev, torch.float64)
    out = torch.empty(R, K, dtype=torch.float64, device=dev)
    scale = float(torch.diagonal(Hd).mean()) * C / K
    eye = torch.eye(K, dtype=torch.float64, device=dev)
    for r0 in range(0, R, rows):
        a = codes[r0:r0 + rows].to(dev, torch.long)
        O = torch.zeros(a.shape[0], C, K, dtype=torch.float64, device=dev).scatter_(2, a.unsqueeze(2), 1.0)
        HO = torch.einsum("ij,njk->nik", Hd, O)
        M = torch.einsum("nik,nil->nkl", O, HO)
        b = torch.einsum("ni,nik->nk", W[r0:r0 + rows].to(dev, torch.float64), HO)
        lam = ridge * scale
        c0 = book[r0:r0 + rows].to(dev, torch.float64)
        out[r0:r0 + rows] = torch.linalg.solve(M + lam * eye, (b + lam * c0).unsqueeze(2)).squeeze(2)
    return out


def refine_session11(W, H, book, codes, project, stored, rounds=2, block=128, damp=0.01):
    """Session 11's gptq_refine: the codes through the host every round (masked copies on the CPU)."""
    from trapetum.quant.gptq import inverse_cholesky
    dev = W.device

    def dq(b, a):
        return torch.gather(b.to(dev, torch.float64), 1, a.to(dev, torch.long))

    best_obj = hessian_objective(W, dq(book, codes), H)
    start = float(best_obj.sum())
    best_book, best_codes = book.clone(), codes.to(torch.uint8).clone()
    best_stored = {k: v.clone() for k, v in stored.items()}
    cur = book
    U = inverse_cholesky(H, damp, dev)
    for _ in range(rounds):
        a = gptq_assign(W, H, cur, block=block, U=U)
        c = refit_session11(W, H, a, cur)
        c, perm = c.sort(1)
        a = torch.argsort(perm, 1).gather(1, a)
        cur, st = project(c.cpu())
        obj = hessian_objective(W, dq(cur, a), H)
        better = (obj < best_obj).cpu()
        if bool(better.any()):
            best_book[better] = cur[better]
            best_codes[better] = a.cpu()[better].to(torch.uint8)
            for k, v in st.items():
                best_stored[k][better] = v[better]
            best_obj = torch.minimum(best_obj, obj)
    return best_book, best_codes, best_stored, {"objective_start": start, "objective": float(best_obj.sum())}


def same_refine(got, ref):
    assert torch.equal(got[0], ref[0]) and got[1].dtype == torch.uint8 and torch.equal(got[1], ref[1])
    assert got[1].device.type == "cpu" and got[0].device.type == "cpu"
    assert got[2].keys() == ref[2].keys() and all(torch.equal(got[2][k], ref[2][k]) for k in ref[2])
    assert got[3] == ref[3]


@pytest.mark.parametrize("shape", SHAPES + [(300, 200)])
@pytest.mark.parametrize("storage", ["f16", "u8"])
@pytest.mark.parametrize("rounds", [1, 3])
def test_refine_equals_session11_bit_for_bit(shape, storage, rounds):
    """The codes kept on W's device and merged by torch.where (and solve_ex in the refit) change no bit of the
    books, codes, stored tensors or objectives of session 11's host bookkeeping; codes given as int64 or uint8."""
    W, H = problem(*shape, seed=5 + sum(shape))
    res = kmeans_rows(W, 16, torch.diagonal(H))
    book, stored = project_centroids(res.codebook, storage)
    proj = lambda c: project_centroids(c, storage)  # noqa: E731
    ref = refine_session11(W, H, book, res.codes, proj, stored, rounds=rounds)
    for codes in (res.codes, res.codes.long()):
        same_refine(gptq_refine(W, H, book, codes, proj, stored, rounds=rounds), ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(512, 1024), (1100, 640), (4096, 11008)])
def test_cuda_refine_equals_session11_bit_for_bit(shape):
    """On the GPU (the codes' round trips removed, the Triton sweep): the same files as session 11's path, up to
    a Llama-2-7B down_proj (~10 s on an H200)."""
    R, C = shape
    g = torch.Generator().manual_seed(R + C)
    d = torch.rand(C, generator=g) + 0.01
    A = torch.randn(C, C // 8, generator=g) / C ** 0.5
    H = (torch.diag(d) + A @ A.T).cuda()
    W = (torch.randn(R, C, generator=g) * 0.02).cuda()
    res = kmeans_rows(W, 16, d.cuda())
    for storage in ("f16", "u8"):
        book, stored = project_centroids(res.codebook.cpu(), storage)
        proj = lambda c: project_centroids(c, storage)  # noqa: E731
        same_refine(gptq_refine(W, H, book, res.codes.cpu(), proj, stored),
                    refine_session11(W, H, book, res.codes.cpu(), proj, stored))


def _fixed_fit(W, bits, imp, **kw):
    """fit_rows stand-in: a fixed fp16 book and seeded codes (the test is about what quantize_matrix does next)."""
    R, C = W.shape
    K = 1 << bits
    g = torch.Generator().manual_seed(R * 1000 + C)
    book = (torch.randn(R, K, generator=g) * 0.02).sort(1).values.to(torch.float16)
    codes = torch.randint(0, K, (R, C), generator=g).to(torch.uint8)
    return book, codes, {"codebook": book}, {"bits": bits, "codebook": "f16"}


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quantize_matrix_packs_its_codes(monkeypatch, bits):
    """The packed codes are pack_codes of the fit's codes over every row chunk (the chunks of 2^21 elements: 698
    rows x 3001 columns make a short last chunk), and the error is that of book[codes]; on CUDA, with W there, the
    bytes are the CPU's and the errors agree."""
    from trapetum.kernels.pack import pack_codes
    from trapetum.quant import quantize as Q
    from trapetum.quant.recipe import Recipe
    monkeypatch.setattr(Q, "fit_rows", _fixed_fit)
    W = torch.randn(1500, 3001, generator=torch.Generator().manual_seed(bits)) * 0.02
    book, codes, _, _ = _fixed_fit(W, bits, None)
    imp = torch.rand(3001) + 0.1
    rec, err = Q.quantize_matrix(W, bits, imp, Recipe(bits=bits), "cpu", None)
    assert torch.equal(rec.tensors["codes"], pack_codes(codes, bits))
    d = deq(book, codes) - W.double()
    assert err["rel_err"] == pytest.approx(float(d.norm() / W.double().norm()), rel=1e-9)
    if torch.cuda.is_available():
        rec2, err2 = Q.quantize_matrix(W.cuda(), bits, imp.cuda(), Recipe(bits=bits), "cuda", None)
        assert rec2.tensors["codes"].device.type == "cpu" and torch.equal(rec2.tensors["codes"], rec.tensors["codes"])
        assert err2["rel_err"] == pytest.approx(err["rel_err"], rel=1e-9)
        assert err2["rel_err_weighted"] == pytest.approx(err["rel_err_weighted"], rel=1e-9)
