"""Fitting the compact codebook storages of ``schemes/codebook_store.py`` ("u8", "shared").

Both return the *decoded* fp16 codebook [R, K] (ascending per row) with the stored tensors, and the quantizer
assigns every weight to its nearest decoded centroid, so the codes are those a loader's decode gives.

* ``to_u8``: the k-means centroids of each row rounded onto 256 levels between the row's smallest and largest
  centroid (lo and step in fp16; the step rounded up so lo + 255 step covers the largest). The rounding moves a
  centroid by at most step / 2 = range / 510, against a spacing of about range / K.
* ``fit_shared``: rows r of group g = r // G share one table T_g of K values, scaled per row:
  c[r, k] = s_r T_g[k]. Start: s_r = the row's E[x^2]-weighted RMS, T_g = weighted k-means of the group's
  normalized weights W[r, :] / s_r pooled; then ``rounds`` alternations of (nearest assignment; s_r by weighted
  least squares given the codes; T_g[k] by weighted least squares given the codes and scales), each in float64,
  the tables sorted again, the best round by the weighted objective kept. Groups are independent, so the work is
  done a few groups at a time (bounded memory for a 150k-row vocabulary).
"""
from __future__ import annotations

import math

import torch

from ..schemes.codebook_store import decode_shared, decode_u8
from .kmeans import assign_sorted, kmeans_rows

__all__ = ["to_u8", "fit_shared", "fit_rows", "stored_specs", "project_centroids"]

_FP16_TINY = 2.0 ** -14  # smallest normal fp16: row scales stay at or above it


