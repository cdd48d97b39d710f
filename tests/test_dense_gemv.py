"""Dense GEMV of the fp16 path (CUDA kernel on the GPU; Triton under the interpreter or with the kernels off; torch
row by row) vs float64, and the batch-invariance contract: each row of an M-row call has the bits of the M = 1 call."""
from __future__ import annotations

import random

import pytest
import torch

from kernels_conftest import DEVICE, ON_GPU, TOL, rel_err, requires_cuda
from shapes import ROWS, ROWS_GATE_UP_4BIT, ROWS_GEMV_4BIT
from trapetum.kernels import cuda_ext
from trapetum.kernels.dense_gemv import (dense_gemv, dense_gemv_gate_up, dense_gemv_gate_up_reference,
                                         dense_gemv_reference)
from trapetum.settings import KernelOptions

N_RANDOM = 220 if ON_GPU else 20
KERNELS_OFF = KernelOptions(cuda=False)


def _case(seed):
    r = random.Random(seed)
    k = 8 * r.randint(1, 1400) if r.random() < 0.8 else r.randint(1, 3000)  # in % 8 != 0 -> fallback
    n = r.choice([1, 2, 3, 7, 8, 33, 4096, r.randint(1, 6000)]) if ON_GPU else r.randint(1, 70)
    if not ON_GPU:
        k = min(k, 300)
    m = r.choice([None, None, 1, 2, 3, 5, 8, 9, 16])  # None: a 1-D x
    return n, k, m, r.random() < 0.4


def _backends():
    return ["triton", "torch"] + (["cuda"] if ON_GPU and cuda_ext.ready() is not None else [])


@pytest.mark.parametrize("seed", range(N_RANDOM))
def test_dense_gemv_random_shapes(seed):
    n, k, m, with_res = _case(seed)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).half().to(DEVICE)
    shape = (k,) if m is None else (m, k)
    x = torch.randn(*shape, generator=g).half().to(DEVICE)
    res = torch.randn(*shape[:-1], n, generator=g).half().to(DEVICE) if with_res else None
    y = dense_gemv(x, w, res)
    ref = dense_gemv_reference(x.cpu(), w.cpu(), None if res is None else res.cpu())
    assert y.shape == (*shape[:-1], n) and y.dtype == torch.float16
    assert rel_err(y, ref) < TOL[torch.float16], (n, k, m, rel_err(y, ref))


def _act(g, act):
    return torch.nn.functional.silu(g) if act == "silu" else torch.nn.functional.gelu(g, approximate="tanh")


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("f,k,extra", [(1, 8, 0), (37, 96, 0), (300, 520, 3), (11008, 4096, 0)])
def test_dense_gate_up(act, f, k, extra):
    if not ON_GPU and f > 1000:
        pytest.skip("full size on the GPU only")
    g = torch.Generator().manual_seed(f + k)
    w = torch.randn(2 * f + extra, k, generator=g).half().to(DEVICE)
    x = (torch.randn(k, generator=g) * 0.05).half().to(DEVICE)
    y = dense_gemv_gate_up(x, w, f, act)
    ref = _act(w[:f].double().cpu() @ x.double().cpu(), act) * (w[f:2 * f].double().cpu() @ x.double().cpu())
    assert y.shape == (f,) and rel_err(y, ref) < 2e-3
    x4 = (torch.randn(4, k, generator=g) * 0.05).half().to(DEVICE)
    for be in _backends():
        y4 = dense_gemv_gate_up(x4, w, f, act, backend=be)
        assert y4.shape == (4, f) and rel_err(y4, dense_gemv_gate_up_reference(x4.cpu(), w.cpu(), f, act)) < 2e-3, be


def test_bad_input_raises():
    w = torch.zeros(4, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="x"):
        dense_gemv(torch.zeros(15, dtype=torch.float16, device=DEVICE), w)
    with pytest.raises(ValueError, match="residual"):
        dense_gemv(torch.zeros(16, dtype=torch.float16, device=DEVICE), w, torch.zeros(3, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="f"):
        dense_gemv_gate_up(torch.zeros(16, dtype=torch.float16, device=DEVICE), w, 3, "silu")
    with pytest.raises(ValueError, match="act"):
        dense_gemv_gate_up(torch.zeros(16, dtype=torch.float16, device=DEVICE), w, 2, "relu")
    with pytest.raises(ValueError, match="x"):
        dense_gemv(torch.zeros(2, 16, dtype=torch.float32, device=DEVICE), w)
    with pytest.raises(ValueError, match="out"):
        dense_gemv(torch.zeros(2, 16, dtype=torch.float16, device=DEVICE), w, out=torch.empty(4, device=DEVICE).half())
    with pytest.raises(ValueError, match="backend"):
        dense_gemv(torch.zeros(16, dtype=torch.float16, device=DEVICE), w, backend="cublas")
    if not ON_GPU:
        with pytest.raises(ValueError, match="backend"):
            dense_gemv(torch.zeros(16, dtype=torch.float16), w, backend="cuda")


# ----------------------------------------------------------------------------- batch invariance
def _rows_equal_singles(call, x, res=None):
    singles = [call(x[i], None if res is None else res[i]) for i in range(x.shape[0])]
    for m in range(1, x.shape[0] + 1):
        y = call(x[:m], None if res is None else res[:m])
        for i in range(m):
            assert torch.equal(y[i], singles[i]), (m, i)
    return singles


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("n,k", [(53, 97), (3, 1), (17, 257), (40, 64)])
def test_rows_bitwise_equal_single_rows(n, k, backend):
    """M = 1..16: each row of the M-row call equals the 1-D call on that row (plain, residual, gate/up)."""
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).half().to(DEVICE)
    x = torch.randn(len(ROWS), k, generator=g).half().to(DEVICE)
    res = torch.randn(len(ROWS), n, generator=g).half().to(DEVICE)
    _rows_equal_singles(lambda xm, rm: dense_gemv(xm, w, backend=backend), x)
    _rows_equal_singles(lambda xm, rm: dense_gemv(xm, w, rm, backend=backend), x, res)
    if n >= 2:
        f = n // 2
        for act in ("silu", "gelu_tanh"):
            _rows_equal_singles(lambda xm, _, act=act: dense_gemv_gate_up(xm, w, f, act, backend=backend), x)


