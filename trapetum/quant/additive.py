"""Additive (AQLM-style) codebooks: our own quantizer (the scheme itself, ``AdditiveLinear``, is schemes/aqlm.py).

Layout (the Hugging Face AQLM layout, kept byte for byte in ``.cbk`` records of scheme "aqlm")::

    codes      int8 (nbits 8) / int16 (nbits 16)  [out / out_group, in / in_group, num_codebooks]
               code k of codebook m is stored as a signed integer; its index is ``code mod 2**nbits``
    codebooks  fp16 [num_codebooks, 2**nbits, out_group, in_group]
    scales     fp16 [out / out_group, 1, 1, 1]
    bias       optional [out]

    W[o-group, i-group] = scales[o-group] * sum_m codebooks[m, codes[o-group, i-group, m]]

2x8 = two codebooks of 256 entries (2 bits per weight for the codes at in_group 8), 1x16 = one
codebook of 65,536 entries (2 bits per weight for the codes; the 1 MiB codebook amortizes only over
large matrices).

Quantizer (``quantize_additive``), for in_group 8, out_group 1 and per-output-row scales: minimize
the E[x^2]-weighted squared error of the weight (the diagonal approximation of E||(W - Wq) x||^2,
the same objective as the scalar codebooks, see ``kmeans.py``)::

    sum_{o, j} h_j (W[o, j] - s_o * Q[o, j])^2  =  sum_{o, g} s_o^2 || W[o, g]/s_o - sum_m C_m[c_{o,g,m}] ||^2_{h_g}

1. scales s_o: the weighted RMS of row o (then refit in closed form at the end);
2. codebooks start from residual weighted k-means (codebook m fits what codebooks < m left);
3. codes by beam search: every vector keeps ``beam`` candidate code tuples; a step tries, for every
   candidate and every codebook, all 2**nbits replacements (residual x codebook; kernels/beam_search.py:
   one Triton kernel on CUDA, torch matmuls + topk on the CPU), keeps the best ``beam`` distinct
   tuples. With one codebook (1x16) this is the exact nearest entry;
4. codebooks refit by weighted least squares for the codes found (the objective separates over the
   8 coordinates: per coordinate a [M*K, M*K] normal system built from code co-occurrence counts;
   unused entries are held by a small ridge towards their previous value);
5. repeat 3-4 ``iters`` times; round codebooks to fp16, recompute codes against the rounded
   codebooks, refit scales and round them to fp16;
6. with ``hessian`` (E[x x^T] of the input, ``quantize --gptq``): the full objective sum_r (W_r - Q_r) H
   (W_r - Q_r)^T instead of its diagonal, from the result of 1-5 (``additive_gptq.py``: error-compensated
   codes, coordinate descent, Hessian least-squares codebooks and scales; never worse than that start under H).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import beam_search as beam_step
from ..schemes.aqlm import AdditiveLinear
from ..schemes.record import QuantRecord

__all__ = ["AdditiveResult", "quantize_additive", "dequantize_aqlm",
           "codes_to_index", "index_to_codes", "SCHEMES"]

# scheme name (CLI) -> (num_codebooks, nbits)
SCHEMES = {"aqlm-2x8": (2, 8), "aqlm-1x16": (1, 16)}


# ----------------------------------------------------------------------------- layout helpers
# (beside the kernels that read the layout: kernels/additive_layout.py)
from ..kernels.additive_layout import codes_to_index, dequantize_aqlm, index_to_codes  # noqa: E402,F401


# ----------------------------------------------------------------------------- the quantizer
@dataclass
class AdditiveResult:
    codes: torch.Tensor  # stored codes int8/int16 [out, in/8, M]
    codebooks: torch.Tensor  # fp16 [M, K, 1, 8]
    scales: torch.Tensor  # fp16 [out, 1, 1, 1]
    history: list[float]  # relative weighted error after each iteration (fp32 codebooks); the last: what is stored
    gptq: dict | None = None  # with a Hessian: additive_gptq_refine's info (objective_start, objective, per_round)

    def module(self, bias: torch.Tensor | None = None) -> AdditiveLinear:
        return AdditiveLinear(self.codes, self.codebooks, self.scales, bias)

    def record(self, bias: torch.Tensor | None = None) -> QuantRecord:
        return self.module(None if bias is None else bias.detach().to(torch.float16).cpu()).to_record()


def _kmeans(v: torch.Tensor, h: torch.Tensor, K: int, iters: int, gen: torch.Generator, chunk: int = 1 << 14,
            sample: int | None = None) -> torch.Tensor:
    """Weighted k-means of vectors v [N, d] with per-vector-per-dim weights h [N, d]: K centroids [K, d].
    Starts from K vectors drawn without replacement (repeats if N < K)."""
    N, d = v.shape
    if sample is not None and N > sample:
        sel = torch.randperm(N, generator=gen)[:sample].to(v.device)
        v, h = v[sel], h[sel]
        N = sample
    perm = torch.randperm(N, generator=gen).to(v.device)
    if N >= K:
        C = v[perm[:K]].clone()
    else:
        C = v[perm[torch.arange(K) % N]].clone() + 1e-3 * v.std() * torch.randn(K, d, generator=gen).to(v)
    for _ in range(iters):
        a = _nearest(v, h, C, chunk)
        num = torch.zeros(K, d, dtype=v.dtype, device=v.device).index_add_(0, a, h * v)
        den = torch.zeros(K, d, dtype=v.dtype, device=v.device).index_add_(0, a, h)
        used = den > 0
        C = torch.where(used, num / den.clamp_min(1e-30), C)
    return C


def _nearest(v: torch.Tensor, h: torch.Tensor, C: torch.Tensor, chunk: int) -> torch.Tensor:
    """Index of the nearest row of C [K, d] to each v [N, d] under the weights h [N, d]."""
    out = torch.empty(v.shape[0], dtype=torch.int64, device=v.device)
    chunk = min(chunk, max(256, (1 << 24) // C.shape[0]))  # score block at most 64 MiB (1x16: 256 rows)
    Ct, C2t = C.t().contiguous(), (C * C).t().contiguous()
    for s in range(0, v.shape[0], chunk):
        vv, hh = v[s:s + chunk], h[s:s + chunk]
        score = hh @ C2t - 2.0 * ((hh * vv) @ Ct)  # [n, K]; ||v||_h^2 dropped
        out[s:s + chunk] = score.argmin(1)
    return out


def _beam_search(v: torch.Tensor, h: torch.Tensor, C: torch.Tensor, idx: torch.Tensor, beam: int,
                 steps: int, chunk: int, search: str = "auto") -> torch.Tensor:
    """Codes [N, M] minimizing ||v - sum_m C[m, c_m]||^2_h, starting from idx [N, M].

    v, h [N, d]; C [M, K, d]. Each step expands every candidate by changing one codebook's code to
    each of the K entries and keeps the ``beam`` best distinct tuples (the incumbent stays a
    candidate, so the error never rises). The scores and their best 2 * beam + 1 come from
    kernels.beam_search (``search``: torch, triton, or auto = Triton on CUDA)."""
    N, M = idx.shape
    _, K, d = C.shape
    if M == 1:
        return _nearest(v, h, C[0], chunk).unsqueeze(1)
    out = torch.empty_like(idx)
    mult = torch.tensor([K ** (M - 1 - m) for m in range(M)], dtype=torch.int64, device=v.device)
    for s in range(0, N, chunk):
        vv, hh = v[s:s + chunk], h[s:s + chunk]
        n = vv.shape[0]
        cand = idx[s:s + chunk].unsqueeze(1)  # [n, B, M]
        for _ in range(steps):
            B = cand.shape[1]
            top = min(2 * beam + 1, B * (1 + M * K))
            best_s, best_i = beam_step.candidates(vv, hh, C, cand, top, search)  # ascending
            is_parent = best_i < B
            j = (best_i - B).clamp_min(0)
            m_sel, parent, k_sel = j // (B * K), (j % (B * K)) // K, j % K
            parent = torch.where(is_parent, best_i, parent)
            best_t = torch.gather(cand, 1, parent.unsqueeze(-1).expand(n, top, M)).clone()  # [n, top, M]
            onehot = (torch.arange(M, device=v.device) == m_sel.unsqueeze(-1)) & ~is_parent.unsqueeze(-1)
            best_t = torch.where(onehot, k_sel.unsqueeze(-1), best_t)
            key = (best_t * mult).sum(-1)  # [n, top]
            dup = (key.unsqueeze(2) == key.unsqueeze(1)).tril(-1).any(2)  # equal to an earlier (better) one
            rank = torch.where(dup, torch.full_like(best_s, float("inf")), best_s)
            keep = rank.topk(min(beam, top), dim=1, largest=False).indices.sort(1).values
            keep_ok = torch.gather(rank, 1, keep).isfinite()
            cand = torch.gather(best_t, 1, keep.unsqueeze(-1).expand(n, keep.shape[1], M))
            # a slot with no distinct candidate left repeats the best one
            cand = torch.where(keep_ok.unsqueeze(-1), cand, cand[:, :1].expand_as(cand))
        out[s:s + chunk] = cand[:, 0]
    return out


def cooccurrence(gidx: torch.Tensor, wt: torch.Tensor, MK: int) -> torch.Tensor:
    """Per coordinate, the weighted code co-occurrence matrix [d, MK, MK] = sum_n wt[:, n] e_n e_n^T, e_n the sum of
    the one-hots of vector n's global entry ids ``gidx`` [N, M] (entry + m * K); ``wt`` [d, N] float64. The normal
    matrix of the codebooks' least squares under per-coordinate weights (``_refit_codebooks``; additive_gptq's
    preconditioner)."""
    A = torch.zeros(wt.shape[0], MK * MK, dtype=wt.dtype, device=wt.device)
    for a in range(gidx.shape[1]):
        for b in range(gidx.shape[1]):
            A.index_add_(1, gidx[:, a] * MK + gidx[:, b], wt)
    return A.view(wt.shape[0], MK, MK)


def _refit_codebooks(v: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, C: torch.Tensor,
                     ridge: float = 1e-6) -> torch.Tensor:
    """Weighted least squares for the codebooks given codes: min sum_n,d w[n,d] (v[n,d] - sum_m C[m, idx[n,m], d])^2.

    Separable over d. M == 1: the weighted mean per entry. M > 1: the [M*K, M*K] normal equations
    per coordinate from weighted code co-occurrences, with a ridge towards the previous codebooks."""
    M, K, d = C.shape
    dev, dt = v.device, torch.float64
    if M == 1:
        a = idx[:, 0]
        num = torch.zeros(K, d, dtype=dt, device=dev).index_add_(0, a, (w * v).to(dt))
        den = torch.zeros(K, d, dtype=dt, device=dev).index_add_(0, a, w.to(dt))
        return torch.where(den > 0, num / den.clamp_min(1e-300), C[0].to(dt)).to(C.dtype).unsqueeze(0)
    MK = M * K
    gidx = idx + torch.arange(M, device=dev) * K  # [N, M] global entry ids
    rhs = torch.zeros(d, MK, dtype=dt, device=dev)
    wt, wvt = w.t().to(dt), (w * v).t().to(dt)  # [d, N]
    for a in range(M):
        rhs.index_add_(1, gidx[:, a], wvt)
    A = cooccurrence(gidx, wt, MK)
    lam = ridge * (A.diagonal(dim1=1, dim2=2).mean(1) + 1e-30)  # [d]
    A = A + lam[:, None, None] * torch.eye(MK, dtype=dt, device=dev)
    rhs = rhs + lam[:, None] * C.permute(2, 0, 1).reshape(d, MK).to(dt)  # ridge towards the previous codebooks
    L, info = torch.linalg.cholesky_ex(A)
    if bool((info != 0).any()):
        sol = torch.linalg.solve(A, rhs.unsqueeze(-1))
    else:
        sol = torch.cholesky_solve(rhs.unsqueeze(-1), L)
    new = sol.squeeze(-1).view(d, M, K).permute(1, 2, 0)  # [M, K, d]
    return new.to(C.dtype)


def quantize_additive(W: torch.Tensor, importance: torch.Tensor | None = None, **kw) -> AdditiveResult:
    """Quantize W [out, in] to additive codebooks (out_group 1, per-row scales); see the module docstring.

    importance: E[x_j^2] per input channel [in] (None: unweighted). Keywords: num_codebooks (2),
    nbits (8), in_group_size (8), beam (4), iters (6), beam_steps (2), kmeans_iters (10), seed (0),
    device ("cpu"), chunk (vectors per beam-search block: 2^20 on CUDA with the Triton step, 65536 with
    torch's, 8192 on the CPU), search (beam-step scores and selection: "auto" = the Triton kernel on CUDA,
    "torch", "triton"; kernels/beam_search.py); hessian (E[x x^T] [in, in], None: the diagonal objective only)
    with gptq_rounds (2), gptq_block (128), gptq_damp (0.01), gptq_cg_iters (25): the result above refined under
    the full Hessian by additive_gptq.additive_gptq_refine (error-compensated codes, Hessian least-squares
    codebooks and scales; never worse than the diagonal result under H). On CUDA the
    run uses PyTorch's deterministic algorithms (index_add_ without atomics), so a layer quantizes to the
    same bits every time (resumable runs)."""
    dev = torch.device(kw.get("device", "cpu"))
    if dev.type != "cuda":
        return _quantize_additive(W, importance, **kw)
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _quantize_additive(W, importance, **kw)
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def _quantize_additive(W: torch.Tensor, importance: torch.Tensor | None = None, *, num_codebooks: int = 2,
                      nbits: int = 8, in_group_size: int = 8, beam: int = 4, iters: int = 6, beam_steps: int = 2,
                      kmeans_iters: int = 10, seed: int = 0, device: str | torch.device = "cpu",
                      chunk: int | None = None, search: str = "auto", hessian: torch.Tensor | None = None,
                      gptq_rounds: int = 2, gptq_block: int = 128, gptq_damp: float = 0.01,
                      gptq_cg_iters: int = 25) -> AdditiveResult:
    # vectors per beam-search block: a GPU needs large blocks to amortise the ~30 small kernels of a step
    # (H200, 11008x4096, torch scores: 14.6 s at 8192, 5.8 s at 65536, the same codes); the Triton step
    # keeps only [n, 2 * beam + 1] per block, so its blocks can be 16x larger; a CPU gains nothing past 8192
    dev = torch.device(device)
    search = beam_step.resolve(search, dev, 1 << nbits)
    chunk = chunk or (8192 if dev.type != "cuda" else 1 << 20 if search == "triton" else 65536)
    out_f, in_f = W.shape
    if in_f % in_group_size:
        raise ValueError(f"in_features {in_f} is not a multiple of in_group_size {in_group_size}")
    M, K, d, G = num_codebooks, 1 << nbits, in_group_size, in_f // in_group_size
    gen = torch.Generator().manual_seed(seed)
    Wd = W.detach().to(device=device, dtype=torch.float32)
    h = (torch.ones(in_f, device=device) if importance is None
         else importance.detach().to(device=device, dtype=torch.float32).clamp_min(0))
    h = h + 1e-6 * h.mean() + 1e-30  # no zero weights
    h = h / h.mean()
    # 1. scales: weighted RMS of each row
    s = ((Wd * Wd * h).mean(1) / h.mean()).sqrt().clamp_min(1e-8)  # [out]
    v = (Wd / s[:, None]).reshape(out_f * G, d)  # [N, d] row-major over (o, g)
    hv = h.view(1, G, d).expand(out_f, G, d).reshape(-1, d)  # per-vector weights for codes
    wv = hv * (s * s).repeat_interleave(G)[:, None]  # weights of the original-space objective
    total = float((Wd * Wd * h).sum())

    def rel_err(C, idx, scales=None):
        rec = sum(C[m][idx[:, m]] for m in range(M))
        if scales is None:
            return float(((v - rec) ** 2 * wv).sum()) / total
        Wq = rec.view(out_f, G * d) * scales[:, None]
        return float(((Wd - Wq) ** 2 * h).sum()) / total

    # 2. residual k-means start
    sample = 1 << 16 if K <= 256 else None
    C = torch.empty(M, K, d, device=device)
    idx = torch.empty(v.shape[0], M, dtype=torch.int64, device=device)
    r = v.clone()
    for m in range(M):
        C[m] = _kmeans(r, hv, K, kmeans_iters, gen, sample=sample)
        idx[:, m] = _nearest(r, hv, C[m], chunk)
        r = r - C[m][idx[:, m]]
    del r
    history = [rel_err(C, idx)]
    # 3-5. beam search / least squares alternation
    for _ in range(iters):
        idx = _beam_search(v, hv, C, idx, beam, beam_steps, chunk, search)
        C = _refit_codebooks(v, wv, idx, C)
        history.append(rel_err(C, idx))
    # fp16 codebooks; codes against the rounded codebooks; closed-form scales, rounded
    C16 = C.to(torch.float16).float()
    idx = _beam_search(v, hv, C16, idx, beam, beam_steps, chunk, search)
    Q = sum(C16[m][idx[:, m]] for m in range(M)).view(out_f, G * d)
    s_new = (Wd * Q * h).sum(1) / (Q * Q * h).sum(1).clamp_min(1e-30)
    s_new = torch.where((Q * Q).sum(1) > 0, s_new, s)
    s16 = s_new.to(torch.float16)
    history.append(rel_err(C16, idx, s16.float()))
    info = None
    if hessian is not None and gptq_rounds > 0:  # the full-Hessian refinement from this start
        from .additive_gptq import additive_gptq_refine
        idx3, C16, s32, info = additive_gptq_refine(
            Wd, hessian.to(device=device, dtype=torch.float32), idx.view(out_f, G, M), C16, s16.float(),
            rounds=gptq_rounds, block=gptq_block, damp=gptq_damp, beam=beam, beam_steps=beam_steps,
            cg_iters=gptq_cg_iters, chunk=chunk, search=search)
        idx, s16, C16 = idx3.reshape(out_f * G, M), s32.to(torch.float16), C16.contiguous()
        history.append(rel_err(C16, idx, s16.float()))
    codes = index_to_codes(idx.view(out_f, G, M), nbits).cpu()
    return AdditiveResult(codes, C16.to(torch.float16).view(M, K, 1, d).cpu(), s16.view(out_f, 1, 1, 1).cpu(), history,
                          info)
