"""kernels/expert_gemv_mma.py (CUDA tensor-core expert GEMVs; GPU tests skip without CUDA and the extension): gate/up
and down against the float64 references over random shapes (awkward E, k, f, D; K and F where 64 code bytes per row
divide them), canonical and tiled codes, with and without residual; each (row, slot) bitwise the dense one-row mma
GEMV of its expert; row m of an M-row call (M = 1..16) bitwise its one-row call with other rows holding other data
and routing; CUDA-graph replays bitwise. The requirements' ValueErrors run everywhere (checked before the device)."""
import zlib

import pytest
import torch

from tests.test_expert_gemv import rel, routing, stacks
from trapetum.kernels import codebook_gemv as cg
from trapetum.kernels import expert_gemv as xg
from trapetum.kernels import expert_gemv_mma as xm

GPU = torch.cuda.is_available() and xm.applies(4, 128, 128, "cuda")
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (sm_80+) and the CUDA extension")

CASES = [  # bits, E, k, M, K, F, D   (4-bit: K, F % 128; 8-bit: % 64)
    (4, 1, 1, 1, 128, 128, 1),
    (4, 3, 2, 3, 256, 128, 97),
    (4, 8, 2, 16, 384, 256, 3),
    (4, 6, 6, 5, 128, 384, 53),
    (4, 64, 6, 2, 640, 128, 257),
    (4, 5, 3, 4, 1152, 640, 130),
    (8, 4, 2, 2, 64, 64, 20),
    (8, 7, 3, 9, 192, 128, 257),
]


def _tiled(gw, dw):
    return xm.tile_stack(gw), xm.tile_stack(dw)


@gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_expert_gemvs_match_float64_reference(case):
    bits, E, k, M, K, F, D = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))  # not hash(): salted per process
    (gw, gc), (dw, dc) = stacks("codebook", E, K, F, D, bits, g)
    x = torch.randn(M, K, generator=g).half().cuda()
    idx, w = routing(M, E, k, g)
    res = torch.randn(M, D, generator=g).half().cuda()
    tg, td = _tiled(gw, dw)
    for act in ("silu", "gelu_tanh"):
        want = xg.expert_gate_up_reference(x, idx, gw, gc, bits, F, act)
        h = xm.expert_gate_up_mma(x, idx, gw, gc, bits, F, act)
        assert h.shape == (M, k, F) and rel(h, want) < 2e-3
        assert torch.equal(xm.expert_gate_up_mma(x, idx, tg, gc, bits, F, act, tiled=True), h)
    for r in (None, res):
        want = xg.expert_down_reference(h, idx, w, dw, dc, bits, residual=r)
        y = xm.expert_down_mma(h, idx, w, dw, dc, bits, residual=r)
        assert y.shape == (M, D) and rel(y, want) < 2e-3
        assert torch.equal(xm.expert_down_mma(h, idx, w, td, dc, bits, residual=r, tiled=True), y)
    assert torch.equal(xm.expert_down_mma(h, idx.long(), w, dw, dc, bits), xm.expert_down_mma(h, idx, w, dw, dc, bits))


@gpu
@pytest.mark.parametrize("f", [1, 53, 97, 128])
def test_cuda_gate_up_awkward_f_and_bitwise_the_dense_one_row_gemv(f):
    """f not a multiple of 8 (the last tile's gate/up rows partly padding); each (m, j) bitwise the dense mma
    gate/up GEMV of expert idx[m, j] on x[m]; down with one slot of weight 1 bitwise the dense mma GEMV."""
    g = torch.Generator().manual_seed(f)
    E, k, M, K, D = 5, 3, 4, 256, 97
    (gw, gc), _ = stacks("codebook", E, K, f, D, 4, g)
    x = torch.randn(M, K, generator=g).half().cuda()
    idx, _ = routing(M, E, k, g)
    h = xm.expert_gate_up_mma(x, idx, gw, gc, 4, f, "silu")
    assert rel(h, xg.expert_gate_up_reference(x, idx, gw, gc, 4, f, "silu")) < 2e-3
    for m in range(M):
        for j in range(k):
            e = int(idx[m, j])
            one = cg.codebook_gemv_gate_up(x[m], gw[e], gc[e], 4, f, "silu", backend="mma")
            assert torch.equal(h[m, j], one), (m, j)
    F = 128
    _, (dw, dc) = stacks("codebook", E, K, F, D, 4, g)
    hh = torch.randn(M, 1, F, generator=g).half().cuda()
    res = torch.randn(M, D, generator=g).half().cuda()
    ones = torch.ones(M, 1, device="cuda")
    y = xm.expert_down_mma(hh, idx[:, :1], ones, dw, dc, 4, residual=res)
    for m in range(M):
        e = int(idx[m, 0])
        assert torch.equal(y[m], cg.codebook_gemv(hh[m, 0], dw[e], dc[e], 4, res[m], backend="mma")), m


