"""The faster Lloyd loop of quant/kmeans.py (converged rows dropped from the work, three prefix-sum gathers per
step) against the loop it replaced, kept here verbatim as the reference: bit for bit equal codebooks, codes,
objectives and histories over random shapes (awkward sizes, 4- and 8-bit, duplicated values, empty clusters)."""
from __future__ import annotations

import pytest
import torch

from trapetum.quant import kmeans as km


# --- the reference: the Lloyd loop before the change (every row iterated until no row moves) ---------------------
def _segments(c, xd):
    R, C = xd.shape
    mid = (c[:, :-1] + c[:, 1:]) * 0.5
    idx = torch.searchsorted(xd, mid.contiguous(), right=False)
    z = torch.zeros(R, 1, dtype=idx.dtype, device=idx.device)
    full = torch.full((R, 1), C, dtype=idx.dtype, device=idx.device)
    return torch.cat([z, idx], 1), torch.cat([idx, full], 1)


def _seg_sums(P, s, e):
    return torch.gather(P, 1, e) - torch.gather(P, 1, s)


def _lloyd_all_rows(c, pre, iters, track):
    xs, xd, ws, P0, P1, P2 = pre
    c = c.sort(1).values
    hist = []

    def objective(c):
        s, e = _segments(c, xd)
        S0, S1, S2 = _seg_sums(P0, s, e), _seg_sums(P1, s, e), _seg_sums(P2, s, e)
        return (S2 - 2 * c * S1 + c * c * S0).clamp_min(0).sum(1), (s, e, S0, S1, S2)

    obj, seg = objective(c)
    if track:
        hist.append(float(obj.sum()))
    for _ in range(iters):
        s, e, S0, S1, S2 = seg
        empty = S0 <= 0
        new_c = torch.where(empty, c, S1 / S0.clamp_min(1e-300))
        if empty.any():
            new_c = km._reseed_empty(new_c, empty, xd, ws)
        new_c = new_c.sort(1).values
        moved = (new_c != c).any()
        c = new_c
        obj, seg = objective(c)
        if track:
            hist.append(float(obj.sum()))
        if not moved:
            break
    if track:
        hist += [hist[-1]] * (iters + 1 - len(hist))
    return c, obj, hist


def _both(monkeypatch, W, K, w, **kw):
    fast = km.kmeans_rows(W, K, w, track_history=True, **kw)
    with monkeypatch.context() as m:
        m.setattr(km, "_lloyd", _lloyd_all_rows)
        ref = km.kmeans_rows(W, K, w, track_history=True, **kw)
    return fast, ref


def _assert_same(a, b):
    assert torch.equal(a.codebook, b.codebook)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.objective, b.objective)
    assert a.history == b.history


CASES = [(1, 1, 2), (1, 53, 16), (3, 97, 16), (53, 3, 4), (53, 257, 16), (257, 53, 4), (3, 257, 256),
         (9, 300, 256), (53, 97, 8)]


@pytest.mark.parametrize("R,C,K", CASES)
@pytest.mark.parametrize("kind", ["channel", "none", "full", "q4_1"])
def test_fast_lloyd_equals_the_all_rows_loop_bitwise(monkeypatch, R, C, K, kind):
    g = torch.Generator().manual_seed(R * 1000 + C + K)
    W = torch.randn(R, C, generator=g) * 0.02
    if kind == "q4_1":  # a dequantized 4-bit source: blocks of 32 with 16 levels each (duplicates everywhere)
        lv = torch.randint(0, 16, (R, C), generator=g).float()
        W = (lv - 8) * 0.003 + torch.randn(R, (C + 31) // 32, generator=g).repeat_interleave(32, 1)[:, :C] * 0.01
    w = {"channel": torch.rand(C, generator=g) ** 3, "none": None, "full": torch.rand(R, C, generator=g) + 0.01,
         "q4_1": torch.rand(C, generator=g) ** 4}[kind]
    fast, ref = _both(monkeypatch, W, K, w, iters=25)
    _assert_same(fast, ref)


@pytest.mark.parametrize("starts", [("grid",), ("quantile",), ("cuberoot", "grid")])
def test_fast_lloyd_with_empty_clusters_and_chunks(monkeypatch, starts):
    g = torch.Generator().manual_seed(7)
    W = torch.cat([torch.full((5, 20), -50.0), torch.linspace(0, 1, 11).repeat(5, 2)[:, :20]], 1)
    W = torch.cat([W, torch.randn(40, 40, generator=g)])
    fast, ref = _both(monkeypatch, W, 8, torch.rand(40, generator=g), starts=starts, iters=50, chunk_elems=40 * 7)
    _assert_same(fast, ref)


def test_fast_lloyd_is_deterministic():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(200, 257, generator=g)
    w = torch.rand(257, generator=g)
    a, b = km.kmeans_rows(W, 16, w), km.kmeans_rows(W, 16, w)
    _assert_same(a, b)