def to_u8(book: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [R, K], (lo, step) fp16 [R, 2], decoded fp16 [R, K]) for ascending centroids ``book`` [R, K]."""
    b = book.float()
    lo16 = b[:, 0].to(torch.float16)
    span = (b[:, -1] - lo16.float()).clamp_min(0)
    step16 = (span / 255).to(torch.float16)
    short = step16.float() * 255 < span  # fp16 rounding fell short of the top: one ulp up
    step16 = torch.where(short, torch.nextafter(step16, torch.full_like(step16, math.inf)), step16)
    st = step16.float()
    q = torch.where(st.unsqueeze(1) > 0, (b - lo16.float().unsqueeze(1)) / st.clamp_min(1e-30).unsqueeze(1),
                    torch.zeros_like(b))
    q = q.round().clamp_(0, 255).to(torch.uint8)
    rng = torch.stack([lo16, step16], 1)
    return q, rng, decode_u8(q, rng)


def _objective(W: torch.Tensor, book: torch.Tensor, codes: torch.Tensor, w: torch.Tensor) -> float:
    d = W.double() - torch.gather(book.double(), 1, codes)
    return float((d * d * w).sum())


def _fit_groups(W: torch.Tensor, K: int, w: torch.Tensor, G: int, iters: int, starts, rounds: int):
    """One chunk: W [n * G' , C] float32 (G' = G, or fewer rows for a last, short group), w [C] float64 > 0, both on
    the device of the work."""
    R, C = W.shape
    dev = W.device
    n = -(-R // G)
    Wd = W.double()
    s = ((Wd * Wd * w).sum(1) / w.sum()).sqrt().clamp_min(_FP16_TINY)  # [R]
    s16 = s.to(torch.float16)
    Z = (Wd / s16.double().unsqueeze(1)).float()
    tables = []
    for g0 in range(n):  # rows of one group pooled into one k-means row
        z = Z[g0 * G:(g0 + 1) * G].reshape(1, -1)
        wg = w.float().repeat(z.shape[1] // C)
        tables.append(kmeans_rows(z, K, wg, iters=iters, starts=starts).codebook.to(dev))
    T16 = torch.cat(tables)  # [n, K] fp16 ascending
    grp = torch.arange(R, device=dev) // G
    best = None
    for t in range(rounds + 1):
        book = decode_shared(T16, s16, G)
        codes = assign_sorted(W, book)
        obj = _objective(W, book, codes, w)
        if best is None or obj < best[0]:
            best = (obj, T16, s16, book, codes)
        if t == rounds:
            break
        c = torch.gather(T16.double()[grp], 1, codes)  # [R, C]: the table value of each weight
        den = (c * c * w).sum(1)
        s_new = torch.where(den > 0, (Wd * c * w).sum(1) / den.clamp_min(1e-300), s16.double())
        s16 = s_new.clamp_min(_FP16_TINY).to(torch.float16)
        sd = s16.double().unsqueeze(1)
        idx = (grp.unsqueeze(1) * K + codes).reshape(-1)
        num = torch.zeros(n * K, dtype=torch.float64, device=dev).index_add_(0, idx, (sd * Wd * w).reshape(-1))
        dd = torch.zeros(n * K, dtype=torch.float64, device=dev).index_add_(0, idx,
                                                                            (sd * sd * w).expand(R, C).reshape(-1))
        T = torch.where(dd > 0, num / dd.clamp_min(1e-300), T16.double().reshape(-1)).view(n, K)
        T16 = T.sort(1).values.to(torch.float16)
    return best


def fit_shared(W: torch.Tensor, K: int, imp: torch.Tensor | None, group_rows: int, *, iters: int = 60,
               starts: tuple[str, ...] = ("cuberoot", "grid"), rounds: int = 3, chunk_elems: int | None = None,
               device: str | torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared, row-scaled codebooks for W [R, C], computed on ``device`` (default: W's): (table fp16
    [ceil(R / G), K], row_scale fp16 [R], decoded codebook fp16 [R, K], codes uint8 [R, C]), all on the CPU.
    ``imp``: E[x^2] [C] (None: uniform)."""
    R, C = W.shape
    G = int(group_rows)
    dev = torch.device(device) if device is not None else W.device
    if chunk_elems is None:  # as kmeans_rows: ~100 bytes of work per element
        chunk_elems = 1 << (25 if dev.type == "cuda" else 22)
    w = (torch.ones(C, dtype=torch.float64) if imp is None else imp.double()).to(dev)
    w = w + 1e-6 * w.mean().clamp_min(1e-30)  # as kmeans_rows damps zero weights
    step = G * max(1, chunk_elems // max(1, G * C))  # whole groups per chunk
    tables, scales, books, codes = [], [], [], []
    for r0 in range(0, R, step):
        _, T16, s16, book, a = _fit_groups(W[r0:r0 + step].to(dev, torch.float32), K, w, G, iters, starts, rounds)
        tables.append(T16.cpu())
        scales.append(s16.cpu())
        books.append(book.cpu())
        codes.append(a.to(torch.uint8).cpu())
    return torch.cat(tables), torch.cat(scales), torch.cat(books), torch.cat(codes)


def stored_specs(out: int, bits: int, storage: str, group_rows: int | None) -> tuple[dict, dict]:
    """(params, {role: (dtype name, shape)}) of the codebook part of a record ``fit_rows`` makes."""
    K = 1 << bits
    if storage == "u8":
        return {"bits": bits, "codebook": "u8"}, {"codebook_u8": ("U8", (out, K)), "codebook_range": ("F16", (out, 2))}
    if storage == "shared":
        G = int(group_rows)
        return ({"bits": bits, "codebook": "shared", "group_rows": G},
                {"codebook_shared": ("F16", (-(-out // G), K)), "row_scale": ("F16", (out,))})
    return {"bits": bits}, {"codebook": ("F16", (out, K))}


def fit_rows(W: torch.Tensor, bits: int, imp: torch.Tensor | None, *, storage: str = "f16",
             group_rows: int | None = None, iters: int = 60, starts: tuple[str, ...] = ("cuberoot", "grid"),
             device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """Per-row codebooks of W [R, C] in ``storage``: (decoded fp16 codebook [R, K], codes uint8 [R, C] (nearest
    decoded centroid), stored codebook tensors {role: tensor}, record params). "f16" and "u8" start from the
    weighted k-means (``kmeans_rows``), "shared" is ``fit_shared`` (weights [C] only)."""
    K = 1 << bits
    params, _ = stored_specs(W.shape[0], bits, storage, group_rows)
    if storage == "shared":
        if imp is not None and imp.dim() != 1:
            raise ValueError("shared codebooks take per-channel weights [C] only")
        T16, s16, book, codes = fit_shared(W, K, imp, int(group_rows), iters=iters, starts=starts, device=device)
        return book, codes, {"codebook_shared": T16, "row_scale": s16}, params
    res = kmeans_rows(W, K, imp, iters=iters, starts=starts, device=device)
    if storage == "f16":
        return res.codebook, res.codes, {"codebook": res.codebook}, params
    q, rng, book = to_u8(res.codebook)
    codes = torch.empty_like(res.codes)
    step = max(1, (1 << 21) // max(1, W.shape[1]))
    dev = torch.device(device) if device is not None else W.device
    for r0 in range(0, W.shape[0], step):  # the nearest decoded centroid (the k-means codes were for fp16 ones)
        a = assign_sorted(W[r0:r0 + step].to(dev, torch.float32), book[r0:r0 + step].to(dev))
        codes[r0:r0 + step] = a.to(torch.uint8).cpu()
    return book, codes, {"codebook_u8": q, "codebook_range": rng}, params


def project_centroids(c: torch.Tensor, storage: str) -> tuple[torch.Tensor, dict]:
    """Ascending centroids c [R, K] (any float) onto the grid of ``storage`` ("f16" or "u8"): (decoded fp16
    [R, K], ascending, the stored tensors)."""
    if storage == "u8":
        q, rng, book = to_u8(c.float())
        return book, {"codebook_u8": q, "codebook_range": rng}
    if storage == "f16":
        book = c.to(torch.float16)
        return book, {"codebook": book}
    raise ValueError(f"no centroid projection for the {storage!r} storage")
