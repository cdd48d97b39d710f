"""Error-compensated codebook quantization: GPTQ with per-row codebooks (``quantize --gptq``).

Objective, for a projection W [R, C] whose input x has the second moment H = E[x x^T] [C, C] (calibration,
``calibrate.collect_input_stats_layerwise(hessians=True)``): the expected output error

    E || (W - Q) x ||^2 = sum_r (W_r - Q_r) H (W_r - Q_r)^T,     Q[r, i] = c[r, a[r, i]]

(``hessian_objective``). E[x^2]-weighted k-means minimizes its diagonal part only. Here, from the k-means
codebooks c (the start), two steps alternate for ``rounds`` rounds:

* assignments (``gptq_assign``): the columns are quantized in order, each to the nearest centroid of its row,
  and its error is fed forward to the columns not yet quantized through the upper Cholesky factor U of
  (H + damp * mean(diag H) * I)^-1 (Frantar et al., GPTQ): err_i = (w_i - q_i) / U_ii, W[:, j] -= err_i U_ij for
  j > i; done in blocks of ``block`` columns with the lazy update of the remaining columns after each block.
  Every row is independent (H is shared), so rows are processed together;
* codebooks (``refit_codebooks``): with the assignments fixed the objective is quadratic in each row's K
  centroids: c_r = (A_r^T H A_r)^-1 A_r^T H W_r^T (A_r the [C, K] one-hot of row r's codes), solved in float64
  with a small ridge that keeps an unused centroid where it was; then ``project`` puts the centroids onto the
  storage's grid (fp16, or u8 on a per-row range: ``codebook_fit``) and sorts them (the codes follow).

Each row keeps the round (k-means start included) of lowest objective, so the result is never worse than the
start under H. Columns that calibration never excited (H_ii = 0) get H_ii = 1 (GPTQ's "dead" columns).
Cost: the assignment pass is C steps on [R] vectors (one Triton launch per block on CUDA: kernels/gptq_sweep.py)
plus one [R, block] x [block, C] product per block; the refit
is one [R, C] x [C, C] product per centroid-chunk (R C^2 K multiply-adds), done a few rows at a time.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..kernels.gptq_sweep import midpoints, sweep

__all__ = ["hessian_objective", "gptq_assign", "refit_codebooks", "gptq_refine", "prepare_hessian",
           "inverse_cholesky"]


def prepare_hessian(H: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """float64 copy of H with dead columns set to 1 on the diagonal and damp * mean(diag) added to it."""
    H = H.double().clone()
    d = torch.diagonal(H)
    d[d <= 0] = 1.0
    d += damp * float(d.mean())
    return H


def hessian_objective(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Per-row (W_r - Q_r) H (W_r - Q_r)^T, float64 [R]."""
    out = []
    Hd = H.double()
    for r0 in range(0, W.shape[0], chunk):
        E = W[r0:r0 + chunk].double() - Q[r0:r0 + chunk].double()
        out.append(((E @ Hd) * E).sum(1))
    return torch.cat(out)




def inverse_cholesky(H: torch.Tensor, damp: float = 0.01, device=None) -> torch.Tensor:
    """Upper Cholesky factor U [C, C] float64 of (H + damp * mean(diag H) * I)^-1 (``prepare_hessian``): U^T U is
    the damped inverse. One per Hessian: ``gptq_refine`` computes it once for all its rounds."""
    Hd = prepare_hessian(H, damp).to(device if device is not None else H.device)
    L = torch.linalg.cholesky(Hd)
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)


def gptq_assign(W: torch.Tensor, H: torch.Tensor, book: torch.Tensor, *, block: int = 128,
                damp: float = 0.01, U: torch.Tensor | None = None, sweep_impl: str = "auto") -> torch.Tensor:
    """Codes [R, C] (int64) of W [R, C] into ascending per-row codebooks ``book`` [R, K], columns in order with
    the error fed forward (see the module docstring). H [C, C] as collected (damped here), or ``U`` given
    (``inverse_cholesky(H, damp)``, on W's device; H and damp are then unused). Inside a block the columns go
    through ``kernels.gptq_sweep.sweep`` (``sweep_impl``: "auto" = one Triton kernel per block on CUDA, the
    per-column loop elsewhere; bit for bit the same codes); after it the later columns get the block's
    errors in one float64 product."""
    R, C = W.shape
    dev = W.device
    if U is None:
        U = inverse_cholesky(H, damp, dev)
    Wd = W.double().clone()
    cb = book.to(dev, torch.float64).contiguous()
    mid = midpoints(cb)  # nearest centroid: the number of midpoints below the weight
    codes = torch.empty(R, C, dtype=torch.long, device=dev)
    for i1 in range(0, C, block):
        i2 = min(C, i1 + block)
        a, E1 = sweep(Wd[:, i1:i2], U[i1:i2, i1:i2].contiguous(), cb, mid, sweep_impl)
        codes[:, i1:i2] = a
        if i2 < C:
            Wd[:, i2:] -= E1 @ U[i1:i2, i2:]
    return codes


