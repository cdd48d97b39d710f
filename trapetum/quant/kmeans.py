"""Weighted per-row scalar k-means: K centroids per output row, batched over rows (CPU or CUDA).

For a weight matrix W [R, C] and per-element importance w (E[x^2] of the input channel,
broadcast over rows, or any positive [R, C] tensor) each row r gets K centroids c[r, :]
minimizing

    sum_j w[r, j] * (W[r, j] - c[r, a[r, j]])^2        a[r, j] = nearest centroid of W[r, j]

which, when w = E[x_j^2], is the diagonal approximation of the expected output error
E || (W - W_q) x ||^2 of the projection.

Why it is cheap: the data is one-dimensional, so once a row is sorted every cluster is a
contiguous run of it. With prefix sums of w, w*x and w*x^2 over the sorted row, one Lloyd
iteration is a ``searchsorted`` of the K-1 midpoints between sorted centroids plus gathers,
O(K log C) per row instead of O(K C). Sorting is paid once, so we can afford many iterations
and several starts:

* ``cuberoot`` start (default): centroids at the quantiles of (w p)^(1/3), the MSE-optimal
  centroid density of high-resolution quantization theory, p estimated by a 64-bin histogram;
* ``grid`` start: evenly spaced from the row's min to max (the seed's start);
* ``quantile`` start: at the weighted quantiles (k + 1/2) / K (too dense in the middle);
the best of the starts is kept per row (``restarts``).

Empty clusters are re-seeded at the element with the largest weighted error (the split that
helps most), rows with at most K distinct values are solved exactly (every value its own
centroid), and zero weights are damped (``w + eps * mean(w)``) so every cluster mean exists.
Centroids are kept sorted ascending; codes are recomputed against the fp16-rounded centroids
so they are the nearest fp16 centroid, as the runtime will see them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["KMeansResult", "kmeans_rows", "assign_sorted", "weighted_error", "row_objective"]


@dataclass
class KMeansResult:
    codebook: torch.Tensor  # [R, K] float16, ascending per row
    codes: torch.Tensor  # [R, C] uint8 (K <= 256), index into the row's codebook
    objective: torch.Tensor  # [R] float64 weighted SSE against the fp16 codebook
    history: list[float] | None = None  # total objective per Lloyd iteration of the first start, if tracked


def assign_sorted(W: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Nearest centroid of each element, for codebooks sorted ascending per row. [R, C] int64."""
    cb = codebook.to(W.dtype)
    mid = (cb[:, :-1] + cb[:, 1:]) * 0.5  # [R, K-1]
    return torch.searchsorted(mid.contiguous(), W.contiguous(), right=False)


