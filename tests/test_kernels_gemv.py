"""Codebook GEMV kernels vs the float64 reference (CPU: Triton interpreter, small shapes; GPU: full size)."""
from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch

from trapetum.quant.pack import pack_codes, unpack_codes

from kernels_conftest import DEVICE, ON_GPU, TOL, codebook_gemv as cg, rel_err, requires_cuda
from shapes import AWKWARD, BENCH_GEMV_4BIT, MODELS, gemv_shapes

N_RANDOM = 90


def _weights(n, k, bits, gen, device=DEVICE):
    kb = -(-k * bits // 8)
    codes = torch.randint(0, 256, (n, kb), dtype=torch.uint8, generator=gen)
    cb = torch.randn(n, 1 << bits, generator=gen).half()
    return codes.to(device), cb.to(device)


@contextlib.contextmanager
def _variant(be):
    """backend names 'mma-V' select the mma kernel variant V (TRAPETUM_GEMV_V)."""
    old = os.environ.get("TRAPETUM_GEMV_V")
    if "-" in be:
        os.environ["TRAPETUM_GEMV_V"] = be.split("-")[1]
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRAPETUM_GEMV_V", None)
        else:
            os.environ["TRAPETUM_GEMV_V"] = old


def _case(seed):
    r = random.Random(seed)
    bits = r.choice([2, 4, 4, 8])
    m = r.choice([1, 1, 1, 2, 3, 5, 8, 9, 16])
    if ON_GPU:
        k = r.choice(AWKWARD + [r.randint(1, 9000), 128 * r.randint(1, 90)])
        n = r.choice(AWKWARD + [r.randint(1, 5000)])
    else:
        k = r.choice(AWKWARD + [r.randint(1, 600)])
        n = r.choice(AWKWARD[:5] + [r.randint(1, 80)])
    return bits, m, k, n, r.random() < 0.3


@pytest.mark.parametrize("seed", range(N_RANDOM))
def test_gemv_random_shapes(seed):
    bits, m, k, n, with_res = _case(seed)
    gen = torch.Generator().manual_seed(seed)
    codes, cb = _weights(n, k, bits, gen)
    x = torch.randn(m, k, generator=gen).half().to(DEVICE)
    res = torch.randn(m, n, generator=gen).half().to(DEVICE) if with_res else None
    ref = cg.codebook_gemv_reference(x, codes, cb, bits, res)  # float64, on the test device
    backends = ["triton"] + ([f"mma-{v}" for v in (3, 4, 5, 7)] if ON_GPU and cg._mma_shape_ok(m, k, bits) and cg.mma_available() else [])
    for be in backends:
        y = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEVICE)  # poisoned
        with _variant(be):
            cg.codebook_gemv(x, codes, cb, bits, res, out=y, backend=be.split("-")[0])
        err = rel_err(y, ref)
        assert err < TOL[torch.float16], (be, bits, m, k, n, err)


