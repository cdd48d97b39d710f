"""One expansion step of the additive quantizer's beam search: candidate scores and their best `top`.

The quantizer (trapetum.quant.additive) keeps, for every vector v [d] with per-coordinate weights h [d],
B candidate code tuples cand [B, M] over M codebooks C [M, K, d]. A step scores
  - every parent b:                      ||v - rec_b||_h^2,            rec_b = sum_m C[m, cand[b, m]]
  - every child (m, b, k) (codebook m of parent b set to entry k):
                                         ||v - rec_b + C[m, cand[b, m]] - C[m, k]||_h^2
and keeps the `top` smallest, ascending, as (score, index) with the index convention
  parent b -> b,   child (m, b, k) -> B + (m * B + b) * K + k.
(The caller turns them into distinct tuples; see additive._beam_search.)

Two implementations with the same contract:
  candidates_torch   scores as [n, B + M*B*K] tensors (two small GEMMs per (m) and elementwise passes),
                     then torch.topk; the reference, and the path on the CPU.
  candidates_triton  one kernel: a program takes BLOCK_V vectors, builds each (m, b) tile of K scores in
                     registers (tl.dot in IEEE fp32 over the padded coordinates) and folds it into a
                     running best-`top` list (threshold test, then as many min-extractions as the tile has
                     scores under the current worst); nothing of size [n, M*B*K] touches memory. On the
                     H200 torch.topk over the [n, 2052] score rows was 57% of the quantizer's GPU time
                     (NOTES-additive.md, session 5).
Both compute in fp32; the two agree up to rounding of the scores (ties and near-ties may order differently).
Ties inside the Triton kernel go to the lower index. Deterministic: no atomics, fixed order.
"""
from __future__ import annotations

import torch

from .triton_util import triton_ok

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None


def _check(v, h, C, cand, top):
    if v.dim() != 2 or h.shape != v.shape or C.dim() != 3 or C.shape[2] != v.shape[1]:
        raise ValueError(f"beam step: v {tuple(v.shape)}, h {tuple(h.shape)}, C {tuple(C.shape)} do not match")
    if cand.dim() != 3 or cand.shape[0] != v.shape[0] or cand.shape[2] != C.shape[0]:
        raise ValueError(f"beam step: cand {tuple(cand.shape)} is not [n, B, M={C.shape[0]}]")
    total = cand.shape[1] * (1 + C.shape[0] * C.shape[1])
    if not 1 <= top <= total:
        raise ValueError(f"beam step: top {top} outside 1..{total}")


def candidates_torch(v: torch.Tensor, h: torch.Tensor, C: torch.Tensor, cand: torch.Tensor, top: int):
    """(scores, indices) [n, top], ascending: the reference computation (see the module docstring)."""
    _check(v, h, C, cand, top)
    n, B, M = cand.shape
    _, K, d = C.shape
    CT = C.transpose(1, 2)  # [M, d, K]
    C2T = (C * C).transpose(1, 2)
    rec = sum(C[m][cand[..., m]] for m in range(M))  # [n, B, d]
    base = ((v.unsqueeze(1) - rec) ** 2 * h.unsqueeze(1)).sum(-1)  # [n, B]
    scores = [base]
    for m in range(M):
        r = v.unsqueeze(1) - rec + C[m][cand[..., m]]  # residual without codebook m [n, B, d]
        hr = (h.unsqueeze(1) * r).reshape(n * B, d)
        sc = ((h @ C2T[m]).unsqueeze(1) - 2.0 * (hr @ CT[m]).view(n, B, K)
              + (r * r * h.unsqueeze(1)).sum(-1, keepdim=True))  # [n, B, K]
        scores.append(sc.reshape(n, B * K))
    return torch.cat(scores, 1).topk(top, dim=1, largest=False)  # ascending