def refit_codebooks(W: torch.Tensor, H: torch.Tensor, codes: torch.Tensor, book: torch.Tensor,
                    ridge: float = 1e-9, rows: int = 256) -> torch.Tensor:
    """Centroids [R, K] float64 minimizing sum_r (W_r - c_r[a_r]) H (W_r - c_r[a_r])^T for fixed codes [R, C];
    a centroid no weight of its row uses stays at ``book``'s value (the ridge pulls it there)."""
    R, C = W.shape
    K = book.shape[1]
    dev = W.device
    Hd = H.to(dev, torch.float64)
    out = torch.empty(R, K, dtype=torch.float64, device=dev)
    scale = float(torch.diagonal(Hd).mean()) * C / K
    eye = torch.eye(K, dtype=torch.float64, device=dev)
    book_d = book.to(dev, torch.float64)  # once: a pageable copy per chunk would wait for the GPU each time
    for r0 in range(0, R, rows):
        a = codes[r0:r0 + rows].to(dev, torch.long)
        n = a.shape[0]
        O = torch.zeros(n, C, K, dtype=torch.float64, device=dev).scatter_(2, a.unsqueeze(2), 1.0)  # one-hot
        HO = torch.einsum("ij,njk->nik", Hd, O)  # [n, C, K]
        M = torch.einsum("nik,nil->nkl", O, HO)  # A^T H A
        b = torch.einsum("ni,nik->nk", W[r0:r0 + rows].to(dev, torch.float64), HO)  # A^T H w
        lam = ridge * scale
        c0 = book_d[r0:r0 + rows]
        out[r0:r0 + rows] = torch.linalg.solve_ex(M + lam * eye, (b + lam * c0).unsqueeze(2))[0].squeeze(2)  # no sync
    return out


def gptq_refine(W: torch.Tensor, H: torch.Tensor, book: torch.Tensor, codes: torch.Tensor,
                project: Callable[[torch.Tensor], tuple[torch.Tensor, dict]], stored: dict, *, rounds: int = 2,
                block: int = 128, damp: float = 0.01, sweep_impl: str = "auto"
                ) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """From a k-means start (fp16 ascending ``book`` [R, K], ``codes`` [R, C], its ``stored`` tensors), the
    alternation of the module docstring. ``project(centroids float64 [R, K] ascending) -> (decoded fp16
    [R, K], stored tensors)`` is the storage's rounding. Returns (book, codes uint8, stored, info) with each row
    the best of its rounds (all on the CPU); info: {"objective_start", "objective"} (sums over rows, float).

    The codes stay on W's device from start to end (uint8, K <= 256): they cross to it once and back once; each
    round's choice of the better rows is one ``torch.where`` there. Only the [R, K] books, their stored tensors and
    the [R] row choice go through the host per round (``project`` runs on the CPU)."""
    R, C = W.shape
    dev = W.device
    Wf = W.float()

    def deq(b, a):
        return torch.gather(b.to(dev, torch.float64), 1, a.long())

    best_codes = codes.to(dev, torch.uint8)
    best_obj = hessian_objective(Wf, deq(book, best_codes), H)
    start = float(best_obj.sum())
    best_book = book.clone()
    best_stored = {k: v.clone() for k, v in stored.items()}
    cur = book
    U = inverse_cholesky(H, damp, dev)  # the same for every round
    for _ in range(rounds):
        a = gptq_assign(Wf, H, cur, block=block, U=U, sweep_impl=sweep_impl)
        c = refit_codebooks(Wf, H, a, cur)
        c, perm = c.sort(1)
        a = torch.argsort(perm, 1).gather(1, a)  # codes follow their centroids
        cur, st = project(c.cpu())
        obj = hessian_objective(Wf, deq(cur, a), H)
        better_d = obj < best_obj
        best_codes = torch.where(better_d.unsqueeze(1), a.to(torch.uint8), best_codes)
        best_obj = torch.minimum(best_obj, obj)
        better = better_d.cpu()
        best_book[better] = cur[better]
        for k, v in st.items():
            best_stored[k][better] = v[better]
    return best_book, best_codes.cpu(), best_stored, {"objective_start": start, "objective": float(best_obj.sum())}
