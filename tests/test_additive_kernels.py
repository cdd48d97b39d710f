"""Additive-codebook GEMV kernels (2x8 lookup table, 1x16 gather) vs the float64 reference.

CPU: Triton interpreter at small shapes; GPU: the same tests at real sizes plus 100-run determinism."""
from __future__ import annotations

import importlib
import random

import pytest
import torch

from kernels_conftest import DEVICE, ON_GPU, TOL, rel_err, requires_cuda
from shapes import AWKWARD, gemv_shapes
import trapetum.kernels.additive_gemv as ag
from trapetum.quant.additive import AdditiveLinear, index_to_codes

if not ON_GPU:
    ag = importlib.reload(ag)  # pick up TRITON_INTERPRET=1 set by kernels_conftest

N_RANDOM = 210
LAYOUTS = [(2, 8), (1, 16), (2, 8), (1, 16), (1, 8), (3, 8), (4, 8)]


def _weights(n, g, M, nbits, gen, scale=0.05):
    K = 1 << nbits
    codes = index_to_codes(torch.randint(0, K, (n, g, M), generator=gen), nbits)
    cb = (torch.randn(M, K, 1, 8, generator=gen)).half()
    sc = (torch.rand(n, 1, 1, 1, generator=gen) * scale + 0.01).half()
    return codes.to(DEVICE), cb.to(DEVICE), sc.to(DEVICE)


def _case(seed):
    r = random.Random(seed)
    M, nbits = r.choice(LAYOUTS)
    T = r.choice([1, 1, 1, 2, 3, 8])
    if ON_GPU:
        g = r.choice([a for a in AWKWARD if a < 3000] + [r.randint(1, 1200)])
        n = r.choice(AWKWARD + [r.randint(1, 5000)])
    else:
        g = r.choice([1, 3, 7, 16, 17, r.randint(1, 40)])
        n = r.choice([1, 3, 53, 97, r.randint(1, 80)])
    dtype = r.choice([torch.float16, torch.float16, torch.float32])
    return M, nbits, T, g, n, dtype, r.random() < 0.3, r.random() < 0.3


