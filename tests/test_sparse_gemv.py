"""The sparse-input codebook GEMV (kernels/sparse_gemv.py) against its float64 reference: 200 random shapes (the
awkward sizes included) and input sparsities 0-90%, both backends (Triton under the interpreter on the CPU),
deterministic, batch-invariant, and the codes of zero inputs provably not used."""
import random

import pytest
import torch

from trapetum.kernels.pack import pack_codes
from trapetum.kernels.sparse_gemv import (bytes_read, input_major_codes, sparse_gemv, sparse_gemv_reference)
from trapetum.kernels.triton_util import triton_ok

SIZES = [1, 3, 16, 53, 64, 97, 128, 257]
TRITON = triton_ok(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return float((a.double() - b).norm() / max(float(b.norm()), 1e-30))


def case(seed):
    """(x [M, K] fp16 with a fraction s of zeros, codes, codebook, bits, s)."""
    r = random.Random(seed)
    N, K = r.choice(SIZES + [r.randint(1, 300)]), r.choice(SIZES + [r.randint(1, 300)])
    M, bits, s = r.choice([1, 1, 2, 4]), r.choice([4, 8]), r.choice([0.0, 0.1, 0.25, 0.4, 0.5, 0.7, 0.9])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[torch.rand(M, K, generator=g) < s] = 0
    idx = torch.randint(0, 1 << bits, (N, K), generator=g)
    codes = pack_codes(idx, bits)
    codebook = torch.randn(N, 1 << bits, generator=g).to(torch.float16)
    return x.to(torch.float16), codes, codebook, bits, s


def check_case(seed, backend):
    x, codes, cb, bits, s = case(seed)
    N, K = cb.shape[0], x.shape[1]
    ct = input_major_codes(codes, bits, K)
    ref = sparse_gemv_reference(x, codes, cb, bits)
    y = sparse_gemv(x.to(DEV), ct.to(DEV), cb.to(DEV), bits, N, backend=backend).cpu()
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], N)
    assert rel(y, ref) < 2e-6, (seed, N, K, bits, s)
    y2 = sparse_gemv(x.to(DEV), ct.to(DEV), cb.to(DEV), bits, N, backend=backend).cpu()
    assert torch.equal(y, y2)  # deterministic
    for m in range(x.shape[0]):  # batch-invariant: row m alone gives its bits
        assert torch.equal(sparse_gemv(x[m:m + 1].to(DEV), ct.to(DEV), cb.to(DEV), bits, N, backend=backend).cpu()[0],
                           y[m])


@pytest.mark.parametrize("chunk", range(4))
def test_torch_backend_against_float64_over_200_shapes(chunk):
    for seed in range(chunk * 50, chunk * 50 + 50):
        check_case(seed, "torch")


@pytest.mark.skipif(not TRITON, reason="Triton cannot run here (no CUDA, no interpreter)")
def test_triton_interpreter_against_float64_first_shapes():
    for seed in range(8):
        check_case(seed, "triton")


@pytest.mark.slow  # ~35 s per chunk under the interpreter
@pytest.mark.skipif(not TRITON, reason="Triton cannot run here (no CUDA, no interpreter)")
@pytest.mark.parametrize("chunk", range(4))
def test_triton_interpreter_against_float64_over_200_shapes(chunk):
    for seed in range(chunk * 50, chunk * 50 + 50):
        check_case(seed, "triton")


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if TRITON else []))
def test_codes_of_zero_inputs_are_not_used(backend):
    """Every zero input's codes point at a NaN centroid: a kernel that read and used them would return NaN."""
    g = torch.Generator().manual_seed(7)
    N, K, bits = 97, 257, 4
    x = torch.randn(2, K, generator=g)
    x[:, torch.rand(K, generator=g) < 0.6] = 0
    x[1, :5] = 0  # rows with different nonzeros
    idx = torch.randint(0, 15, (N, K), generator=g)
    dead = (x == 0).all(0)
    idx[:, dead] = 15
    cb = torch.randn(N, 16, generator=g)
    cb_ok = cb.clone()
    cb[:, 15] = float("nan")
    codes = pack_codes(idx, bits)
    y = sparse_gemv(x.half().to(DEV), input_major_codes(codes, bits, K).to(DEV), cb.half().to(DEV), bits, N,
                    backend=backend).cpu()
    assert torch.isfinite(y).all()
    ref = sparse_gemv_reference(x.half(), codes, cb_ok.half(), bits)
    assert rel(y, ref) < 2e-6


def test_layout_and_bad_arguments():
    idx = torch.arange(12).view(3, 4) % 16
    codes = pack_codes(idx, 4)
    ct = input_major_codes(codes, 4, 4)
    assert torch.equal(ct, pack_codes(idx.t().contiguous(), 4))
    with pytest.raises(ValueError, match="input-major codes"):
        sparse_gemv(torch.ones(1, 4), codes, torch.zeros(3, 16, dtype=torch.float16), 4, 3)
    with pytest.raises(ValueError, match="bits"):
        input_major_codes(codes, 2, 4)
    assert bytes_read(4096, 4096, 4, 0.5) == 0.5 * 4096 * 4096 / 2 + 4096 * 32 + 8192