@gpu
@pytest.mark.parametrize("tiled", [False, True])
def test_cuda_expert_rows_are_their_one_row_calls(tiled):
    """Row m of an M-row call (M = 1..16) has the bits of the one-row call on row m, with the other rows holding other
    data and other routing (some rows choosing the same experts)."""
    g = torch.Generator().manual_seed(3)
    E, k, K, F, D = 8, 2, 256, 128, 130
    (gw, gc), (dw, dc) = stacks("codebook", E, K, F, D, 4, g)
    if tiled:
        gw, dw = _tiled(gw, dw)
    for M in range(1, 17):
        x = torch.randn(M, K, generator=g).half().cuda()
        idx, w = routing(M, E, k, g)
        if M > 2:
            idx[1] = idx[0]
        res = torch.randn(M, D, generator=g).half().cuda()
        h = xm.expert_gate_up_mma(x, idx, gw, gc, 4, F, tiled=tiled)
        y = xm.expert_down_mma(h, idx, w, dw, dc, 4, residual=res, tiled=tiled)
        for m in range(M):
            h1 = xm.expert_gate_up_mma(x[m:m + 1].contiguous(), idx[m:m + 1], gw, gc, 4, F, tiled=tiled)
            y1 = xm.expert_down_mma(h1, idx[m:m + 1], w[m:m + 1], dw, dc, 4, residual=res[m:m + 1], tiled=tiled)
            assert torch.equal(h[m], h1[0]) and torch.equal(y[m], y1[0]), (M, m)


@gpu
def test_cuda_expert_gemvs_replay_bitwise_in_a_graph():
    g = torch.Generator().manual_seed(4)
    E, k, M, K, F, D = 16, 6, 1, 512, 256, 256
    (gw, gc), (dw, dc) = stacks("codebook", E, K, F, D, 4, g)
    gw, dw = _tiled(gw, dw)
    x = torch.randn(M, K, generator=g).half().cuda()
    idx, w = routing(M, E, k, g)
    res = torch.randn(M, D, generator=g).half().cuda()

    def step():
        h = xm.expert_gate_up_mma(x, idx, gw, gc, 4, F, tiled=True)
        return xm.expert_down_mma(h, idx, w, dw, dc, 4, residual=res, tiled=True)

    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    outs = []
    for i in range(20):
        if i == 10:  # new routing and data through the same graph: the ids are read on the device
            idx2, w2 = routing(M, E, k, g)
            idx.copy_(idx2)
            w.copy_(w2)
            x.copy_(torch.randn(M, K, generator=g).half())
            eager = step()
        graph.replay()
        outs.append(out.clone())
    assert all(torch.equal(o, outs[0]) for o in outs[:10]) and all(torch.equal(o, eager) for o in outs[10:])
    assert not torch.equal(outs[0], outs[10])


def test_cuda_expert_requirements_raise_value_errors():
    dev = "cuda" if GPU else "cpu"
    x = torch.zeros(2, 128, dtype=torch.float16, device=dev)
    idx = torch.zeros(2, 2, dtype=torch.int32, device=dev)
    codes = torch.zeros(3, 32, 64, dtype=torch.uint8, device=dev)
    cb = torch.zeros(3, 32, 16, dtype=torch.float16, device=dev)
    with pytest.raises(ValueError, match="bits"):
        xm.expert_gate_up_mma(x, idx, codes, cb, 2, 16)
    with pytest.raises(ValueError, match="input width 96"):
        xm.expert_gate_up_mma(x[:, :96].contiguous(), idx, codes[:, :, :48].contiguous(), cb, 4, 16)
    with pytest.raises(ValueError, match="f: 5"):
        xm.expert_gate_up_mma(x, idx, codes, cb, 4, 5)
    with pytest.raises(ValueError, match="idx"):
        xm.expert_gate_up_mma(x, idx[:1], codes, cb, 4, 16)
    with pytest.raises(ValueError, match="codes"):
        xm.expert_gate_up_mma(x, idx, codes[:, :, :32].contiguous(), cb, 4, 16)
    with pytest.raises(ValueError, match="codebook"):
        xm.expert_gate_up_mma(x, idx, codes, cb[:, :, :8].contiguous(), 4, 16)
    with pytest.raises(ValueError, match="act"):
        xm.expert_gate_up_mma(x, idx, codes, cb, 4, 16, "relu")
    h = torch.zeros(2, 2, 128, dtype=torch.float16, device=dev)
    w = torch.ones(2, 2, device=dev)
    with pytest.raises(ValueError, match="codes"):  # tiled down codes: rows padded to 16
        xm.expert_down_mma(h, idx, w, torch.zeros(3, 20, 64, dtype=torch.uint8, device=dev),
                           torch.zeros(3, 20, 16, dtype=torch.float16, device=dev), 4, tiled=True)
    with pytest.raises(ValueError, match="weights"):
        xm.expert_down_mma(h, idx, w[:1], codes, cb, 4)
    with pytest.raises(ValueError, match="residual"):
        xm.expert_down_mma(h, idx, w, codes, cb, 4, residual=torch.zeros(2, 31, dtype=torch.float16, device=dev))
    if not GPU:  # valid shapes, but no CUDA device: one error naming it
        with pytest.raises(ValueError, match="device"):
            xm.expert_gate_up_mma(x, idx, codes, cb, 4, 16)
    assert not xm.applies(2, 128, 128, dev) and not xm.applies(4, 96, 128, dev) and not xm.applies(4, 128, 64, dev)
