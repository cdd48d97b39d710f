"""Error-compensated additive codebooks: GPTQ with vector codes (``quantize --scheme aqlm-2x8 --gptq``).

Objective, for a projection W [R, C] whose input x has the second moment H = E[x x^T] [C, C] (calibration,
``calibrate.collect_input_stats_layerwise(hessians=True)``), with Q the stored additive weight
(Q[r, 8g:8g+8] = s_r * sum_m C_m[c_{r,g,m}], the layout of ``additive.py``)::

    E || (W - Q) x ||^2 = sum_r (W_r - Q_r) H (W_r - Q_r)^T          (gptq.hessian_objective)

``quantize_additive`` minimizes only its diagonal part (H replaced by diag E[x_j^2]). Here, from that result
(k-means start, beam search and least-squares codebooks under the diagonal) as the start, ``rounds`` rounds of:

(a) codes, error-compensated (GPTQ's column sweep with groups of 8 columns as the unit). Let U [C, C] be the
    upper Cholesky factor of the damped inverse Hessian, U^T U = (H + damp * mean(diag H) I)^-1
    (``gptq.inverse_cholesky``). Derivation of the per-group metric: with V = U^-1 (upper triangular),
    H = V V^T, and for the trailing set F = {i, ..., C-1} of not yet quantized columns H_FF = V_FF V_FF^T
    (V is upper triangular, so (V V^T)_FF only sums over k >= i), V_FF = (U_FF)^-1, hence
    (H_FF)^-1 = U_FF^T U_FF. Quantizing the leading group S (8 columns) of F to q_S with every later column
    re-optimized (Optimal Brain Surgeon for a block, the later columns' best response to the error
    delta = w_S - q_S) raises the objective by

        delta ((H_FF)^-1_SS)^-1 delta^T,   (H_FF)^-1_SS = U_SS^T U_SS   (U_kS = 0 for k > S inside F)
        = || delta U_SS^-1 ||^2                                              (row vector delta)

    and moves the later columns by  w_{F\\S} -= delta (U_SS^T U_SS)^-1 U_SS^T U_{S,F\\S} = E U_{S,F\\S},
    E = delta U_SS^-1: GPTQ's update with err = delta / U_ii generalized from one column to a block (for a
    single column it is exactly GPTQ's). The objective of the whole sweep is the sum of these increments, so
    each group's codes are the beam search (``additive._beam_search``, the same expansion as the diagonal
    quantizer) of the fed-forward target w'_S / s_r against the metric A_S = U_SS^-1 U_SS^-T, an 8x8 full
    matrix (the diagonal quantizer's is diag(h_S)). The search needs a per-coordinate weight, so the metric is
    whitened away: ||(v - sum_m C_m[c_m]) U_SS^-1||^2 = ||v U_SS^-1 - sum_m (C_m U_SS^-1)[c_m]||^2, i.e. the
    target and every codebook entry are multiplied by U_SS^-1 (8x8, per group) and searched with unit weights
    (the row's scale s_r^2 multiplies the whole row's term, so it does not change a row's choice). The search
    starts from the incumbent codes of the group. Errors go forward lazily: inside a block of ``block``
    columns after each group, to the rest of the matrix after each block (as GPTQ). The per-row scales are then
    refit in closed form under H (s_r = W_r H Q_r^T / Q_r H Q_r^T, Q_r the unscaled sum of entries, rounded to
    fp16), and each row keeps the better of its incumbent (codes, scale) and the new pair under the true
    objective (the codebooks are shared by all rows and fixed in this step, so the rows are independent);
(a') codes by exact block coordinate descent (``descent_codes``, AQLM's own Hessian-aware beam search): the
    groups in order, each group's codes the beam search of the true objective with every other group fixed.
    With e = W_r - Q_r the row's error and q its group-S vector, replacing q by q' gives
    const + (q' - t) H_SS (q' - t)^T with t = q + (e H)_S H_SS^-1 (the gradient in q' vanishes there), so the
    metric is the 8x8 block H_SS of H itself (whitened by its Cholesky factor L: ||(q' - t) L||^2) and the target
    t / s_r; e H is kept current by a rank-8 update per group. Each search starts from the incumbent, so no
    row rises (up to the search's fp32 scores; the scales are then refit and each row again keeps the better
    pair). GPTQ's sweep (a) is the better move from the diagonal start (the errors of a whole row are
    re-balanced), the descent the better one near a solution (it optimizes the true, undamped objective with
    the later groups as they are, not as they would be re-optimized); measured on SmolLM2 (NOTES-additive.md)
    a round of both beats two rounds of either;
(b) codebooks under H with the codes and scales fixed: the objective is quadratic in the M*K*8 codebook
    values (4,096 for 2x8, 524,288 for 1x16) and couples every coordinate through H, so its normal equations
    are solved matrix-free by preconditioned conjugate gradients from the current codebooks (each iteration one
    [R, C] x [C, C] product; CG never raises the quadratic from its start), the preconditioner being the
    diagonal quantizer's normal matrix (H -> diag H: one [M*K, M*K] system per coordinate, exact when H is
    diagonal). Then the codebooks are rounded to fp16, the scales refit (closed form, fp16), and the new
    state is kept only if the total objective fell (the codebooks are shared, so this step is all rows or none).

Every state kept is one the file can store (fp16 codebooks and scales), and each step keeps a state only if it
is no worse (per row in (a), in total in (b)), so the result is never worse than the start under H. Columns
that calibration never excited (H_ii = 0) get H_ii = 1 in U (GPTQ's "dead" columns); the objective uses H as
collected. Cost per round: two beam searches over all R * C / 8 vectors (as two rounds of the diagonal
quantizer, in C / 8 calls of R vectors each), C / block [R, block] x [block, C] products, and about
``cg_iters`` + 8 [R, C] x [C, C] products.
"""
from __future__ import annotations