@pytest.mark.parametrize("seed", range(N_RANDOM))
def test_random_shapes(seed):
    M, nbits, T, g, n, dtype, with_bias, with_res = _case(seed)
    gen = torch.Generator().manual_seed(seed)
    codes, cb, sc = _weights(n, g, M, nbits, gen)
    x = torch.randn(T, g * 8, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    res = torch.randn(T, n, generator=gen).to(dtype).to(DEVICE) if with_res else None
    y = ag.additive_gemv(x, codes, cb, sc, bias, res)
    ref = ag.additive_gemv_reference(x, codes, cb, sc, bias, res)
    assert y.dtype == dtype and y.shape == (T, n)
    err = rel_err(y, ref)
    assert err < TOL[dtype], f"{M}x{nbits} T={T} in={g * 8} out={n} {dtype}: rel err {err:.2e}"


def test_lut_matches_reference():
    gen = torch.Generator().manual_seed(1)
    codes, cb, sc = _weights(5, 13, 2, 8, gen)
    x = torch.randn(2, 13 * 8, generator=gen).half().to(DEVICE)
    lut = torch.empty(2 * 13 * 2 * 256, device=DEVICE)
    ag.additive_gemv(x, codes, cb, sc, lut=lut)
    ref = ag.lut_reference(x, cb).reshape(-1)
    assert rel_err(lut, ref) < 1e-6


@pytest.mark.parametrize("M,nbits", [(2, 8), (1, 16)])
def test_bitwise_deterministic(M, nbits):
    runs = 100 if ON_GPU else 5
    gen = torch.Generator().manual_seed(7)
    n, g = (8192, 3584) if ON_GPU else (70, 33)
    codes, cb, sc = _weights(n, g, M, nbits, gen)
    x = torch.randn(1, g * 8, generator=gen).half().to(DEVICE)
    first = ag.additive_gemv(x, codes, cb, sc)
    for _ in range(runs - 1):
        assert torch.equal(ag.additive_gemv(x, codes, cb, sc), first)


def test_bad_shapes_raise():
    gen = torch.Generator().manual_seed(3)
    codes, cb, sc = _weights(10, 4, 2, 8, gen)
    x = torch.randn(1, 32).half().to(DEVICE)
    with pytest.raises(ValueError, match="last dimension"):
        ag.additive_gemv(torch.randn(1, 33).half().to(DEVICE), codes, cb, sc)
    with pytest.raises(ValueError, match="dtype"):
        ag.additive_gemv(x, codes.to(torch.int16), cb, sc)
    with pytest.raises(ValueError, match="scales"):
        ag.additive_gemv(x, codes, cb, sc[:5])
    with pytest.raises(ValueError, match="unsupported"):
        ag.additive_gemv(x, codes, cb.view(2, 256, 2, 4), sc)
    with pytest.raises(ValueError, match="codebooks per group"):
        ag.additive_gemv(x, codes[..., :1], cb, sc)
    with pytest.raises(ValueError, match="bias"):
        ag.additive_gemv(x, codes, cb, sc, torch.zeros(3).half().to(DEVICE))
    with pytest.raises(ValueError, match="residual"):
        ag.additive_gemv(x, codes, cb, sc, None, torch.zeros(1, 3).half().to(DEVICE))
    assert ag.additive_linear(x, codes, cb.view(2, 256, 2, 4), sc) is None  # the module falls back


@requires_cuda
@pytest.mark.parametrize("model", ["llama-2-7b", "llama-2-70b", "qwen2.5-0.5b"])
@pytest.mark.parametrize("M,nbits", [(2, 8), (1, 16)])
def test_real_shapes_gpu(model, M, nbits):
    gen = torch.Generator().manual_seed(0)
    for k, n in gemv_shapes(model):
        codes, cb, sc = _weights(n, k // 8, M, nbits, gen)
        x = torch.randn(1, k, generator=gen).half().cuda()
        res = torch.randn(1, n, generator=gen).half().cuda()
        y = ag.additive_gemv(x, codes, cb, sc, None, res)
        assert rel_err(y, ag.additive_gemv_reference(x, codes, cb, sc, None, res)) < TOL[torch.float16]
        mod = AdditiveLinear(codes, cb, sc).cuda()
        assert rel_err(mod(x), mod.dequantize(torch.float64) @ x.double().T.reshape(-1)) < 2e-3


@requires_cuda
def test_cuda_graph_bitwise_gpu():
    gen = torch.Generator().manual_seed(5)
    codes, cb, sc = _weights(4096, 512, 2, 8, gen)
    x = torch.randn(1, 4096, generator=gen).half().cuda()
    out = torch.empty(1, 4096, dtype=torch.float16, device="cuda")
    lut = torch.empty(512 * 2 * 256, device="cuda")
    ag.additive_gemv(x, codes, cb, sc, out=out, lut=lut)
    eager = out.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ag.additive_gemv(x, codes, cb, sc, out=out, lut=lut)
    for _ in range(10):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_engine_projection_mixed_parts():
    """runtime.projections: q/k/v-style group of additive parts (2x8 and 1x16 mixed), residual, prefill."""
    import trapetum.runtime.projections as P

    importlib.reload(P)
    gen = torch.Generator().manual_seed(11)
    mods = [AdditiveLinear(*[t.cpu() for t in _weights(n, 6, M, nb, gen)]) for n, M, nb in
            [(20, 2, 8), (9, 1, 16), (9, 2, 8)]]
    proj = P.make_proj(mods, DEVICE)
    assert isinstance(proj, P.AdditiveProj) and proj.out_features == 38
    x = torch.randn(48, generator=gen).half().to(DEVICE)
    res = torch.randn(38, generator=gen).half().to(DEVICE)
    out = torch.empty(38, dtype=torch.float16, device=DEVICE)
    proj.gemv(x, out, residual=res)
    W = torch.cat([m.dequantize(torch.float64) for m in mods]).to(DEVICE)
    assert rel_err(out, W @ x.double() + res.double()) < TOL[torch.float16]
    xs = torch.randn(5, 48, generator=gen).to(DEVICE)
    assert rel_err(proj.matmul(xs.half()), xs.double() @ W.T) < 2e-3
