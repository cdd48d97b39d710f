"""The additive quantizer's beam step (kernels/beam_search.py): the Triton kernel and the torch path both
return the `top` best (score, index) of every vector, checked against float64 scores of all candidates;
the kernel is bitwise reproducible; the quantizer's beam search gives codes of the same error with
either. CPU: the Triton interpreter at small shapes; GPU: full size (n = 65536, 2x8, beam 4)."""
from __future__ import annotations

import pytest
import torch

from trapetum.kernels import beam_search as bs
from trapetum.quant.additive import _beam_search

IMPLS = {"torch": bs.candidates_torch, "triton": bs.candidates_triton}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernel in the Triton interpreter


def _case(n, B, M, K, d, seed, device=DEV, dup_codebook=False):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, d, generator=g)
    h = torch.rand(n, d, generator=g) + 0.05
    C = torch.randn(M, K, d, generator=g) * 0.6
    if dup_codebook:  # equal entries: exact ties between different candidates
        C[:, K // 2:] = C[:, :K - K // 2]
    cand = torch.randint(0, K, (n, B, M), generator=g)
    return [t.to(device) for t in (v, h, C, cand)]


def _check_contract(v, h, C, cand, top, s, i):
    """s ascending, indices distinct and in range, s equal to the float64 score of its index, and no
    candidate left out that is better than the worst kept (all up to fp32 rounding of the scores)."""
    ref = bs.candidates_reference(v, h, C, cand).cpu()
    s, i = s.cpu().double(), i.cpu()
    n, total = ref.shape
    assert s.shape == i.shape == (n, top)
    assert bool((i >= 0).all() and (i < total).all())
    assert all(len(set(row.tolist())) == top for row in i)
    scale = ref.abs().amax(1, keepdim=True) + 1e-6
    tol = 2e-5 * scale
    assert bool((s[:, 1:] >= s[:, :-1] - tol).all()), "not ascending"
    assert bool(((torch.gather(ref, 1, i) - s).abs() <= tol).all()), "score is not its index's score"
    kth = ref.sort(1).values[:, top - 1:top]
    assert bool(((s[:, -1:] - kth).abs() <= tol).all()), "a better candidate was left out"


CASES = [(n, B, M, K, d, top)
         for (n, B, M, K, d, top) in [
             (37, 1, 2, 16, 8, 5), (70, 4, 2, 32, 8, 9), (33, 2, 3, 16, 4, 7), (50, 4, 2, 256, 8, 9),
             (1, 1, 2, 16, 8, 1), (64, 3, 2, 64, 8, 7), (45, 4, 1, 32, 8, 9), (29, 2, 2, 16, 5, 33),
             (31, 1, 2, 16, 8, 33), (40, 4, 4, 16, 2, 9), (96, 2, 2, 128, 8, 5), (17, 4, 2, 16, 16, 3)]]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,B,M,K,d,top", CASES)
def test_top_candidates_against_float64(impl, n, B, M, K, d, top):
    v, h, C, cand = _case(n, B, M, K, d, seed=n * 31 + K + d)
    s, i = IMPLS[impl](v, h, C, cand, top)
    _check_contract(v, h, C, cand, top, s, i)


@pytest.mark.parametrize("seed", range(24))
def test_random_shapes_triton(seed):
    g = torch.Generator().manual_seed(1000 + seed)
    M = int(torch.randint(1, 4, (1,), generator=g))
    K = 1 << int(torch.randint(4, 7, (1,), generator=g))
    B = int(torch.randint(1, 5, (1,), generator=g))
    d = int(torch.randint(1, 17, (1,), generator=g))
    n = int(torch.randint(1, 80, (1,), generator=g))
    top = min(int(torch.randint(1, 12, (1,), generator=g)), B * (1 + M * K))
    v, h, C, cand = _case(n, B, M, K, d, seed, dup_codebook=seed % 3 == 0)
    s, i = bs.candidates_triton(v, h, C, cand, top)
    _check_contract(v, h, C, cand, top, s, i)


def test_ties_go_to_the_lower_index():
    """A codebook of repeated entries: equal scores come back lowest index first, and a child equal to
    its parent (same code) ranks after the parent."""
    v, h, C, cand = _case(20, 1, 2, 16, 8, seed=3, dup_codebook=True)
    s, i = bs.candidates_triton(v, h, C, cand, 9)
    _check_contract(v, h, C, cand, 9, s, i)
    for row_s, row_i in zip(s.cpu(), i.cpu()):
        for a in range(8):
            if row_s[a] == row_s[a + 1]:
                assert row_i[a] < row_i[a + 1]


def test_kernel_is_bitwise_reproducible():
    v, h, C, cand = _case(90, 4, 2, 64, 8, seed=5)
    a = bs.candidates_triton(v, h, C, cand, 9)
    b = bs.candidates_triton(v, h, C, cand, 9)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _error(v, h, C, idx):
    rec = sum(C[m][idx[:, m]] for m in range(C.shape[0]))
    return float(((v - rec) ** 2 * h).sum())


@pytest.mark.parametrize("K,M,beam", [(32, 2, 4), (16, 3, 2)])
def test_beam_search_same_error_either_way(K, M, beam):
    """The quantizer's search with the Triton step: the codes of the torch step (up to near-ties), the same
    total error, never worse than the start."""
    n = 300
    v, h, C, _ = _case(n, 1, M, K, 8, seed=K + M)
    idx = torch.randint(0, K, (n, M), generator=torch.Generator().manual_seed(1)).to(DEV)
    a = _beam_search(v, h, C, idx, beam, 2, 128, search="torch")
    b = _beam_search(v, h, C, idx, beam, 2, 128, search="triton")
    assert (a == b).all(1).float().mean() >= 0.97
    ea, eb = _error(v, h, C, a), _error(v, h, C, b)
    assert abs(ea - eb) <= 1e-3 * ea and eb <= _error(v, h, C, idx)


def test_bad_arguments_are_named():
    v, h, C, cand = _case(8, 2, 2, 16, 8, seed=0)
    with pytest.raises(ValueError, match="top"):
        bs.candidates_torch(v, h, C, cand, 0)
    with pytest.raises(ValueError, match="cand"):
        bs.candidates_triton(v, h, C, cand[:, :, :1], 3)
    with pytest.raises(ValueError, match="power-of-two"):
        bs.candidates_triton(v, h, C[:, :12], cand.clamp_max(11), 3)
    with pytest.raises(ValueError, match="search"):
        bs.resolve("fast", v.device, 16)
    assert bs.resolve("auto", torch.device("cpu"), 256) == "torch"
    assert bs.resolve("auto", torch.device("cuda"), 256) == ("triton" if bs.triton is not None else "torch")
    assert bs.resolve("auto", torch.device("cuda"), 12) == "torch"


@needs_gpu
@pytest.mark.parametrize("B", [1, 4])
def test_full_size_gpu(B):
    """The quantizer's real block: 65536 vectors, 2x8, beam 4 (top 9), against float64 on a sample and
    against the torch step on all rows."""
    n, M, K, d, top = 65536, 2, 256, 8, 2 * 4 + 1 if B == 4 else 9
    v, h, C, cand = _case(n, B, M, K, d, seed=B, device="cuda")
    s, i = bs.candidates_triton(v, h, C, cand, top)
    sel = torch.arange(0, n, 97, device="cuda")
    _check_contract(v[sel], h[sel], C, cand[sel], top, s[sel], i[sel])
    s0, _ = bs.candidates_torch(v, h, C, cand, top)
    assert torch.allclose(s, s0, rtol=2e-5, atol=2e-5)
    s2, i2 = bs.candidates_triton(v, h, C, cand, top)
    assert torch.equal(s, s2) and torch.equal(i, i2)
