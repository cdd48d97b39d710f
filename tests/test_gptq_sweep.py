"""The GPTQ block sweep (trapetum/kernels/gptq_sweep.py): the torch loop against a per-element float64 reference,
the Triton kernel (interpreter on the CPU, compiled on CUDA) bit for bit against the torch loop, and
``gptq_assign`` / ``gptq_refine`` giving the same codes through either."""
from __future__ import annotations

import pytest
import torch

from trapetum.kernels.gptq_sweep import midpoints, sweep, sweep_torch, sweep_triton
from trapetum.quant.gptq import gptq_assign, gptq_refine, inverse_cholesky

CASES = [(1, 1, 2), (3, 53, 16), (53, 97, 16), (97, 3, 4), (257, 17, 16), (5, 128, 16), (2, 33, 3)]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernel in the Triton interpreter


def problem(R, B, K, seed, device="cpu"):
    """A strided W [R, B] (a slice of a wider matrix), U of a random SPD matrix, ascending books [R, K]."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(R, B + 9, generator=g, dtype=torch.float64).to(device)[:, 4:4 + B]
    A = torch.randn(B, B, generator=g, dtype=torch.float64)
    H = A @ A.T / B + torch.eye(B, dtype=torch.float64) * 0.1
    U = inverse_cholesky(H, 0.01)
    book = (torch.randn(R, K, generator=g, dtype=torch.float64) * 1.2).sort(1).values
    return W, U.to(device), book.to(device), midpoints(book).to(device)


def reference(W, U, book):
    """Element by element in float64: nearest centroid (argmin of the distance), error over U_ii, then the
    later columns of the row."""
    R, B = W.shape
    Wd = W.clone()
    codes = torch.empty(R, B, dtype=torch.long)
    E = torch.empty(R, B, dtype=torch.float64)
    for r in range(R):
        for i in range(B):
            a = int((Wd[r, i] - book[r]).abs().argmin())
            codes[r, i] = a
            E[r, i] = (Wd[r, i] - book[r, a]) / U[i, i]
            Wd[r, i + 1:] -= E[r, i] * U[i, i + 1:]
    return codes, E


@pytest.mark.parametrize("R,B,K", [c for c in CASES if c[0] * c[1] <= 1000])
def test_torch_sweep_matches_elementwise_reference(R, B, K):
    W, U, book, mid = problem(R, B, K, seed=R + B + K)
    codes, E = sweep_torch(W, U, book, mid)
    rc, rE = reference(W, U, book)
    assert torch.equal(codes, rc)
    assert float((E - rE).norm()) <= 1e-12 * float(rE.norm()) + 1e-300


@pytest.mark.parametrize("R,B,K", CASES)
def test_triton_sweep_equals_torch_bit_for_bit(R, B, K):
    W, U, book, mid = problem(R, B, K, seed=3 * R + B + K, device=DEV)
    c1, e1 = sweep_torch(W, U, book, mid)
    c2, e2 = sweep_triton(W, U, book, mid)
    assert torch.equal(c1, c2) and torch.equal(e1, e2)
    assert W.stride(1) == 1 and W.stride(0) == B + 9  # the strided slice was read in place


def test_assign_is_the_same_through_either_sweep():
    """Several blocks and a short last one (C = 53, block 16): the lazy updates between blocks too."""
    g = torch.Generator().manual_seed(5)
    R, C = 21, 53
    X = torch.randn(4 * C, C, generator=g, dtype=torch.float64) @ (
        torch.eye(C, dtype=torch.float64) + 0.5 * torch.randn(C, C, generator=g, dtype=torch.float64) / C ** 0.5)
    H = (X.T @ X / X.shape[0]).float().to(DEV)
    W = torch.randn(R, C, generator=g).to(DEV)
    book = (torch.randn(R, 16, generator=g) * 1.5).sort(1).values.to(DEV)
    a = gptq_assign(W, H, book, block=16, sweep_impl="torch")
    b = gptq_assign(W, H, book, block=16, sweep_impl="triton")
    assert torch.equal(a, b)
    assert torch.equal(gptq_assign(W, H, book, block=16, U=inverse_cholesky(H, 0.01), sweep_impl="torch"), a)


def test_sweep_refuses_bad_arguments():
    W, U, book, mid = problem(3, 5, 4, seed=1)
    with pytest.raises(ValueError, match="impl"):
        sweep(W, U, book, mid, "numpy")
    with pytest.raises(ValueError, match="float64"):
        sweep(W.float(), U, book, mid, "torch")
    with pytest.raises(ValueError, match="do not match"):
        sweep(W, U[:4, :4], book, mid, "torch")
    W, U, book, mid = problem(2, 257, 4, seed=1, device=DEV)
    with pytest.raises(ValueError, match="up to 256"):
        sweep(W, U, book, mid, "triton")


def test_triton_sweep_wide_block():
    """A block wider than 128 (the kernel's 8-row programs) up to the limit."""
    W, U, book, mid = problem(9, 256, 16, seed=4, device=DEV)
    c1, e1 = sweep_torch(W, U, book, mid)
    c2, e2 = sweep_triton(W, U, book, mid)
    assert torch.equal(c1, c2) and torch.equal(e1, e2)


@cuda
def test_cuda_kernel_equals_torch_at_a_real_block():
    """A Llama-2-7B projection's block (4096 rows x 128 columns, 16 centroids), compiled for the GPU."""
    W, U, book, mid = problem(4096, 128, 16, seed=11, device="cuda")
    c1, e1 = sweep_torch(W, U, book, mid)
    c2, e2 = sweep_triton(W, U, book, mid)
    assert torch.equal(c1, c2) and torch.equal(e1, e2)


@cuda
def test_cuda_refine_is_the_same_through_either_sweep():
    from trapetum.quant.codebook_fit import project_centroids
    from trapetum.quant.kmeans import kmeans_rows

    g = torch.Generator().manual_seed(2)
    R, C = 512, 1024
    d = torch.rand(C, generator=g) + 0.01
    A = torch.randn(C, C // 8, generator=g) / C ** 0.5
    H = (torch.diag(d) + A @ A.T).cuda()
    W = (torch.randn(R, C, generator=g) * 0.02).cuda()
    res = kmeans_rows(W, 16, d.cuda())
    book, stored = project_centroids(res.codebook.cpu(), "f16")
    out = [gptq_refine(W, H, book, res.codes.cpu(), lambda c: project_centroids(c, "f16"), stored, sweep_impl=s)
           for s in ("torch", "triton")]
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert out[0][3] == out[1][3]
