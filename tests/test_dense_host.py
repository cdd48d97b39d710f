"""The dense host GEMV (kernels/dense_host.py): against float64 over awkward shapes, each row bitwise its
one-row result for every M up to 64, the same bits for every thread count, bias and residual epilogues."""
from __future__ import annotations

import pytest
import torch

from trapetum.kernels import dense_host as dh

if not dh.available():
    pytest.skip(f"dense host GEMV unavailable: {dh.error()}", allow_module_level=True)


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 53, 97), (17, 257, 3), (53, 97, 257), (64, 576, 128),
                                   (2, 16, 16), (5, 31, 33)])
def test_matches_float64(m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b, r = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    assert _rel(dh.dense_gemv_host(x, w), dh.reference(x, w)) < 1e-6
    assert _rel(dh.dense_gemv_host(x, w, b, r), dh.reference(x, w, b, r)) < 1e-6


@pytest.mark.parametrize("m", [1, 3, 16, 17, 53, 64])
def test_rows_are_batch_invariant_and_thread_invariant(m):
    g = torch.Generator().manual_seed(m)
    k, n = 257, 97
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    res = torch.randn(m, n, generator=g)
    full = dh.dense_gemv_host(x, w, b, res, threads=1)
    for threads in (2, 3, 8):
        assert torch.equal(dh.dense_gemv_host(x, w, b, res, threads=threads), full)
    for i in range(m):
        one = dh.dense_gemv_host(x[i:i + 1].clone(), w, b, res[i:i + 1].clone(), threads=1)
        assert torch.equal(full[i:i + 1], one), i


def test_strided_inputs_and_bad_arguments():
    x = torch.randn(4, 40)[:, :33]                      # row stride 40
    w = torch.randn(7, 50)[:, :33]
    assert _rel(dh.dense_gemv_host(x, w), dh.reference(x, w)) < 1e-6
    with pytest.raises(ValueError, match="x must be fp32"):
        dh.dense_gemv_host(torch.randn(2, 33, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="bias must be fp32"):
        dh.dense_gemv_host(x, w, torch.randn(6))