import torch

from .additive import _beam_search, cooccurrence
from .gptq import hessian_objective, inverse_cholesky

__all__ = ["additive_gptq_refine", "gptq_codes", "descent_codes", "refit_codebooks_hessian", "refit_scales_hessian"]


def _unscaled(idx: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """sum_m C[m, idx[r, g, m]] as [R, G * d] in C's dtype; idx [R, G, M], C [M, K, d]."""
    R, G, M = idx.shape
    K, d = C.shape[1], C.shape[2]
    flat = idx + torch.arange(M, device=idx.device) * K
    return C.reshape(M * K, d)[flat].sum(2).reshape(R, G * d)


def _row_objective(W: torch.Tensor, H: torch.Tensor, idx: torch.Tensor, C: torch.Tensor, s: torch.Tensor
                   ) -> torch.Tensor:
    """float64 [R]: (W_r - s_r Q_r) H (W_r - s_r Q_r)^T of the state (idx, C, s)."""
    Q = _unscaled(idx, C.double()) * s.double()[:, None]
    return hessian_objective(W, Q, H)


def refit_scales_hessian(W: torch.Tensor, H: torch.Tensor, idx: torch.Tensor, C: torch.Tensor, s: torch.Tensor
                         ) -> torch.Tensor:
    """Per-row scales minimizing the objective for fixed codes and codebooks, rounded to fp16 (returned as
    float32 [R]); a row whose entries sum to zero keeps ``s``."""
    Q = _unscaled(idx, C.double())
    QH = Q @ H.double()
    den = (Q * QH).sum(1)
    new = (W.double() * QH).sum(1) / den.clamp_min(1e-300)
    new = torch.where(den > 0, new, s.double())
    return new.to(torch.float16).float()


def _preconditioner(idx: torch.Tensor, hdiag: torch.Tensor, s: torch.Tensor, M: int, K: int, d: int):
    """Apply-function of the inverse of the diagonal quantizer's normal matrix: for coordinate j the [MK, MK]
    matrix sum_{r,g} s_r^2 H[8g+j, 8g+j] e_{c_rg} e_{c_rg}^T (e_c the sum of the M one-hots of the tuple)."""
    R, G, _ = idx.shape
    dev, dt = idx.device, torch.float64
    MK = M * K
    flat = (idx + torch.arange(M, device=dev) * K).reshape(R * G, M)
    w = (s.double()[:, None, None] ** 2 * hdiag.double().view(1, G, d)).reshape(R * G, d).t().contiguous()  # [d, N]
    if M == 1:
        D = torch.zeros(d, MK, dtype=dt, device=dev).index_add_(1, flat[:, 0], w)  # [d, K]
        fill = float(D[D > 0].mean()) if bool((D > 0).any()) else 1.0
        D = torch.where(D > 0, D, torch.full_like(D, fill)).t().contiguous()  # [K, d]
        return lambda r: r / D
    A = cooccurrence(flat, w, MK)
    diag = A.diagonal(dim1=1, dim2=2)
    fill = diag.mean(1, keepdim=True).clamp_min(1e-30)
    A = A + torch.diag_embed(torch.where(diag > 0, 1e-6 * fill, fill))  # unused entries: identity-like rows
    L, info = torch.linalg.cholesky_ex(A)
    if bool((info != 0).any()):
        return lambda r: r / A.diagonal(dim1=1, dim2=2).t()
    return lambda r: torch.cholesky_solve(r.t().unsqueeze(-1), L).squeeze(-1).t()  # r [MK, d]


def refit_codebooks_hessian(W: torch.Tensor, H: torch.Tensor, idx: torch.Tensor, C: torch.Tensor,
                            s: torch.Tensor, iters: int = 25) -> torch.Tensor:
    """Codebooks [M, K, d] float64 lowering sum_r (W_r - s_r Q_r(C)) H (W_r - s_r Q_r(C))^T for fixed codes
    idx [R, G, M] and scales s [R]: ``iters`` steps of preconditioned conjugate gradients on the normal
    equations, from C (module docstring, step (b)). Entries no code uses stay where they were."""
    R, G, M = idx.shape
    _, K, d = C.shape
    dev, dt = W.device, torch.float64
    MK = M * K
    Hd, Wd, sd = H.to(dev, dt), W.to(dev, dt), s.to(dev, dt)
    flat = idx + torch.arange(M, device=dev) * K  # [R, G, M]
    flat_cols = [flat[..., m].reshape(-1) for m in range(M)]

    def J(D):  # [MK, d] -> [R, G * d]
        return D[flat].sum(2).reshape(R, G * d) * sd[:, None]

    def Jt(Y):  # [R, G * d] -> [MK, d]
        Ys = (Y * sd[:, None]).reshape(R * G, d)
        out = torch.zeros(MK, d, dtype=dt, device=dev)
        for cols in flat_cols:
            out.index_add_(0, cols, Ys)
        return out

    def A(D):
        return Jt(J(D) @ Hd)

    pinv = _preconditioner(idx, torch.diagonal(Hd).clamp_min(0), sd, M, K, d)
    x = C.to(dev, dt).reshape(MK, d).clone()
    r = Jt((Wd - J(x)) @ Hd)  # b - A x
    z = pinv(r)
    p = z.clone()
    rz = float((r * z).sum())
    for _ in range(iters):
        if rz <= 0:
            break
        Ap = A(p)
        pAp = float((p * Ap).sum())
        if not pAp > 0:
            break
        alpha = rz / pAp
        x += alpha * p
        r -= alpha * Ap
        z = pinv(r)
        rz_new = float((r * z).sum())
        p = z + (rz_new / rz) * p
        rz = rz_new
    return x.reshape(M, K, d).contiguous()


def gptq_codes(W: torch.Tensor, U: torch.Tensor, C: torch.Tensor, s: torch.Tensor, idx: torch.Tensor, *,
               beam: int, beam_steps: int, block: int = 128, chunk: int = 8192, search: str = "auto"
               ) -> torch.Tensor:
    """Codes [R, G, M] of W [R, C] with the errors of earlier groups fed forward (module docstring, step (a)).

    U: ``gptq.inverse_cholesky(H, damp)`` [C, C] float64 on W's device; C [M, K, d] the codebooks (fp16
    values), s [R] the scales, idx [R, G, M] the incumbent codes (each group's search starts there)."""
    R, Cin = W.shape
    M, K, d = C.shape
    dev = W.device
    block = max(d, block - block % d)
    Wd = W.to(dev, torch.float64).clone()
    sd = s.to(dev, torch.float64)
    Cd = C.to(dev, torch.float64)
    ones = torch.ones(R, d, device=dev)
    out = idx.clone()
    eye = torch.eye(d, dtype=torch.float64, device=dev)
    for b1 in range(0, Cin, block):
        b2 = min(Cin, b1 + block)
        Eb = torch.empty(R, b2 - b1, dtype=torch.float64, device=dev)
        for c1 in range(b1, b2, d):
            c2, g = c1 + d, c1 // d
            Ui = torch.linalg.solve_triangular(U[c1:c2, c1:c2], eye, upper=True)  # U_SS^-1, upper [d, d]
            v = (Wd[:, c1:c2] / sd[:, None]) @ Ui  # whitened target [R, d]
            Ct = (Cd @ Ui).float()  # whitened codebooks [M, K, d]
            codes = _beam_search(v.float(), ones, Ct, idx[:, g, :], beam, beam_steps, chunk, search)
            out[:, g, :] = codes
            q = sum(Cd[m][codes[:, m]] for m in range(M)) * sd[:, None]
            E = (Wd[:, c1:c2] - q) @ Ui  # [R, d]
            Eb[:, c1 - b1:c2 - b1] = E
            if c2 < b2:
                Wd[:, c2:b2] -= E @ U[c1:c2, c2:b2]
        if b2 < Cin:
            Wd[:, b2:] -= Eb @ U[b1:b2, b2:]
    return out


def descent_codes(W: torch.Tensor, H: torch.Tensor, C: torch.Tensor, s: torch.Tensor, idx: torch.Tensor, *,
                  beam: int, beam_steps: int, chunk: int = 8192, search: str = "auto") -> torch.Tensor:
    """Codes [R, G, M]: one pass of exact block coordinate descent over the groups (AQLM's Hessian-aware beam
    search): group g's codes minimize the true objective with every other group fixed. With e = W - Q the row's
    error and q the group's current vector, replacing q by q' changes the objective to
    const + (q' - t) H_gg (q' - t)^T,  t = q + (e H)_g H_gg^-1,  so the group's search targets t / s_r under the
    metric H_gg (whitened by its Cholesky factor L: ||(q' - t) L||^2), starting from the incumbent; e H is kept
    current by a rank-8 update per group. H_gg gets a 1e-6 * mean(diag) jitter for the factorization."""
    R, Cin = W.shape
    M, K, d = C.shape
    dev = W.device
    Hd = H.to(dev, torch.float64)
    sd = s.to(dev, torch.float64)
    Cd = C.to(dev, torch.float64)
    Q = _unscaled(idx, Cd) * sd[:, None]
    Gm = (W.to(dev, torch.float64) - Q) @ Hd  # e H [R, C]
    jitter = 1e-6 * float(torch.diagonal(Hd).mean().clamp_min(1e-30))
    eye = torch.eye(d, dtype=torch.float64, device=dev)
    ones = torch.ones(R, d, device=dev)
    out = idx.clone()
    for g in range(Cin // d):
        c1, c2 = g * d, g * d + d
        Hgg = Hd[c1:c2, c1:c2] + jitter * eye
        L = torch.linalg.cholesky(Hgg)
        t = Q[:, c1:c2] + torch.cholesky_solve(Gm[:, c1:c2].t(), L).t()  # [R, d]
        v = (t / sd[:, None]) @ L
        codes = _beam_search(v.float(), ones, (Cd @ L).float(), idx[:, g, :], beam, beam_steps, chunk, search)
        out[:, g, :] = codes
        qn = sum(Cd[m][codes[:, m]] for m in range(M)) * sd[:, None]
        Gm -= (qn - Q[:, c1:c2]) @ Hd[c1:c2]
        Q[:, c1:c2] = qn
    return out


def additive_gptq_refine(W: torch.Tensor, H: torch.Tensor, idx: torch.Tensor, C: torch.Tensor, s: torch.Tensor,
                         *, rounds: int = 2, block: int = 128, damp: float = 0.01, beam: int = 4,
                         beam_steps: int = 2, cg_iters: int = 25, chunk: int = 8192, search: str = "auto",
                         log=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """From a start (codes idx [R, G, M] int64, codebooks C [M, K, d] holding fp16 values, scales s [R] holding
    fp16 values), ``rounds`` rounds of (a) error-compensated codes, (a') coordinate descent and (b) codebooks under
    H (module docstring). W [R, C] and H [C, C] on the device of the work. Returns (idx, C float32, s float32,
    info) with info {"objective_start", "objective", "per_round": [(after codes, after codebooks)]} (sums over rows
    under H as given)."""
    dev = W.device
    Wf = W.float()
    H = H.to(dev)
    U = inverse_cholesky(H, damp, dev)
    idx, C, s = idx.to(dev), C.to(dev, torch.float32), s.to(dev, torch.float32)
    obj = _row_objective(Wf, H, idx, C, s)
    start = float(obj.sum())
    per_round = []

    def keep_better(new):  # new codes, their scales refit; each row keeps the better (codes, scale) pair
        nonlocal idx, s, obj
        s_new = refit_scales_hessian(Wf, H, new, C, s)
        obj_new = _row_objective(Wf, H, new, C, s_new)
        better = obj_new < obj
        idx = torch.where(better[:, None, None], new, idx)
        s = torch.where(better, s_new, s)
        obj = torch.minimum(obj, obj_new)

    for _ in range(rounds):
        # (a) codes with the errors fed forward, (a') exact coordinate descent from the better of them
        keep_better(gptq_codes(Wf, U, C, s, idx, beam=beam, beam_steps=beam_steps, block=block, chunk=chunk,
                               search=search))
        keep_better(descent_codes(Wf, H, C, s, idx, beam=beam, beam_steps=beam_steps, chunk=chunk, search=search))
        after_codes = float(obj.sum())
        # (b) codebooks under H (fp16), then scales; kept only if the total fell
        C_new = refit_codebooks_hessian(Wf, H, idx, C, s, iters=cg_iters).to(torch.float16).float()
        s_c = refit_scales_hessian(Wf, H, idx, C_new, s)
        obj_c = _row_objective(Wf, H, idx, C_new, s_c)
        if float(obj_c.sum()) < float(obj.sum()):
            C, s, obj = C_new, s_c, obj_c
        per_round.append((after_codes, float(obj.sum())))
        if log is not None:
            log(f"additive gptq round: codes {after_codes / start:.4f}, codebooks {float(obj.sum()) / start:.4f}")
    return idx, C, s, {"objective_start": start, "objective": float(obj.sum()), "per_round": per_round}
