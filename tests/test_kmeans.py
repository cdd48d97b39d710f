"""Weighted per-row scalar k-means against float64 brute force; packing round trips."""
from __future__ import annotations

import itertools

import pytest
import torch

from trapetum.quant.kmeans import kmeans_rows, row_objective
from trapetum.kernels.pack import pack_codes, packed_width, unpack_codes


def _brute_force_opt(x: torch.Tensor, w: torch.Tensor, K: int) -> float:
    """Optimal 1-D weighted k-means objective by trying every split of the sorted values."""
    order = x.argsort()
    x, w = x[order].double(), w[order].double()
    n = x.numel()
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), K - 1):
        b = (0, *cuts, n)
        tot = 0.0
        for s, e in zip(b[:-1], b[1:]):
            xs, ws = x[s:e], w[s:e]
            c = (ws * xs).sum() / ws.sum()
            tot += float((ws * (xs - c) ** 2).sum())
        best = min(best, tot)
    return best


def test_objective_reported_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(17, 53, generator=g)
    w = torch.rand(53, generator=g) ** 3
    r = kmeans_rows(W, 16, w)
    ref = row_objective(W, r.codebook, r.codes, w)
    assert torch.allclose(r.objective, ref, rtol=1e-9, atol=1e-12)
    # codes are the nearest fp16 centroid of every element (brute force over K)
    d = (W.double().unsqueeze(2) - r.codebook.double().unsqueeze(1)).abs()
    assert torch.equal(d.min(2).values, d.gather(2, r.codes.long().unsqueeze(2)).squeeze(2))
    assert (r.codebook[:, 1:] >= r.codebook[:, :-1]).all()  # ascending


def test_near_optimal_on_small_rows():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(6, 10, generator=g)
    w = torch.rand(6, 10, generator=g) + 0.05
    r = kmeans_rows(W, 3, w, iters=100, eps=0.0)
    for i in range(6):
        opt = _brute_force_opt(W[i], w[i], 3)
        got = float(row_objective(W[i:i + 1], r.codebook[i:i + 1].float().double().half(), r.codes[i:i + 1], w[i:i + 1]))
        assert got <= opt * 1.05 + 1e-4, (i, got, opt)


def test_weighted_objective_monotone_and_weighting_helps():
    g = torch.Generator().manual_seed(2)
    W = torch.randn(64, 200, generator=g)
    w = torch.rand(200, generator=g) ** 4
    r = kmeans_rows(W, 16, w, iters=30, starts=("quantile",), track_history=True)
    h = r.history
    assert all(b <= a * (1 + 1e-12) for a, b in zip(h, h[1:])), h
    assert h[-1] < h[0]
    plain, weighted = kmeans_rows(W, 16, None), kmeans_rows(W, 16, w)
    assert (row_objective(W, weighted.codebook, weighted.codes, w).sum()
            < 0.9 * row_objective(W, plain.codebook, plain.codes, w).sum())


def test_exact_on_few_distinct_values_and_empty_clusters():
    g = torch.Generator().manual_seed(3)
    vals = torch.tensor([-1.5, -0.25, 0.0, 0.5, 2.0, 3.0, 7.0])  # exactly representable in fp16
    W = vals[torch.randint(0, 7, (5, 40), generator=g)]
    W[0] = 0.5  # constant row
    W[1, :] = vals[torch.arange(40) % 3]  # 3 values
    r = kmeans_rows(W, 16, torch.rand(40, generator=g))
    deq = torch.gather(r.codebook.float(), 1, r.codes.long())
    assert torch.equal(deq, W)
    assert float(r.objective.max()) == 0.0
    # 12 distinct values, K = 8, starting from a grid that leaves clusters empty: all are re-seeded
    W2 = torch.cat([torch.full((1, 20), -50.0), torch.linspace(0, 1, 11).repeat(1, 2)[:, :20]], 1)
    r2 = kmeans_rows(W2, 8, None, starts=("grid",), iters=50)
    used = r2.codes.unique().numel()
    assert used == 8, r2.codebook


def test_zero_weights_and_devices():
    W = torch.randn(8, 33)
    w = torch.zeros(33)
    w[:5] = 1.0
    r = kmeans_rows(W, 4, w)
    assert torch.isfinite(r.codebook.float()).all()
    if torch.cuda.is_available():
        rc = kmeans_rows(W, 4, w, device="cuda")
        assert torch.allclose(rc.codebook.float(), r.codebook.float(), atol=1e-3)


def test_chunked_equals_unchunked():
    W = torch.randn(50, 64)
    a = kmeans_rows(W, 16, torch.rand(64))
    b = kmeans_rows(W, 16, torch.rand(64) * 0 + a.objective.new_ones(64).float(), chunk_elems=64 * 7)
    c = kmeans_rows(W, 16, torch.ones(64), chunk_elems=1 << 30)
    assert torch.equal(b.codebook, c.codebook) and torch.equal(b.codes, c.codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("width", [1, 3, 7, 8, 53, 97, 257, 1025])
def test_pack_round_trip(bits, width):
    g = torch.Generator().manual_seed(bits * 1000 + width)
    codes = torch.randint(0, 1 << bits, (3, width), generator=g).to(torch.uint8)
    p = pack_codes(codes, bits)
    assert p.dtype == torch.uint8 and p.shape == (3, packed_width(width, bits))
    assert torch.equal(unpack_codes(p, bits, width), codes)


def test_pack_canonical_layouts():
    c = torch.tensor([[1, 2, 3]], dtype=torch.uint8)
    assert pack_codes(c, 4).tolist() == [[0x21, 0x03]]  # 2j low nibble, 2j+1 high nibble
    assert pack_codes(c, 2).tolist() == [[1 | 2 << 2 | 3 << 4]]
    c3 = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0, 5]], dtype=torch.uint8)
    word = sum(v << (3 * k) for k, v in enumerate([1, 2, 3, 4, 5, 6, 7, 0]))
    assert pack_codes(c3, 3).tolist() == [[word & 255, word >> 8 & 255, word >> 16, 5, 0, 0]]
    assert packed_width(9, 3) == 6 and packed_width(9, 4) == 5 and packed_width(9, 2) == 3
    with pytest.raises(ValueError):
        pack_codes(torch.tensor([[16]]), 4)
    with pytest.raises(ValueError):
        unpack_codes(torch.zeros(1, 2, dtype=torch.uint8), 4, 9)
