"""The 4-bit codebook GEMV on more than 16 rows through Hopper's warpgroup MMA (kernels/codebook_gemm_wgmma.py,
``KernelOptions.many_rows`` "wgmma", the default where it runs). Its contract is the grouped mma kernel's bits, row
for row: CPU: the option's checks and the fallback where it cannot run; GPU (sm_90): random awkward shapes against
the grouped mma kernel bit for bit, against one-row calls and float64, the gate/up epilogues, residuals, CUDA-graph
replay and PDL."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from trapetum.errors import ConfigError
from trapetum.kernels import codebook_gemm_wgmma as wg
from trapetum.settings import MANY_ROWS_KERNELS, KernelOptions

from kernels_conftest import DEVICE, TOL, codebook_gemv as cg, rel_err
from shapes import AWKWARD

MMA = KernelOptions(many_rows="mma")
WG = KernelOptions(many_rows="wgmma")
requires_wgmma = pytest.mark.skipif(not (torch.cuda.is_available() and wg.ready(torch.device("cuda"), WG)),
                                    reason="needs an sm_90 GPU and the wgmma extension")
M_MANY = (17, 31, 32, 33, 48, 63, 64, 65, 100, 128, 200, 256)


def test_many_rows_option():
    """"wgmma" by default, "mma" the grouped kernel; anything else is a ConfigError naming the field."""
    assert KernelOptions().many_rows == "wgmma" and set(MANY_ROWS_KERNELS) == {"wgmma", "mma"}
    for bad in ("", "cuda", "WGMMA", 1):
        with pytest.raises(ConfigError, match="many_rows"):
            KernelOptions(many_rows=bad)


def test_wgmma_warpgroups_option():
    """0 (the kernel's rule) by default, 1-3 forced; anything else is a ConfigError naming the field."""
    assert KernelOptions().wgmma_warpgroups == 0 and KernelOptions(wgmma_warpgroups=3).wgmma_warpgroups == 3
    for bad in (-1, 4, 8, "2"):
        with pytest.raises(ConfigError, match="wgmma_warpgroups"):
            KernelOptions(wgmma_warpgroups=bad)


def test_not_ready_without_hopper_or_kernels():
    """No CUDA, kernels off or "mma": the wgmma kernel is not taken (the grouped kernel or the fallbacks run)."""
    assert not wg.ready(torch.device("cpu"), WG)
    assert not wg.ready(DEVICE, KernelOptions(cuda=False))
    assert not wg.ready(DEVICE, MMA)


def test_many_rows_fallback_cpu():
    """Tiled 4-bit codes, 33 rows, where the kernel cannot run: the fallback agrees with float64."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (53, 128), dtype=torch.uint8, generator=gen).to(DEVICE)
    cb = torch.randn(53, 16, generator=gen).half().to(DEVICE)
    x = torch.randn(33, 256, generator=gen).half().to(DEVICE)
    y = cg.codebook_gemv(x, cg.tile_codes(codes), cb, 4, tiled=True, kopts=KernelOptions(cuda=False))
    assert rel_err(y, cg.codebook_gemv_reference(x, codes, cb, 4)) < TOL[torch.float16]


def test_takes_where_it_measured_faster():
    """The dispatch rule (codebook_gemm_wgmma.takes): never at 16 rows or fewer; 17..32 rows from 8,192 output rows;
    above 32 rows from 2**25 weights (the Llama-2-7B q/k/v, gate/up and down GEMVs, not its 4096 x 4096 o)."""
    assert not any(wg.takes(m, 22016, 4096) for m in (1, 8, 16))
    assert wg.takes(17, 12288, 4096) and wg.takes(32, 22016, 4096) and not wg.takes(32, 4096, 11008)
    assert wg.takes(33, 4096, 11008) and wg.takes(64, 12288, 4096) and not wg.takes(64, 4096, 4096)
    assert wg.takes(256, 8192, 16)


def _weights(n, k, gen):
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    return codes.cuda(), torch.randn(n, 16, generator=gen).half().cuda()


def _x(m, k, gen, spread):
    x = torch.randn(m, k, generator=gen)
    if spread:  # exponents over 2^-6 .. 2^4: alignment and cancellation inside each k-step, no fp16 overflow
        x = x * torch.exp2(torch.randint(-6, 5, (m, k), generator=gen).float())
    return x.half().cuda()


@requires_wgmma
@pytest.mark.parametrize("seed", range(40))
def test_wgmma_random_shapes_gpu(seed):
    """Awkward N (1, 3, 53, 97, 257, 1025 or random), K from one chunk (< 8 partials) to many, M 17..256, with and
    without residual: the grouped mma kernel's bits everywhere, sampled rows their one-row calls', float64."""
    r = random.Random(seed)
    k = 128 * r.choice([1, 2, 3, 7, 8, 9, r.randint(1, 90)])
    n = r.choice(AWKWARD + [r.randint(1, 5000)])
    m = r.choice(M_MANY + (r.randint(17, 256),))
    gen = torch.Generator().manual_seed(seed)
    codes, cb = _weights(n, k, gen)
    x = _x(m, k, gen, spread=seed % 2 == 1)
    res = torch.randn(m, n, generator=gen).half().cuda() if r.random() < 0.4 else None
    kc = cg.tile_codes(codes)
    y_wg = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    y_mma = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    wg.gemm(x, kc, cb, y_wg, residual=res)
    cg.codebook_gemv(x, kc, cb, 4, res, out=y_mma, tiled=True, kopts=MMA)
    assert torch.equal(y_wg.view(torch.int16), y_mma.view(torch.int16)), (m, k, n)
    # any block shape, residue split and warpgroup count: the same bits
    nx, rs, wgs = r.choice([32, 64]), r.choice([1, 2, 4, 8]), r.choice([1, 2, 3])
    y_split = wg.gemm(x, kc, cb, torch.empty_like(y_wg), residual=res, nx=nx, rs=rs, wg=wgs)
    assert torch.equal(y_split.view(torch.int16), y_mma.view(torch.int16)), (m, k, n, nx, rs, wgs)
    ref = cg.codebook_gemv_reference(x, codes, cb, 4, res)
    assert rel_err(y_wg, ref) < TOL[torch.float16], (m, k, n)
    for i in sorted({0, 15, 16, 63, 64, m - 1, r.randrange(m)} & set(range(m))):
        one = cg.codebook_gemv(x[i:i + 1], kc, cb, 4, None if res is None else res[i:i + 1], tiled=True)
        assert torch.equal(y_wg[i:i + 1].view(torch.int16), one.view(torch.int16)), (i, m, k, n)


@requires_wgmma
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("f", [1, 3, 53, 97, 257, 4096])
def test_wgmma_gate_up_gpu(f, act):
    """The gate/up epilogue at awkward F: the grouped kernel's bits, every row its one-row call's, float64."""
    gen = torch.Generator().manual_seed(f)
    k = 384
    gc, gb = _weights(f, k, gen)
    uc, ub = _weights(f, k, gen)
    codes, cb, ff = cg.interleave_gate_up(gc, gb, uc, ub)
    kc = cg.tile_codes(codes)
    for m in (17, 64, 65, 130):
        x = _x(m, k, gen, spread=False)  # act(gate) * up of spread inputs overflows fp16
        y_wg = wg.gemm(x, kc, cb, torch.empty(m, ff, dtype=torch.float16, device="cuda"), gate_up_f=ff,
                       act=cg.ACTS[act])
        y_mma = cg.codebook_gemv_gate_up(x, kc, cb, 4, ff, act, tiled=True, kopts=MMA)
        assert torch.equal(y_wg.view(torch.int16), y_mma.view(torch.int16)), (f, m)
        for wgs in (2, 3):  # warpgroups sharing a block's x stages: the same bits
            y2 = wg.gemm(x, kc, cb, torch.empty(m, ff, dtype=torch.float16, device="cuda"), gate_up_f=ff,
                         act=cg.ACTS[act], wg=wgs, rs=2)
            assert torch.equal(y2.view(torch.int16), y_mma.view(torch.int16)), (f, m, wgs)
        ref = cg.codebook_gemv_gate_up_reference(x, codes, cb, 4, ff, act)
        assert rel_err(y_wg, ref) < TOL[torch.float16], (f, m)
        singles = torch.cat([cg.codebook_gemv_gate_up(x[i:i + 1], kc, cb, 4, ff, act, tiled=True) for i in (0, m - 1)])
        assert torch.equal(y_wg[[0, m - 1]].view(torch.int16), singles.view(torch.int16)), (f, m)


@requires_wgmma
def test_codebook_gemv_dispatch_gpu(monkeypatch):
    """codebook_gemv / codebook_gemv_gate_up send a 64-row call on large tiled 4-bit codes to the wgmma kernel under
    many_rows "wgmma" (default), and not under "mma" or at 16 rows."""
    calls = []
    real = wg.gemm
    monkeypatch.setattr(wg, "gemm", lambda *a, **k: calls.append(k) or real(*a, **k))
    gen = torch.Generator().manual_seed(5)
    codes, cb = _weights(8192, 256, gen)
    kc = cg.tile_codes(codes)
    for m, kopts, want in ((64, WG, 1), (64, MMA, 0), (16, WG, 0)):
        calls.clear()
        cg.codebook_gemv(_x(m, 256, gen, False), kc, cb, 4, tiled=True, kopts=kopts)
        assert len(calls) == want, (m, kopts.many_rows)
    gu, gb, _ = cg.interleave_gate_up(codes[:4096], cb[:4096], codes[4096:], cb[4096:])
    calls.clear()
    cg.codebook_gemv_gate_up(_x(64, 256, gen, False), cg.tile_codes(gu), gb, 4, 4096, tiled=True, kopts=WG)
    assert len(calls) == 1 and calls[0]["gate_up_f"] == 4096


@requires_wgmma
@pytest.mark.parametrize("pdl", ["off", "all"])
def test_wgmma_graph_replay_gpu(pdl):
    """Captured in a CUDA graph (with or without PDL) after a producer kernel: replays give the eager bits, for new
    inputs written into the same buffers too."""
    gen = torch.Generator().manual_seed(11)
    kopts = dataclasses.replace(WG, pdl=pdl)
    codes, cb = _weights(300, 1024, gen)
    kc = cg.tile_codes(codes)
    x_src = _x(64, 1024, gen, spread=True)
    x = torch.empty_like(x_src)
    res = torch.randn(64, 300, generator=gen).half().cuda()
    y = torch.empty(64, 300, dtype=torch.float16, device="cuda")

    def step():
        torch.mul(x_src, 1.0, out=x)  # the producer the GEMV waits for
        wg.gemm(x, kc, cb, y, residual=res, rs=4, pdl=kopts.pdl_cuda)  # a residue split: the counters' reset too

    step()
    eager = y.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), eager.view(torch.int16))
    x_src.copy_(_x(64, 1024, gen, spread=False))
    g.replay()
    want = cg.codebook_gemv(x_src, kc, cb, 4, res, tiled=True, kopts=MMA)
    torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