def test_gemv_1d_input_and_default_backend():
    gen = torch.Generator().manual_seed(1)
    codes, cb = _weights(37, 256, 4, gen)
    x = torch.randn(256, generator=gen).half().to(DEVICE)
    y = cg.codebook_gemv(x, codes, cb, 4)
    assert y.shape == (37,)
    assert rel_err(y, cg.codebook_gemv_reference(x.cpu(), codes.cpu(), cb.cpu(), 4)) < TOL[torch.float16]


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("f,k,m,bits", [(13, 64, 1, 4), (24, 256, 3, 4), (8, 128, 16, 8), (53, 97, 2, 2)])
def test_gate_up_fused(act, f, k, m, bits):
    gen = torch.Generator().manual_seed(f * k + m)
    gc, gcb = _weights(f, k, bits, gen)
    uc, ucb = _weights(f, k, bits, gen)
    codes, cb, ff = cg.interleave_gate_up(gc, gcb, uc, ucb)
    x = torch.randn(m, k, generator=gen).half().to(DEVICE)
    g = cg.codebook_gemv_reference(x.cpu(), gc.cpu(), gcb.cpu(), bits)
    u = cg.codebook_gemv_reference(x.cpu(), uc.cpu(), ucb.cpu(), bits)
    ref = cg._act_ref(g, act) * u
    backends = ["triton"] + ([f"mma-{v}" for v in (3, 4, 5, 7)] if ON_GPU and cg._mma_shape_ok(m, k, bits) and cg.mma_available() else [])
    for be in backends:
        with _variant(be):
            y = cg.codebook_gemv_gate_up(x, codes, cb, bits, ff, act, backend=be.split("-")[0])
        assert y.shape == (m, f)
        assert rel_err(y, ref) < TOL[torch.float16], be


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    idx = torch.randint(0, 1 << bits, (7, 53))
    codes = pack_codes(idx, bits)
    assert codes.shape == (7, -(-53 * bits // 8))
    assert torch.equal(unpack_codes(codes, bits, 53).long(), idx)


def test_canonical_nibble_order():
    # column 2j in the low nibble, 2j+1 in the high nibble
    codes = torch.tensor([[0x21]], dtype=torch.uint8)
    cb = torch.arange(16, dtype=torch.float16).reshape(1, 16)
    w = cg.dequantize(codes, cb, 4, 2)
    assert w.tolist() == [[1.0, 2.0]]


def test_bad_shapes_raise():
    gen = torch.Generator().manual_seed(0)
    codes, cb = _weights(8, 64, 4, gen)
    x = torch.randn(2, 64).half().to(DEVICE)
    with pytest.raises(ValueError, match="codes"):
        cg.codebook_gemv(torch.randn(2, 66).half().to(DEVICE), codes, cb, 4)
    with pytest.raises(ValueError, match="codebook"):
        cg.codebook_gemv(x, codes, cb[:, :8], 4)
    with pytest.raises(ValueError, match="x"):
        cg.codebook_gemv(x.float(), codes, cb, 4)
    with pytest.raises(ValueError, match="bits"):
        cg.codebook_gemv(x, codes, cb, 3)
    with pytest.raises(ValueError, match="residual"):
        cg.codebook_gemv(x, codes, cb, 4, residual=torch.zeros(2, 9, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="x"):
        cg.codebook_gemv(torch.randn(2, 2, 64).half().to(DEVICE), codes, cb, 4)
    with pytest.raises(ValueError, match="codes"):
        cg.codebook_gemv(x, codes.view(torch.int8), cb, 4)
    with pytest.raises(ValueError, match="f"):
        c2, cb2, f = cg.interleave_gate_up(codes, cb, codes, cb)
        cg.codebook_gemv_gate_up(x, c2, cb2, 4, 99)
    with pytest.raises(ValueError, match="act"):
        c2, cb2, f = cg.interleave_gate_up(codes, cb, codes, cb)
        cg.codebook_gemv_gate_up(x, c2, cb2, 4, f, act="relu")


# ----------------------------------------------------------------------------- GPU, full size
@requires_cuda
@pytest.mark.parametrize("model", list(MODELS))
def test_gemv_real_shapes_gpu(model):
    gen = torch.Generator().manual_seed(7)
    for k, n in gemv_shapes(model):
        codes, cb = _weights(n, k, 4, gen)
        x16 = torch.randn(16, k, generator=gen).half().cuda()
        ref16 = cg.codebook_gemv_reference(x16, codes, cb, 4)  # float64 on the GPU
        for m in (1, 2, 8, 9, 16):
            for be in ["triton"] + ([f"mma-{v}" for v in (3, 4, 5, 7)] if cg._mma_shape_ok(m, k, 4) and cg.mma_available() else []):
                with _variant(be):
                    y = cg.codebook_gemv(x16[:m], codes, cb, 4, backend=be.split("-")[0])
                assert rel_err(y, ref16[:m]) < TOL[torch.float16], (model, k, n, m, be)


@requires_cuda
def test_gemv_lm_head_8bit_gpu():
    gen = torch.Generator().manual_seed(3)
    codes, cb = _weights(32000, 4096, 8, gen)
    x = torch.randn(1, 4096, generator=gen).half().cuda()
    ref = cg.codebook_gemv_reference(x, codes, cb, 8)
    for be in ("triton", "mma"):
        assert rel_err(cg.codebook_gemv(x, codes, cb, 8, backend=be), ref) < TOL[torch.float16], be


@requires_cuda
@pytest.mark.parametrize("k,n", BENCH_GEMV_4BIT[:3])
def test_gemv_bitwise_reproducible_and_batch_invariant_gpu(k, n):
    gen = torch.Generator().manual_seed(11)
    codes, cb = _weights(n, k, 4, gen)
    x = torch.randn(8, k, generator=gen).half().cuda()
    for be in ["triton"] + ([f"mma-{v}" for v in (3, 4, 5, 7)] if cg.mma_available() else []):
        with _variant(be):
            kb = be.split("-")[0]
            y0 = cg.codebook_gemv(x, codes, cb, 4, backend=kb)
            for _ in range(20):
                assert torch.equal(cg.codebook_gemv(x, codes, cb, 4, backend=kb), y0), be
            if kb == "mma":  # row 0 alone gives the same bits as row 0 of a batch of 8
                assert torch.equal(cg.codebook_gemv(x[:1], codes, cb, 4, backend=kb), y0[:1])


@requires_cuda
def test_gemv_cuda_graph_gpu():
    gen = torch.Generator().manual_seed(5)
    codes, cb = _weights(4096, 4096, 4, gen)
    x = torch.randn(1, 4096, generator=gen).half().cuda()
    res = torch.randn(1, 4096, generator=gen).half().cuda()
    y = torch.empty(1, 4096, dtype=torch.float16, device="cuda")
    cg.codebook_gemv(x, codes, cb, 4, res, out=y)  # warm-up: compile, set attributes
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cg.codebook_gemv(x, codes, cb, 4, res, out=y)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cg.codebook_gemv(x, codes, cb, 4, res, out=y)
    eager = cg.codebook_gemv(x, codes, cb, 4, res)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)


# ----------------------------------------------------------------------------- tiled codes (variant 11)
@pytest.mark.parametrize("n,kb", [(1, 64), (16, 64), (17, 192), (100, 128), (33, 2048)])
def test_tile_codes_layout(n, kb):
    """Lane (g, t) of tile T, chunk c, half h reads 512 contiguous bytes per warp: rows 16T+g+8h, bytes 64c+16t."""
    gen = torch.Generator().manual_seed(n + kb)
    codes = torch.randint(0, 256, (n, kb), dtype=torch.uint8, generator=gen)
    t = cg.tile_codes(codes)
    assert t.shape == (-(-n // 16) * 16, kb) and torch.equal(cg.untile_codes(t, n), codes)
    flat, r = t.reshape(-1), random.Random(n)
    for _ in range(50):
        T, c, h, g, tt = r.randrange(t.shape[0] // 16), r.randrange(kb // 64), r.randrange(2), r.randrange(8), r.randrange(4)
        off = (T * (kb // 64) + c) * 1024 + h * 512 + (g * 4 + tt) * 16
        row = 16 * T + g + 8 * h
        want = codes[row, 64 * c + 16 * tt: 64 * c + 16 * tt + 16] if row < n else torch.zeros(16, dtype=torch.uint8)
        assert torch.equal(flat[off: off + 16], want)
    with pytest.raises(ValueError, match="multiple of 64"):
        cg.tile_codes(codes[:, :32])


def test_tiled_call_checks():
    gen = torch.Generator().manual_seed(2)
    codes, cb = _weights(20, 128, 4, gen, device="cpu")
    x = torch.randn(128, generator=gen).half()
    with pytest.raises(ValueError, match="tiled codes need 32 rows"):
        cg.codebook_gemv(x, codes, cb, 4, tiled=True)
    with pytest.raises(ValueError, match="mma"):
        cg.codebook_gemv(x, cg.tile_codes(codes), cb, 4, tiled=True, backend="triton")


def test_tiled_codes_fall_back_without_the_kernel(monkeypatch):
    """TRAPETUM_TC=0 (or no CUDA kernel): tiled codes are untiled for the fallback path, same result."""
    monkeypatch.setenv("TRAPETUM_TC", "0")
    gen = torch.Generator().manual_seed(4)
    codes, cb = _weights(40, 256, 4, gen)
    x = torch.randn(2, 256, generator=gen).half().to(DEVICE)
    y = cg.codebook_gemv(x, cg.tile_codes(codes), cb, 4, tiled=True)
    assert rel_err(y, cg.codebook_gemv_reference(x, codes, cb, 4)) < TOL[torch.float16]
    gc, gb = _weights(24, 256, 4, gen)
    uc, ub = _weights(24, 256, 4, gen)
    ic, ib, f = cg.interleave_gate_up(gc, gb, uc, ub)
    y = cg.codebook_gemv_gate_up(x, cg.tile_codes(ic), ib, 4, f, "silu", tiled=True)
    assert rel_err(y, cg.codebook_gemv_gate_up_reference(x, ic, ib, 4, f, "silu")) < TOL[torch.float16]


@requires_cuda
@pytest.mark.parametrize("seed", range(60))
def test_tiled_gemv_random_gpu(seed):
    """Variant 11 on tiled codes: float64 agreement and the same bits as variant 7 on canonical codes."""
    r = random.Random(seed)
    bits = r.choice([4, 4, 8])
    k = (512 // bits) * r.randint(1, 60)
    n = r.choice(AWKWARD + [r.randint(1, 5000)])
    m = r.choice([1, 1, 2, 5, 8, 9, 16])
    gen = torch.Generator().manual_seed(seed)
    codes, cb = _weights(n, k, bits, gen)
    x = torch.randn(m, k, generator=gen).half().cuda()
    res = torch.randn(m, n, generator=gen).half().cuda() if r.random() < 0.4 else None
    tiled = cg.tile_codes(codes)
    y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    cg.codebook_gemv(x, tiled, cb, bits, res, out=y, tiled=True)
    assert rel_err(y, cg.codebook_gemv_reference(x, codes, cb, bits, res)) < TOL[torch.float16], (bits, m, k, n)
    with _variant("mma-7"):
        y7 = cg.codebook_gemv(x, codes, cb, bits, res, backend="mma")
    assert torch.equal(y, y7)
    for _ in range(5):
        assert torch.equal(cg.codebook_gemv(x, tiled, cb, bits, res, tiled=True), y)


@requires_cuda
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_tiled_gate_up_gpu(act):
    gen = torch.Generator().manual_seed(9)
    gc, gb = _weights(11008, 4096, 4, gen)
    uc, ub = _weights(11008, 4096, 4, gen)
    codes, cb, f = cg.interleave_gate_up(gc, gb, uc, ub)
    x = torch.randn(1, 4096, generator=gen).half().cuda()
    y = cg.codebook_gemv_gate_up(x, cg.tile_codes(codes), cb, 4, f, act, tiled=True)
    with _variant("mma-7"):
        y7 = cg.codebook_gemv_gate_up(x, codes, cb, 4, f, act, backend="mma")
    assert torch.equal(y, y7)
    ref = cg.codebook_gemv_gate_up_reference(x, codes, cb, 4, f, act)
    assert rel_err(y, ref) < TOL[torch.float16]