def row_objective(W: torch.Tensor, codebook: torch.Tensor, codes: torch.Tensor,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted squared error per row, in float64. weights: None, [C] or [R, C]."""
    deq = torch.gather(codebook.double(), 1, codes.long())
    err = (W.double() - deq) ** 2
    if weights is not None:
        err = err * _expand_weights(weights, W).double()
    return err.sum(1)


def weighted_error(W: torch.Tensor, Wq: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """Relative weighted error ||(W - Wq) sqrt(w)|| / ||W sqrt(w)|| of a whole matrix."""
    W, Wq = W.double(), Wq.double()
    w = _expand_weights(weights, W).double() if weights is not None else torch.ones_like(W)
    num = ((W - Wq) ** 2 * w).sum()
    den = (W ** 2 * w).sum().clamp_min(1e-300)
    return math.sqrt(float(num / den))


def _expand_weights(weights: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    if weights.dim() == 1:
        if weights.shape[0] != W.shape[1]:
            raise ValueError(f"weights have {weights.shape[0]} entries for {W.shape[1]} columns")
        return weights.to(W.device).unsqueeze(0).expand_as(W)
    if weights.shape != W.shape:
        raise ValueError(f"weights shape {tuple(weights.shape)} != weight shape {tuple(W.shape)}")
    return weights.to(W.device)


def kmeans_rows(W: torch.Tensor, K: int, weights: torch.Tensor | None = None, *, iters: int = 60,
                starts: tuple[str, ...] = ("cuberoot", "grid"), eps: float = 1e-6,
                device: str | torch.device | None = None, chunk_elems: int | None = None,
                track_history: bool = False) -> KMeansResult:
    """Weighted scalar k-means of every row of ``W`` [R, C] with ``K`` centroids per row.

    weights: None (unweighted), [C] (per input channel, e.g. E[x^2]) or [R, C]; must be >= 0.
    iters: Lloyd iterations per start (stops early once no centroid moves).
    starts: initializations tried per row; the lowest objective wins.
    device: where to compute (default: W's device); rows are processed in chunks of about
    ``chunk_elems`` elements so memory stays bounded for large matrices.
    Returns fp16 codebooks [R, K] (ascending), uint8 codes [R, C] and the per-row objective.
    """
    if W.dim() != 2:
        raise ValueError(f"kmeans_rows needs a 2-D matrix, got shape {tuple(W.shape)}")
    if not 2 <= K <= 256:
        raise ValueError(f"K must be in [2, 256], got {K}")
    R, C = W.shape
    dev = torch.device(device) if device is not None else W.device
    if weights is not None and (weights < 0).any():
        raise ValueError("k-means weights must be non-negative")
    if chunk_elems is None:  # ~100 bytes of work space per element: 0.4 GB on CPU, 3 GB on a GPU
        chunk_elems = 1 << (25 if dev.type == "cuda" else 22)
    rows_per_chunk = max(1, chunk_elems // max(C, 1))
    books, codes, objs = [], [], []
    history: list[float] | None = [0.0] * (iters + 1) if track_history else None
    for r0 in range(0, R, rows_per_chunk):
        r1 = min(R, r0 + rows_per_chunk)
        Wc = W[r0:r1].to(dev, torch.float32)
        wc = None
        if weights is not None:
            wc = weights.to(dev, torch.float32) if weights.dim() == 1 else weights[r0:r1].to(dev, torch.float32)
        cb, hist = _kmeans_chunk(Wc, K, wc, iters, starts, eps, track_history)
        cb16 = cb.to(torch.float16)
        a = assign_sorted(Wc, cb16)
        books.append(cb16.cpu())
        codes.append(a.to(torch.uint8).cpu())
        objs.append(row_objective(Wc, cb16, a, wc).cpu())
        if history is not None:
            for i, v in enumerate(hist):
                history[i] += v
    return KMeansResult(torch.cat(books), torch.cat(codes), torch.cat(objs), history)


def _kmeans_chunk(W: torch.Tensor, K: int, w: torch.Tensor | None, iters: int, starts: tuple[str, ...],
                  eps: float, track: bool) -> tuple[torch.Tensor, list[float]]:
    """Best-of-starts Lloyd on one chunk of rows. Returns float32 centroids [R, K] (sorted)."""
    R, C = W.shape
    xs, perm = W.sort(dim=1)  # [R, C]
    if w is None:
        ws = torch.ones_like(xs, dtype=torch.float64)
    else:
        wfull = w.unsqueeze(0).expand(R, C) if w.dim() == 1 else w
        ws = torch.gather(wfull, 1, perm).double()
    mean_w = ws.mean(1, keepdim=True).clamp_min(1e-30)
    ws = ws + eps * mean_w  # every element has positive weight: cluster means always exist
    xd = xs.double()
    zero = torch.zeros(R, 1, dtype=torch.float64, device=W.device)
    P0 = torch.cat([zero, ws.cumsum(1)], 1)  # [R, C+1] prefix sums over the sorted row
    P1 = torch.cat([zero, (ws * xd).cumsum(1)], 1)
    P2 = torch.cat([zero, (ws * xd * xd).cumsum(1)], 1)
    pre = (xs, xd, ws, P0, P1, P2)

    # Rows with <= K distinct values: every distinct value is a centroid (exact, objective 0).
    new_val = torch.ones_like(xs, dtype=torch.bool)
    new_val[:, 1:] = xs[:, 1:] != xs[:, :-1]
    n_distinct = new_val.sum(1)
    exact_rows = n_distinct <= K

    best_c = torch.zeros(R, K, dtype=torch.float64, device=W.device)
    first_hist: list[float] = []
    todo = (~exact_rows).nonzero().squeeze(1)  # rows that need Lloyd at all
    if todo.numel():
        sub = tuple(t[todo] for t in pre)
        best_obj = None
        for start in starts:
            c = _init(start, sub[0], sub[3], K)
            c, obj, hist = _lloyd(c, sub, iters, track)
            if best_obj is None:
                best_sub, best_obj, first_hist = c, obj, hist
            else:
                better = obj < best_obj
                best_sub = torch.where(better.unsqueeze(1), c, best_sub)
                best_obj = torch.minimum(obj, best_obj)
        best_c[todo] = best_sub
    elif track:
        first_hist = [0.0] * (iters + 1)
    if exact_rows.any():
        rows = exact_rows.nonzero().squeeze(1)
        xe, ne = xs[rows], new_val[rows]
        rank = ne.long().cumsum(1) - 1  # [r, C]: index of the element's distinct value
        ce = xe[:, -1:].expand(-1, K).clone()  # pad with the row max (duplicate, never nearest-first)
        ce.scatter_(1, rank, xe)
        best_c[rows] = ce.to(best_c.dtype)
    return best_c.float(), first_hist


def _init(start: str, xs: torch.Tensor, P0: torch.Tensor, K: int) -> torch.Tensor:
    R, C = xs.shape
    if start == "grid":
        lo, hi = xs[:, :1].double(), xs[:, -1:].double()
        t = torch.linspace(0, 1, K, dtype=torch.float64, device=xs.device).unsqueeze(0)
        return lo + (hi - lo) * t
    if start == "quantile":
        total = P0[:, -1:]
        q = (torch.arange(K, dtype=torch.float64, device=xs.device) + 0.5).unsqueeze(0) / K * total
        idx = torch.searchsorted(P0[:, 1:].contiguous(), q.contiguous()).clamp_(max=C - 1)
        return torch.gather(xs, 1, idx).double()
    if start == "cuberoot":
        # High-resolution quantization theory: the MSE-optimal centroid density is proportional
        # to (w p)^(1/3). Estimate the weighted mass on a histogram of the row, take its cube
        # root, and place centroids at the (k + 1/2) / K quantiles of that density.
        B = 64
        lo, hi = xs[:, :1].double(), xs[:, -1:].double()
        span = (hi - lo).clamp_min(1e-30)
        b = ((xs.double() - lo) / span * B).long().clamp_(0, B - 1)
        mass = torch.diff(P0, dim=1)  # per-element weight, [R, C]
        h = torch.zeros(R, B, dtype=torch.float64, device=xs.device).scatter_add_(1, b, mass)
        dens = h.pow(1.0 / 3.0)
        cdf = torch.cat([torch.zeros(R, 1, dtype=torch.float64, device=xs.device), dens.cumsum(1)], 1)
        q = (torch.arange(K, dtype=torch.float64, device=xs.device) + 0.5).unsqueeze(0) / K * cdf[:, -1:]
        j = torch.searchsorted(cdf[:, 1:].contiguous(), q.contiguous()).clamp_(max=B - 1)  # bin of q
        c0, c1 = torch.gather(cdf, 1, j), torch.gather(cdf, 1, j + 1)
        frac = ((q - c0) / (c1 - c0).clamp_min(1e-300)).clamp(0, 1)
        return lo + (j.double() + frac) / B * span
    raise ValueError(f"unknown k-means start {start!r} (known: quantile, grid, cuberoot)")


def _segment_sums(c: torch.Tensor, xd: torch.Tensor, P0: torch.Tensor, P1: torch.Tensor, P2: torch.Tensor):
    """Sums (S0, S1, S2) [R, K] of w, w x, w x^2 over each centroid's run of the sorted row (nearest
    assignment): centroid k's run is [b_k, b_{k+1}) with b_0 = 0, b_K = C and b_k (0 < k < K) the first
    element >= the midpoint of centroids k-1 and k; each sum is P[b_{k+1}] - P[b_k] of its prefix sum P."""
    R, C = xd.shape
    mid = (c[:, :-1] + c[:, 1:]) * 0.5
    idx = torch.searchsorted(xd, mid.contiguous(), right=False)  # first element >= midpoint
    b = torch.cat([idx.new_zeros(R, 1), idx, idx.new_full((R, 1), C)], 1)  # [R, K + 1]
    out = []
    for P in (P0, P1, P2):
        G = torch.gather(P, 1, b)
        out.append(G[:, 1:] - G[:, :-1])
    return tuple(out)


def _objective(c: torch.Tensor, xd: torch.Tensor, P0: torch.Tensor, P1: torch.Tensor, P2: torch.Tensor):
    """Per-row weighted SSE [R] of sorted centroids c [R, K], and the segment sums (S0, S1, S2) behind it."""
    S0, S1, S2 = _segment_sums(c, xd, P0, P1, P2)
    return (S2 - 2 * c * S1 + c * c * S0).clamp_min(0).sum(1), (S0, S1, S2)


def _lloyd(c: torch.Tensor, pre, iters: int, track: bool) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Lloyd iterations in the sorted domain. c: [R, K] float64 (any order). Returns sorted c,
    the per-row objective of the returned centroids and (if track) the total per iteration.

    Every step is row-independent, and a row whose centroids did not move is a fixed point of the
    step (the next one computes the same centroids from the same inputs), so a row is dropped from
    the work once it stops moving; the set of rows still iterated is re-gathered whenever it has
    shrunk to half (rows kept in between are fixed points: recomputing them changes nothing).
    The result is bit for bit the one of iterating every row until no row moves (or ``iters``):
    tests/test_kmeans_speed.py compares the two."""
    xs, xd, ws, P0, P1, P2 = pre
    c = c.sort(1).values
    hist: list[float] = []
    obj, seg = _objective(c, xd, P0, P1, P2)
    if track:
        hist.append(float(obj.sum()))
    rows = None  # chunk rows of the working set (None: all of them, in order)
    cw, xw, ww, Pw = c, xd, ws, (P0, P1, P2)  # the working set's centroids, rows, weights, prefix sums
    for _ in range(iters):
        S0, S1, S2 = seg
        empty = S0 <= 0
        new_c = torch.where(empty, cw, S1 / S0.clamp_min(1e-300))
        if empty.any():
            new_c = _reseed_empty(new_c, empty, xw, ww)
        new_c = new_c.sort(1).values
        moved = (new_c != cw).any(1)
        cw = new_c
        objw, seg = _objective(cw, xw, *Pw)
        if rows is None:
            c, obj = cw, objw
        else:
            c[rows], obj[rows] = cw, objw
        if track:
            hist.append(float(obj.sum()))
        n_moved = int(moved.sum())
        if not n_moved:
            break
        if 2 * n_moved <= moved.numel():  # compact the working set to the rows still moving
            keep = moved.nonzero().squeeze(1)
            rows = keep if rows is None else rows[keep]
            cw, xw, ww = cw[keep], xw[keep], ww[keep]
            Pw = tuple(P[keep] for P in Pw)
            seg = tuple(t[keep] for t in seg)
    if track:
        hist += [hist[-1]] * (iters + 1 - len(hist))
    return c, obj, hist


def _reseed_empty(c: torch.Tensor, empty: torch.Tensor, xd: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """Move the empty centroids of each row to the row's elements of largest weighted error
    (the m-th empty slot goes to the m-th worst element). Elements already exactly represented
    have zero error and are never chosen, so rows with nothing left to fix keep their slots."""
    c = c.clone()
    rows = empty.any(1).nonzero().squeeze(1)
    cr, er, xr, wr = c[rows], empty[rows], xd[rows], ws[rows]
    live = cr.masked_fill(er, float("inf"))  # empty slots never nearest
    live_sorted = live.sort(1).values
    n_live = (~er).sum(1, keepdim=True)
    # nearest live centroid: the neighbours of the insertion point among the sorted live ones
    pos = torch.searchsorted(live_sorted.contiguous(), xr.contiguous())
    lo = torch.gather(live_sorted, 1, (pos - 1).clamp(min=0))
    hi = torch.gather(live_sorted, 1, torch.minimum(pos, n_live - 1).clamp(min=0))
    d = torch.minimum((xr - lo).abs(), (xr - hi).abs())
    err = wr * d * d  # [r, C]
    order = err.argsort(1, descending=True)
    slot_rank = er.long().cumsum(1) - 1  # m-th empty slot of the row
    pick = torch.gather(order, 1, slot_rank.clamp(min=0, max=xr.shape[1] - 1))  # [r, K]
    target = torch.gather(xr, 1, pick)
    target_err = torch.gather(err, 1, pick)
    use = er & (target_err > 0)
    cr = torch.where(use, target, cr)
    c[rows] = cr
    return c


def codebook_linear(W: torch.Tensor, bits: int = 4, importance: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, **kmeans_kwargs):
    """The per-row codebook projection (schemes/codebook.py) of a dense weight [out, in], from weighted k-means."""
    from ..kernels.pack import pack_codes
    from ..schemes.codebook import CodebookLinear

    res = kmeans_rows(W, 1 << bits, importance, **kmeans_kwargs)
    return CodebookLinear(pack_codes(res.codes, bits), res.codebook, W.shape[1], bits,
                          None if bias is None else bias.detach().to(torch.float16))
