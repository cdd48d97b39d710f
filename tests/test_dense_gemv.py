"""fp16 GEMV of the fp16 path (CUDA kernel on the GPU, cuBLAS/torch fallback elsewhere) vs float64."""
from __future__ import annotations

import random

import pytest
import torch

from kernels_conftest import DEVICE, ON_GPU, TOL, rel_err, requires_cuda
from trapetum.kernels import cuda_ext
from trapetum.kernels.dense_gemv import dense_gemv, dense_gemv_gate_up, dense_gemv_reference

N_RANDOM = 220 if ON_GPU else 20


def _case(seed):
    r = random.Random(seed)
    k = 8 * r.randint(1, 1400) if r.random() < 0.8 else r.randint(1, 3000)  # in % 8 != 0 -> fallback
    n = r.choice([1, 2, 3, 7, 8, 33, 4096, r.randint(1, 6000)]) if ON_GPU else r.randint(1, 70)
    if not ON_GPU:
        k = min(k, 300)
    return n, k, r.random() < 0.4


@pytest.mark.parametrize("seed", range(N_RANDOM))
def test_dense_gemv_random_shapes(seed):
    n, k, with_res = _case(seed)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).half().to(DEVICE)
    x = torch.randn(k, generator=g).half().to(DEVICE)
    res = torch.randn(n, generator=g).half().to(DEVICE) if with_res else None
    y = dense_gemv(x, w, res)
    ref = dense_gemv_reference(x.cpu(), w.cpu(), None if res is None else res.cpu())
    assert y.shape == (n,) and y.dtype == torch.float16
    assert rel_err(y, ref) < TOL[torch.float16], (n, k, rel_err(y, ref))


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


@requires_cuda
def test_dense_kernel_is_used_and_bitwise_reproducible_gpu():
    assert cuda_ext.ready() is not None, cuda_ext.error()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4096, 4096, generator=g).half().cuda()
    x = torch.randn(4096, generator=g).half().cuda()
    res = torch.randn(4096, generator=g).half().cuda()
    first = dense_gemv(x, w, res)
    for _ in range(100):
        assert torch.equal(dense_gemv(x, w, res), first)
    out = torch.empty_like(first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dense_gemv(x, w, res, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)  # graph and eager give the same bits