def test_kernels_off_use_the_triton_path_for_every_row_count():
    """With the CUDA kernels off (or under the interpreter) M = 1 runs the same Triton kernel as M rows."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(33, 80, generator=g).half().to(DEVICE)
    x = torch.randn(5, 80, generator=g).half().to(DEVICE)
    y = dense_gemv(x, w, kopts=KERNELS_OFF)
    assert torch.equal(y, dense_gemv(x, w, backend="triton"))
    assert torch.equal(dense_gemv(x[2], w, kopts=KERNELS_OFF), y[2])


@requires_cuda
def test_dense_kernel_is_used_and_bitwise_reproducible_gpu():
    assert cuda_ext.ready() is not None, cuda_ext.error()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4096, 4096, generator=g).half().cuda()
    for shape in ((4096,), (8, 4096)):
        x = torch.randn(*shape, generator=g).half().cuda()
        res = torch.randn(*shape[:-1], 4096, generator=g).half().cuda()
        first = dense_gemv(x, w, res)
        assert torch.equal(first, dense_gemv(x, w, res, backend="cuda"))
        for _ in range(100):
            assert torch.equal(dense_gemv(x, w, res), first)
        out = torch.empty_like(first)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dense_gemv(x, w, res, out=out)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)  # graph and eager give the same bits


DENSE_ROW_CASES = [("plain", k, n) for k, n in ROWS_GEMV_4BIT] + [("gate_up", k, f) for k, f in ROWS_GATE_UP_4BIT]


@requires_cuda
@pytest.mark.parametrize("case", DENSE_ROW_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_rows_bitwise_equal_single_rows_gpu(case):
    """The verify contract for the fp16 kernel at the real shapes: M = 1..16 rows, each equal to the M = 1 call."""
    kind, k, n = case
    g = torch.Generator(device="cuda").manual_seed(k + n)
    w = torch.randn(2 * n if kind == "gate_up" else n, k, device="cuda", generator=g).half()
    x = torch.randn(len(ROWS), k, device="cuda", generator=g).half()
    if kind == "plain":
        res = torch.randn(len(ROWS), n, device="cuda", generator=g).half()
        _rows_equal_singles(lambda xm, rm: dense_gemv(xm, w, backend="cuda"), x)
        singles = _rows_equal_singles(lambda xm, rm: dense_gemv(xm, w, rm, backend="cuda"), x, res)
        def call(xm):
            return dense_gemv(xm, w, res[: xm.shape[0]], backend="cuda")
        ref = dense_gemv_reference(x, w, res)
    else:
        for act in ("silu", "gelu_tanh"):
            singles = _rows_equal_singles(lambda xm, _, act=act: dense_gemv_gate_up(xm, w, n, act, backend="cuda"), x)

        def call(xm):
            return dense_gemv_gate_up(xm, w, n, "gelu_tanh", backend="cuda")
        ref = dense_gemv_gate_up_reference(x, w, n, "gelu_tanh")
    x2 = x.clone()
    x2[1:] = 6e4 * torch.sign(torch.randn(len(ROWS) - 1, k, device="cuda", generator=g)).half()
    assert torch.equal(call(x2)[0], singles[0])  # whatever the other rows hold
    assert rel_err(call(x), ref) < 2e-3


@requires_cuda
def test_triton_rows_bitwise_equal_single_rows_gpu():
    g = torch.Generator(device="cuda").manual_seed(4)
    for n, k in ((4096, 4096), (300, 1000), (37, 99)):
        w = torch.randn(n, k, device="cuda", generator=g).half()
        x = torch.randn(len(ROWS), k, device="cuda", generator=g).half()
        res = torch.randn(len(ROWS), n, device="cuda", generator=g).half()
        _rows_equal_singles(lambda xm, rm, w=w: dense_gemv(xm, w, rm, backend="triton"), x, res)
        _rows_equal_singles(lambda xm, _, w=w, f=n // 2: dense_gemv_gate_up(xm, w, f, "silu", backend="triton"), x)
