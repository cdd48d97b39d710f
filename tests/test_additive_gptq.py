"""The additive quantizer under the full input Hessian (trapetum/quant/additive_gptq.py, ``quantize --scheme
aqlm-2x8 --gptq``): its pieces against float64 references on tiny shapes, never worse than the diagonal start,
clearly better on a correlated Hessian, deterministic, the stored layout unchanged, and the command end to end."""
from __future__ import annotations

import itertools

import pytest
import torch

from trapetum.quant.additive import dequantize_aqlm, quantize_additive
from trapetum.quant.additive_gptq import (descent_codes, gptq_codes, refit_codebooks_hessian,
                                          refit_scales_hessian)
from trapetum.quant.gptq import hessian_objective, inverse_cholesky, prepare_hessian


def _problem(R, C, seed=0, rank=None):
    """W [R, C] and a strongly correlated H = A A^T / rank + 0.05 I (rank C / 4), E[x^2] its diagonal."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(R, C, generator=g) * 0.02
    k = rank or max(1, C // 4)
    A = torch.randn(C, k, generator=g)
    H = A @ A.T / k + 0.05 * torch.eye(C)
    return W, H, torch.diagonal(H).clone()


def _obj(W, r, H):
    return hessian_objective(W, dequantize_aqlm(r.codes, r.codebooks, r.scales), H)


def test_never_worse_per_row_and_clearly_better_than_diagonal():
    W, H, imp = _problem(53, 128)
    kw = dict(beam=4, iters=1, kmeans_iters=4, seed=3)
    diag = quantize_additive(W, imp, **kw)
    r = quantize_additive(W, imp, hessian=H, gptq_rounds=2, **kw)
    o_d, o_g = _obj(W, diag, H), _obj(W, r, H)
    assert abs(r.gptq["objective_start"] - float(o_d.sum())) < 1e-6 * float(o_d.sum())  # the diagonal result
    assert (o_g <= o_d * (1 + 1e-9) + 1e-12).all()  # every row: the start is a candidate of each step
    assert float(o_g.sum()) < 0.6 * float(o_d.sum())  # measured 0.2-0.3 on such H
    assert abs(r.gptq["objective"] - float(o_g.sum())) < 1e-5 * float(o_g.sum())  # what is stored
    steps = [r.gptq["objective_start"]] + [x for pair in r.gptq["per_round"] for x in pair]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(steps, steps[1:]))
    # the stored layout is the diagonal quantizer's: dtypes, shapes, the record dequantizes alike
    assert r.codes.dtype == torch.int8 and r.codes.shape == (53, 16, 2)
    assert r.codebooks.dtype == torch.float16 and r.codebooks.shape == (2, 256, 1, 8)
    assert r.scales.dtype == torch.float16 and r.scales.shape == (53, 1, 1, 1)
    from trapetum.schemes import registry
    Wq = dequantize_aqlm(r.codes, r.codebooks, r.scales)
    assert torch.equal(registry.dequantize(r.record(), torch.float32, "x"), Wq)
    # history[-1] is the stored result's diagonal error, as without the Hessian
    hw = imp / imp.mean() + 1e-6
    e = float(((W - Wq) ** 2 * hw).sum() / (W * W * hw).sum())
    assert abs(r.history[-1] - e) < 1e-3 * e


def test_deterministic_bytes():
    W, H, imp = _problem(24, 64, seed=1)
    kw = dict(beam=2, iters=1, kmeans_iters=2, seed=7, hessian=H, gptq_rounds=1)
    a, b = quantize_additive(W, imp, **kw), quantize_additive(W, imp, **kw)
    for x, y in [(a.codes, b.codes), (a.codebooks, b.codebooks), (a.scales, b.scales)]:
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("R,C,block", [(1, 16, 128), (3, 24, 16), (97, 40, 8)])
def test_awkward_shapes(R, C, block):
    W, H, imp = _problem(R, C, seed=R)
    kw = dict(num_codebooks=2, nbits=4, beam=2, iters=1, kmeans_iters=2)
    diag = quantize_additive(W, imp, **kw)
    r = quantize_additive(W, imp, hessian=H, gptq_rounds=2, gptq_block=block, **kw)
    assert r.codes.shape == (R, C // 8, 2) and r.scales.shape == (R, 1, 1, 1)
    assert float(_obj(W, r, H).sum()) <= float(_obj(W, diag, H).sum()) * (1 + 1e-9)


def test_dead_columns_and_zero_rows():
    W, H, imp = _problem(8, 32, seed=5)
    W[2] = 0  # a zero row
    H[:, 5] = H[5, :] = 0  # a column calibration never excited
    imp = torch.diagonal(H).clone()
    kw = dict(num_codebooks=2, nbits=4, beam=2, iters=1, kmeans_iters=2)
    diag = quantize_additive(W, imp, **kw)
    r = quantize_additive(W, imp, hessian=H, **kw)
    assert torch.isfinite(r.scales.float()).all() and torch.isfinite(r.codebooks.float()).all()
    assert float(_obj(W, r, H).sum()) <= float(_obj(W, diag, H).sum()) * (1 + 1e-9)


def test_1x16():
    W, H, imp = _problem(16, 64, seed=2)
    kw = dict(num_codebooks=1, nbits=16, iters=0, kmeans_iters=1)
    diag = quantize_additive(W, imp, **kw)
    r = quantize_additive(W, imp, hessian=H, gptq_rounds=1, gptq_cg_iters=5, **kw)
    assert r.codes.dtype == torch.int16 and r.codebooks.shape == (1, 65536, 1, 8)
    assert float(_obj(W, r, H).sum()) <= float(_obj(W, diag, H).sum()) * (1 + 1e-9)


def _state(R, C, M, K, seed):
    g = torch.Generator().manual_seed(seed)
    Cb = (torch.randn(M, K, 8, generator=g) * 0.5).half().float()
    idx = torch.randint(0, K, (R, C // 8, M), generator=g)
    s = (torch.rand(R, generator=g) + 0.5).half().float()
    return Cb, idx, s


def test_gptq_codes_against_an_exhaustive_block_obs_reference():
    """Each group's codes: the exhaustive best tuple under the OBS metric ((H_FF^-1)_SS)^-1 for the target with
    the later columns re-optimized, computed here from H by solves (no Cholesky identities), float64."""
    R, C, M, K = 5, 32, 2, 4
    W, H, _ = _problem(R, C, seed=11)
    Cb, idx, s = _state(R, C, M, K, seed=12)
    got = gptq_codes(W, inverse_cholesky(H), Cb, s, idx, beam=K * K, beam_steps=2, block=16)
    Hd = prepare_hessian(H)  # the damped matrix GPTQ works with
    Wd, Cd, sd = W.double(), Cb.double(), s.double()
    tuples = torch.tensor(list(itertools.product(range(K), repeat=M)))  # [K^M, M]
    recs = sum(Cd[m][tuples[:, m]] for m in range(M))  # [K^M, 8]
    Q = torch.zeros(R, C, dtype=torch.float64)
    want = torch.empty_like(got)
    for g in range(C // 8):
        P, S, F = slice(0, 8 * g), slice(8 * g, 8 * g + 8), slice(8 * g, C)
        dP = Wd[:, P] - Q[:, P]  # errors of the groups done
        # the free columns' best response to the fixed errors: X = W_F + dP H_PF H_FF^-1
        X = Wd[:, F] + (torch.linalg.solve(Hd[F, F], (dP @ Hd[P, F]).T).T if g else 0)
        A = torch.linalg.inv(torch.linalg.inv(Hd[F, F])[:8, :8])  # the group's metric
        t = X[:, :8]
        diff = t.unsqueeze(1) - sd.view(R, 1, 1) * recs.unsqueeze(0)  # [R, K^M, 8]
        score = torch.einsum("rki,ij,rkj->rk", diff, A, diff)
        best = score.argmin(1)
        want[:, g] = tuples[best]
        Q[:, S] = sd[:, None] * recs[best]
    assert torch.equal(got, want)


def test_descent_codes_are_exact_coordinate_minima():
    R, C, M, K = 6, 24, 2, 4
    W, H, _ = _problem(R, C, seed=21)
    Cb, idx, s = _state(R, C, M, K, seed=22)
    got = descent_codes(W, H, Cb, s, idx, beam=K * K, beam_steps=2)
    tuples = torch.tensor(list(itertools.product(range(K), repeat=M)))
    cur = idx.clone()
    for g in range(C // 8):  # brute force: each group's best tuple with the others as they are then
        for r in range(R):
            scores = []
            for tup in tuples:
                cur[r, g] = tup
                Q = sum(Cb[m][cur[r, :, m]] for m in range(M)).reshape(-1) * s[r]
                e = (W[r] - Q).double()
                scores.append(float(e @ H.double() @ e))
            cur[r, g] = tuples[int(torch.tensor(scores).argmin())]
    assert torch.equal(got, cur)


def test_codebook_and_scale_refits_against_dense_least_squares():
    R, C, M, K = 7, 32, 2, 4
    W, H, _ = _problem(R, C, seed=31)
    Cb, idx, s = _state(R, C, M, K, seed=32)
    # dense J: Wq.flatten() = J @ Cb.flatten()
    n = M * K * 8
    J = torch.zeros(R * C, n, dtype=torch.float64)
    for r, g, m in itertools.product(range(R), range(C // 8), range(M)):
        for j in range(8):
            J[r * C + 8 * g + j, (m * K + idx[r, g, m]) * 8 + j] += s[r]
    Hb = torch.block_diag(*[H.double()] * R)
    A, b = J.T @ Hb @ J, J.T @ Hb @ W.double().reshape(-1)
    used = A.diagonal() > 0
    x = Cb.double().reshape(-1).clone()
    x[used] = torch.linalg.lstsq(A[used][:, used], b[used] - A[used][:, ~used] @ x[~used]).solution
    got = refit_codebooks_hessian(W, H, idx, Cb, s, iters=n)
    def f(Cx):
        Q = sum(Cx[m][idx[..., m]] for m in range(M)).reshape(R, C) * s.double()[:, None]
        return float(hessian_objective(W, Q, H).sum())
    assert f(got) <= f(x.view(M, K, 8)) * (1 + 1e-6)  # CG reaches the least-squares minimum
    assert f(refit_codebooks_hessian(W, H, idx, Cb, s, iters=3)) < f(Cb.double())  # and descends early on
    assert torch.equal(got[~used.view(M, K, 8)], Cb.double()[~used.view(M, K, 8)])  # unused entries stay
    # scales: the closed form is the per-row minimum (up to fp16 rounding)
    s2 = refit_scales_hessian(W, H, idx, Cb, s)
    for r in range(R):
        Q = sum(Cb[m][idx[r, :, m]] for m in range(M)).reshape(-1).double()
        best = float(W[r].double() @ H.double() @ Q / (Q @ H.double() @ Q))
        assert abs(float(s2[r]) - best) <= 1e-3 * abs(best) + 1e-6


def test_recipe_fingerprint_and_validation():
    from trapetum.errors import ConfigError
    from trapetum.quant.additive_driver import AdditiveRecipe
    off, on = AdditiveRecipe(), AdditiveRecipe(gptq=True)
    assert "gptq" not in off.fingerprint_settings()  # parts written before the option still resume
    assert on.fingerprint_settings()["gptq"] is True and on.fingerprint_settings() != off.fingerprint_settings()
    assert AdditiveRecipe(gptq=True, gptq_rounds=3).fingerprint_settings() != on.fingerprint_settings()
    assert "full input Hessian" in on.to_dict()["method"] and "Hessian" not in off.to_dict()["method"]
    with pytest.raises(ConfigError, match="--gptq needs calibration"):
        AdditiveRecipe(gptq=True, calib="none").validate()
    with pytest.raises(ConfigError, match="--gptq-rounds"):
        AdditiveRecipe(gptq=True, gptq_rounds=0).validate()


FAST = dict(beam=2, iters=0, beam_steps=1, kmeans_iters=2, calib_seqs=2, calib_len=64)  # CI-sized
FAST_GPTQ = dict(gptq_rounds=1, gptq_cg_iters=4)


def _calib_text(tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 37} token{i % 11}" for i in range(3000)))
    return text


def test_driver_gptq_resumes_with_cached_hessians_and_lowers_the_objective(tmp_path):
    """A resumed --gptq run (the Hessians read back from the calibration cache) writes the uninterrupted run's
    file; every projection's Hessian objective, measured from the file, is at or below the diagonal start's (the
    same settings and seed without --gptq: its report's hessian_gain is the ratio of the two)."""
    import tiny_models
    from trapetum.formats.detect import load_checkpoint
    from trapetum.quant import calibrate
    from trapetum.quant.additive_driver import AdditiveRecipe, quantize_additive_to_cbk
    from trapetum.schemes.registry import dequantize

    src = tmp_path / "src"
    tiny_models.build("llama2", src, tokenizer=True)
    text = _calib_text(tmp_path)
    prov = {"created": "fixed"}
    rec = AdditiveRecipe(scheme="aqlm-2x8", calib=str(text), gptq=True, **FAST, **FAST_GPTQ)
    q = lambda out, **k: quantize_additive_to_cbk(str(src), tmp_path / out, rec, progress=False, provenance=prov,
                                                  log=k.pop("log", lambda s: None), **k)
    a, qa = q("a.cbk")
    with pytest.raises(KeyboardInterrupt):
        q("b.cbk", stop_after=1)
    logs = []
    b, _ = q("b.cbk", log=logs.append)
    assert any("reusing" in s for s in logs)
    assert a.read_bytes() == b.read_bytes()
    fa, ck = load_checkpoint(str(a)), load_checkpoint(str(src))
    assert fa.meta["recipe"]["gptq"] is True and fa.meta["recipe"]["gptq_rounds"] == 1
    gain = {r["name"]: r["hessian_gain"] for r in qa.report if r["name"].startswith("model.layers.")}
    toks = calibrate.file_calibration_tokens(ck.tokenizer, text, 2, 64)
    stats = calibrate.collect_input_stats_layerwise(ck, toks, progress=False, hessians=True)
    assert sorted(gain) == sorted(stats.hessians)
    tot_a = tot_d = 0.0
    for name, H in stats.hessians.items():
        W = ck.tensors[name + ".weight"].float()
        ea = float(hessian_objective(W, dequantize(fa.tensors[name + ".weight"]), H).sum())
        ed = ea / gain[name]
        assert gain[name] <= 1 + 1e-9, name
        tot_a, tot_d = tot_a + ea, tot_d + ed
    assert tot_a < 0.9 * tot_d


def test_cli_quantize_aqlm_gptq(tmp_path, capsys, monkeypatch):
    import functools

    import tiny_models
    from trapetum import cli
    from trapetum.quant import additive_driver as drv
    from trapetum.formats.cbk import open_cbk
    from trapetum.models.decoder import Decoder

    src = tmp_path / "src"
    tiny_models.build("llama2", src, tokenizer=True)
    text = _calib_text(tmp_path)
    out = tmp_path / "g.cbk"
    monkeypatch.setattr(drv, "AdditiveRecipe", functools.partial(drv.AdditiveRecipe, **FAST, gptq_cg_iters=4))
    assert cli.main(["quantize", str(src), "-o", str(out), "--scheme", "aqlm-2x8", "--gptq", "--gptq-rounds", "1",
                     "--calib", str(text), "--calib-seqs", "2", "--quiet", "--device", "cpu"]) == 0
    f = open_cbk(out)
    assert f.meta["recipe"]["gptq"] is True and f.meta["recipe"]["gptq_rounds"] == 1
    assert f.layers["model.layers.0.mlp.up_proj.weight"].scheme == "aqlm"
    dec = Decoder.from_checkpoint(f.to_checkpoint(), dtype=torch.float32, device="cpu").eval()
    with torch.no_grad():
        assert torch.isfinite(dec(torch.tensor([[1, 5, 9, 3]]))[0]).all()
    capsys.readouterr()
    assert cli.main(["quantize", str(src), "-o", str(tmp_path / "n.cbk"), "--scheme", "aqlm-2x8", "--gptq",
                     "--calib", "none", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gptq needs calibration" in err[0]