def candidates_reference(v, h, C, cand):
    """float64 scores of every candidate [n, B + M*B*K] (tests): no selection."""
    v, h, C = v.double(), h.double(), C.double()
    n, B, M = cand.shape
    rec = sum(C[m][cand[..., m]] for m in range(M))  # [n, B, d]
    out = [((v.unsqueeze(1) - rec) ** 2 * h.unsqueeze(1)).sum(-1)]
    for m in range(M):
        r = (v.unsqueeze(1) - rec + C[m][cand[..., m]]).unsqueeze(2) - C[m].view(1, 1, -1, C.shape[2])  # [n,B,K,d]
        out.append((r * r * h.view(n, 1, 1, -1)).sum(-1).reshape(n, -1))
    return torch.cat(out, 1)


def use_triton(device: torch.device) -> bool:
    return triton_ok(device)


if triton is not None:
    @triton.jit
    def _offer(best_s, best_i, cols, s, i):
        """Put (s, i) [BLOCK_V] in place of each row's worst entry where s is smaller (strictly)."""
        worst = tl.max(best_s, 1)
        wpos = tl.argmax(best_s, 1)
        put = (cols[None, :] == wpos[:, None]) & (s < worst)[:, None]
        return tl.where(put, s[:, None], best_s), tl.where(put, i[:, None], best_i)

    @triton.jit
    def _beam_step_kernel(v_ptr, h_ptr, cand_ptr, ct_ptr, c2t_ptr, c_ptr, out_s_ptr, out_i_ptr, n, B,
                          M: tl.constexpr, K: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                          TOP: tl.constexpr, TP: tl.constexpr, BLOCK_V: tl.constexpr):
        pid = tl.program_id(0)
        rows = (pid * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        rmask = rows < n
        dcol = tl.arange(0, DP)
        dmask = dcol < D
        kcol = tl.arange(0, K)
        cols = tl.arange(0, TP)
        inf = float("inf")
        # running best list: TOP real slots (start at +inf), padding slots at -inf (never the worst)
        best_s = tl.where(cols[None, :] < TOP, inf, -inf) + tl.zeros([BLOCK_V, TP], tl.float32)
        best_i = tl.zeros([BLOCK_V, TP], tl.int64) - 1
        vd = tl.load(v_ptr + rows[:, None] * D + dcol[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        hd = tl.load(h_ptr + rows[:, None] * D + dcol[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        # parents
        for b in range(B):
            rec = tl.zeros([BLOCK_V, DP], tl.float32)
            for m in tl.static_range(M):
                code = tl.load(cand_ptr + (rows * B + b) * M + m, mask=rmask, other=0)
                rec += tl.load(c_ptr + (m * K + code[:, None]) * D + dcol[None, :], mask=dmask[None, :], other=0.0)
            e = vd - rec
            best_s, best_i = _offer(best_s, best_i, cols, tl.sum(e * e * hd, 1), b + tl.zeros([BLOCK_V], tl.int64))
        # children, in index order: codebook m, parent b, entry k
        for m in tl.static_range(M):
            ct = tl.load(ct_ptr + (m * DP + dcol[:, None]) * K + kcol[None, :])  # [DP, K], padded rows 0
            c2t = tl.load(c2t_ptr + (m * DP + dcol[:, None]) * K + kcol[None, :])
            hc2 = tl.dot(hd, c2t, input_precision="ieee")  # [BLOCK_V, K]: sum_d h C^2
            for b in range(B):
                rec = tl.zeros([BLOCK_V, DP], tl.float32)
                own = tl.zeros([BLOCK_V, DP], tl.float32)
                for mm in tl.static_range(M):
                    code = tl.load(cand_ptr + (rows * B + b) * M + mm, mask=rmask, other=0)
                    ent = tl.load(c_ptr + (mm * K + code[:, None]) * D + dcol[None, :], mask=dmask[None, :], other=0.0)
                    rec += ent
                    if mm == m:
                        own = ent
                r = vd - rec + own
                hr = hd * r
                rr = tl.sum(r * hr, 1)
                sc = hc2 - 2.0 * tl.dot(hr, ct, input_precision="ieee") + rr[:, None]  # [BLOCK_V, K]
                base = B + (m * B + b) * K
                # only scores under a row's current worst can enter: extract that many (at most TOP)
                worst = tl.max(best_s, 1)
                rounds = tl.minimum(tl.max(tl.sum((sc < worst[:, None]).to(tl.int32), 1), 0), TOP)
                for _ in range(rounds):
                    s = tl.min(sc, 1)
                    k = tl.argmin(sc, 1)  # the lower index on ties
                    best_s, best_i = _offer(best_s, best_i, cols, s, base + k.to(tl.int64))
                    sc = tl.where(kcol[None, :] == k[:, None], inf, sc)
        # ascending; equal scores by index (the padding slots out of the way first)
        best_s = tl.where(cols[None, :] < TOP, best_s, inf)
        for t in tl.static_range(TOP):
            s = tl.min(best_s, 1)
            i = tl.min(tl.where(best_s == s[:, None], best_i, 1 << 62), 1)
            tl.store(out_s_ptr + rows * TOP + t, s, mask=rmask)
            tl.store(out_i_ptr + rows * TOP + t, i, mask=rmask)
            taken = best_i == i[:, None]
            best_s = tl.where(taken, inf, best_s)
            best_i = tl.where(taken, -1, best_i)


BLOCK_V = 32


def candidates_triton(v: torch.Tensor, h: torch.Tensor, C: torch.Tensor, cand: torch.Tensor, top: int):
    """(scores, indices) [n, top], ascending: one Triton kernel (see the module docstring)."""
    _check(v, h, C, cand, top)
    if not use_triton(v.device):
        raise RuntimeError("beam step: the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    n, B, M = cand.shape
    _, K, d = C.shape
    if K & (K - 1) or K < 16:
        raise ValueError(f"beam step: the Triton kernel needs a power-of-two codebook size >= 16, got {K}")
    dp = max(16, 1 << (d - 1).bit_length())
    C = C.float().contiguous()
    CT = torch.zeros(M, dp, K, dtype=torch.float32, device=v.device)
    CT[:, :d] = C.transpose(1, 2)
    C2T = torch.zeros_like(CT)
    C2T[:, :d] = (C * C).transpose(1, 2)
    out_s = torch.empty(n, top, dtype=torch.float32, device=v.device)
    out_i = torch.empty(n, top, dtype=torch.int64, device=v.device)
    if n:
        grid = (triton.cdiv(n, BLOCK_V),)
        _beam_step_kernel[grid](v.float().contiguous(), h.float().contiguous(), cand.contiguous(), CT, C2T, C,
                                out_s, out_i, n, B, M=M, K=K, D=d, DP=dp, TOP=top,
                                TP=max(16, 1 << (top - 1).bit_length()), BLOCK_V=BLOCK_V, num_warps=8)
    return out_s, out_i


def resolve(search: str, device: torch.device, K: int) -> str:
    """The implementation `search` names on `device` for codebooks of K entries: "torch" or "triton";
    "auto" is Triton on CUDA (power-of-two K >= 16, Triton importable), torch elsewhere."""
    if search == "auto":
        ok = device.type == "cuda" and use_triton(device) and K >= 16 and not K & (K - 1)
        return "triton" if ok else "torch"
    if search not in ("torch", "triton"):
        raise ValueError(f"beam step: search must be auto, torch or triton, got {search!r}")
    return search


def candidates(v, h, C, cand, top, search: str = "auto"):
    """(scores, indices) [n, top], ascending, by the implementation resolve(search, ...) names."""
    if resolve(search, v.device, C.shape[1]) == "triton":
        return candidates_triton(v, h, C, cand, top)
    return candidates_torch(v, h, C, cand, top)
