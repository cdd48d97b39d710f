"""Decode attention over a KV cache: split-KV Triton kernel + merge kernel, for one new token (decode) or M new
tokens of one sequence (speculative verify), and the float64 reference.

Layouts: q fp16 [Hq, D] (one token) or [M, Hq, D] (rows), Hq = G * Hkv, query head h reads kv head h // G (HF
repeat_kv); k, v fp16 [Hkv, D] / [M, Hkv, D], the new tokens' un-roped k and their v (views with a contiguous last
dim, e.g. slices of the qkv GEMV output [M, (Hq + 2 Hkv) D]); k_cache, v_cache fp16 [Hkv, T_max, D] (last dim
contiguous); length / pos an int or a one-element int32/int64 tensor on q's device (graph-capturable: the grids
depend only on M, T_max and the config; programs past the run-time length exit at once).
Semantics: s = scale * q.k; with softcap c: s = c * tanh(s / c); with window w only positions p >= L - w are
visible (HF sliding window); softmax over them; out = p @ v. Row r of a rows call is the token at position pos + r
and attends to [lo_r, pos + r] (L_r = pos + r + 1: causal within the new rows).

Split-KV: one program per (kv head, chunk) handles the G query heads of its kv head (K and V read once), walks its
chunk block_n positions at a time with an online softmax (finite _NEG as minus infinity) and writes the chunk's
(max, sum, unnormalized out) to the workspace; the merge kernel folds the chunks of each (row, query head, slice of
merge_d columns) in a fixed order, merge_chunks per step loaded together: bitwise reproducible. Fixed chunks
(AttnConfig.splits = 0) are `chunk` positions long. Adaptive chunks (splits = P): P programs per kv head whatever
the length; the visible span, from the window start rounded down to block_n to L, is cut into chunks of max(chunk,
ceil(span / P) rounded up to block_n) positions (_chunks); programs past the last chunk exit, the merge recomputes
the count. Configs, the resource rule and the choice rule: attn_configs.py.
Fused RoPE + KV append (fused=True, the engine's path): each program rotates its q rows in registers with
rope_kv_append's expressions, and the new tokens' rotated k and their v are written into the caches inside the
split kernel (fused.rope_append_kv: rope_kv_append's bits) before any program reads them. One token: the program
whose chunk holds the new position writes it, then a CTA barrier, then reads its chunk; the other programs cover
older positions only. fused=False: rope_kv_append over the rows (q rotated in place), the split kernel without
RoPE, the merge: the same cache bits; the output may differ from the fused kernel's by an fp16 ulp (q's RoPE is
rounded by another kernel), and each mode's rows are bitwise its own successive decode calls.

Rows and the batch-invariance contract: out[r] and the cache rows of attention_rows are bitwise what M successive
single-token calls at pos, ..., pos + M - 1 give with the same config; M = 1 is the decode launch itself (constexpr
MULTI off: the decode program, grids and bits). The chunking is part of the contract: row r is cut into the chunks
of its own length L_r (with splits, chunk length and base follow L_r: rows of one call may have different chunk
boundaries), walks the same BN-blocks in the same order with the same online-softmax updates, and is merged over
the same chunks in the same steps as a decode call at L_r. Why the rows program gives those bits while one K/V
tile load serves several rows:
  - it holds TPP = 16 // G tokens when G <= 16 (one when G > 16): tile row j * G + g is token j's query head g, in
    the decode launch's tile (BLOCK_G = max(16, G) rows, BN, BLOCK_D, num_warps, num_stages; never grown with M).
    A tl.dot row depends only on that row of q and on k / v (every row gets the same MMA sequence over the
    reduction dim), and the row-wise max / sum reduce each row alone in the same tree;
  - each row has its own length, window start, valid mask and chunk range. Scores of positions a row does not see
    become _NEG (whatever K holds there) and their p 0, as in decode, where those positions are loaded as 0: p @ v
    gets only zero products from them (exact for finite K/V). K/V are loaded over the union of the rows' ranges;
  - the program walks the union of its rows' BN-aligned block ranges in ascending order; a block outside a row's
    own range of this chunk leaves its (m, l, o) untouched (a select: the union may hold blocks of another of the
    row's own chunks, visible to it, which masks alone would count twice); the blocks inside are the decode
    call's, in its order;
  - partials go to workspace head r * Hq + h; the merge kernel merges each row over its own chunks.
  Fused RoPE: row r reads the new positions pos .. pos + r, so a program appends every new position inside the
  range it reads itself (the same bits from every writer: a slot may be written by a few programs), then a CTA
  barrier; it never reads a slot before its own write. No case falls back to one program per row (G > 16 tiles
  hold one token anyway). The grid is (row block, kv head, chunk), row blocks adjacent: the ceil(M / TPP) programs
  that read one K/V tile run together (L2).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..settings import DEFAULT_KERNELS, KernelOptions
from . import pdl  # programmatic dependent launch of the split and merge kernels
from .attn_configs import (AttnConfig, block_d, block_g, choose_config, config_fits, fixed_chunk_config,  # noqa: F401
                           loops, n_chunks, named_config, resolve_config)
from .codebook_layout import Fragments, frag_pieces, to_fragments
from .fused import check_rope_kv, rope_kv_append
from .triton_util import HAVE_TRITON, triton_ok

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .codebook_layout import frag_offset

# finite "minus infinity": keeps exp(m_old - m_new) free of NaN (a constexpr: Triton kernels may
# only read globals that are constexpr)
_NEG = tl.constexpr(-1.0e30) if HAVE_TRITON else -1.0e30
_BIG = tl.constexpr(2 ** 30) if HAVE_TRITON else 2 ** 30
APPEND_ROWS = tl.constexpr(16) if HAVE_TRITON else 16  # new rows a rows program rotates and appends per step


def decode_attention_reference(q, k_cache, v_cache, length, *, scale, window=None, softcap=None):
    """float64 reference. Returns float64 [Hq, D]."""
    return decode_attention_torch(q, k_cache, v_cache, length, scale=scale, window=window, softcap=softcap,
                                  dtype=torch.float64)


def decode_attention_torch(q, k_cache, v_cache, length, *, scale, window=None, softcap=None, dtype=torch.float16):
    """The same computation in plain torch at `dtype` (the "same-dtype torch computation")."""
    L = int(length)
    g = q.shape[0] // k_cache.shape[0]
    k = k_cache[:, :L].to(dtype).repeat_interleave(g, 0)
    v = v_cache[:, :L].to(dtype).repeat_interleave(g, 0)
    s = torch.einsum("hd,hld->hl", q.to(dtype), k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if window is not None:
        pos = torch.arange(L, device=s.device)
        s = s.masked_fill(pos[None, :] < L - window, float("-inf"))
    p = torch.softmax(s, -1)
    return torch.einsum("hl,hld->hd", p, v)


if HAVE_TRITON:
    from .fused import rope_append_kv, rope_append_rows

    @triton.jit
    def _tanh(x):
        x = tl.minimum(tl.maximum(x, -15.0), 15.0)
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _load_len(len_ptr, len_val, LEN_PTR: tl.constexpr):
        if LEN_PTR:
            return tl.load(len_ptr).to(tl.int32)
        else:
            return len_val

    @triton.jit
    def _chunks(L, window, HAS_WIN: tl.constexpr, CH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr):
        # The first visible position lo, and the chunks c0 .. c1-1 that hold visible positions, chunk c
        # being [base + c * clen, base + (c + 1) * clen). SPLITS = 0: fixed chunks (base 0, clen = CH).
        # SPLITS = P: the span from base (lo rounded down to a BN boundary) to L cut into at most P chunks
        # of clen = max(CH, ceil(span / P) rounded up to BN) positions (c0 = 0). Elementwise: L may be a
        # vector (one length per tile row).
        lo = 0
        if HAS_WIN:
            lo = tl.maximum(L - window, 0)
        if SPLITS > 0:
            base = lo // BN * BN
            clen = tl.maximum(tl.cdiv(tl.cdiv(L - base, SPLITS), BN) * BN, CH)
            return lo, base, clen, 0, tl.cdiv(L - base, clen)
        else:
            return lo, 0, CH, lo // CH, (L + CH - 1) // CH

    @triton.jit
    def _load_q(q_ptr, hk, G, D, stride_qh, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        # the G query heads of kv head hk: q [BG, BD] fp16, their indices and mask
        rg = tl.arange(0, BLOCK_G)
        rd = tl.arange(0, BLOCK_D)
        hq = hk * G + rg
        gmask = rg < G
        q = tl.load(q_ptr + hq[:, None] * stride_qh + rd[None, :], mask=gmask[:, None] & (rd[None, :] < D), other=0.0)
        return q, hq, gmask

    @triton.jit
    def _load_q_roped(q_ptr, hk, G, D, HALF, stride_qh, cos_row, sin_row,
                      BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        # _load_q of un-roped q, rotated (HF rotate-half) with the cos/sin rows of the new position and
        # rounded to fp16 as rope_kv_append rounds it: x1 c - x2 s = x1 c + (-x2) s exactly (first half),
        # x2 c + x1 s (second half); columns past the rotary part pass through.
        rg = tl.arange(0, BLOCK_G)
        rd = tl.arange(0, BLOCK_D)
        hq = hk * G + rg
        gmask = rg < G
        rows = q_ptr + hq[:, None] * stride_qh
        first = rd < HALF
        rot = rd < 2 * HALF
        x = tl.load(rows + rd[None, :], mask=gmask[:, None] & (rd[None, :] < D), other=0.0).to(tl.float32)
        xp = tl.load(rows + tl.where(first, rd + HALF, rd - HALF)[None, :], mask=gmask[:, None] & rot[None, :],
                     other=0.0).to(tl.float32)  # the rotation partner of each column
        ri = tl.where(first, rd, rd - HALF)
        c = tl.load(cos_row + ri, mask=rot, other=1.0)
        s = tl.load(sin_row + ri, mask=rot, other=0.0)
        y = x * c[None, :] + tl.where(first[None, :], -xp, xp) * s[None, :]
        return tl.where(rot[None, :], y, x).to(tl.float16), hq, gmask

    @triton.jit
    def _load_q_rows(q_ptr, r, hq, live, D, HALF, stride_qr, stride_qh, cos_ptr, sin_ptr, tpos,
                     ROPE: tl.constexpr, BLOCK_D: tl.constexpr):
        # The rows kernel's q tile: tile row i is token r[i]'s query head hq[i] (live[i]: a real row), rotated
        # with the cos/sin row of its own position tpos[i] by _load_q_roped's expressions when ROPE.
        rd = tl.arange(0, BLOCK_D)
        rows = q_ptr + r[:, None] * stride_qr + hq[:, None] * stride_qh
        if ROPE:
            first = rd < HALF
            rot = rd < 2 * HALF
            x = tl.load(rows + rd[None, :], mask=live[:, None] & (rd[None, :] < D), other=0.0).to(tl.float32)
            xp = tl.load(rows + tl.where(first, rd + HALF, rd - HALF)[None, :], mask=live[:, None] & rot[None, :],
                         other=0.0).to(tl.float32)
            tab = tpos[:, None] * HALF + tl.where(first, rd, rd - HALF)[None, :]
            cm = live[:, None] & rot[None, :]
            c = tl.load(cos_ptr + tab, mask=cm, other=1.0)
            s = tl.load(sin_ptr + tab, mask=cm, other=0.0)
            y = x * c + tl.where(first[None, :], -xp, xp) * s
            return tl.where(rot[None, :], y, x).to(tl.float16)
        else:
            return tl.load(rows + rd[None, :], mask=live[:, None] & (rd[None, :] < D), other=0.0)

    @triton.jit
    def _partials(q, k, v, valid, scale, softcap, HAS_CAP: tl.constexpr):
        # (m [BG], l [BG], o [BG, BD] unnormalized) of one BN-block; valid: [1, BN] or [BG, BN]
        s = tl.dot(q, tl.trans(k)) * scale  # [BG, BN] fp32
        if HAS_CAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(valid, s, _NEG)
        m = tl.max(s, 1)
        p = tl.exp(s - m[:, None])
        p = tl.where(valid, p, 0.0)
        l = tl.sum(p, 1)
        o = tl.dot(p.to(tl.float16), v)  # [BG, BD] fp32
        return m, l, o

    @triton.jit
    def _tile(q, k_base, v_base, p0, L, lo, stride_kt, stride_vt, scale, softcap, D,
              HAS_CAP: tl.constexpr, BLOCK_D: tl.constexpr, BN: tl.constexpr):
        # q: [BG, BD] fp16, one length L for every row: the partials of positions p0 .. p0+BN-1
        pos = p0 + tl.arange(0, BN)
        rd = tl.arange(0, BLOCK_D)
        valid = (pos < L) & (pos >= lo)
        kv_mask = valid[:, None] & (rd[None, :] < D)
        k = tl.load(k_base + pos[:, None] * stride_kt + rd[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + pos[:, None] * stride_vt + rd[None, :], mask=kv_mask, other=0.0)  # both in flight
        return _partials(q, k, v, valid[None, :], scale, softcap, HAS_CAP)

    @triton.jit
    def _tile_rows(q, k_base, v_base, p0, L, lo, L_u, lo_u, stride_kt, stride_vt, scale, softcap, D,
                   HAS_CAP: tl.constexpr, BLOCK_D: tl.constexpr, BN: tl.constexpr):
        # _tile with a length L[i] and window start lo[i] per tile row; K/V loaded over the rows' union [lo_u, L_u)
        pos = p0 + tl.arange(0, BN)
        rd = tl.arange(0, BLOCK_D)
        kv_mask = ((pos < L_u) & (pos >= lo_u))[:, None] & (rd[None, :] < D)
        k = tl.load(k_base + pos[:, None] * stride_kt + rd[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + pos[:, None] * stride_vt + rd[None, :], mask=kv_mask, other=0.0)
        valid = (pos[None, :] < L[:, None]) & (pos[None, :] >= lo[:, None])
        return _partials(q, k, v, valid, scale, softcap, HAS_CAP)

    @triton.jit
    def _online(m, l, o, mt, lt, ot):
        # fold a block's partials into the running (max, sum, out)
        mn = tl.maximum(m, mt)
        a = tl.exp(m - mn)
        b = tl.exp(mt - mn)
        return mn, l * a + lt * b, o * a[:, None] + ot * b[:, None]

    @triton.jit
    def _chunk(q, k_base, v_base, p0, size, L, lo, stride_kt, stride_vt, scale, softcap, D,
               HAS_CAP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BN: tl.constexpr,
               LOOP: tl.constexpr):
        # (m, l, o) of the visible positions of the chunk [p0, p0 + size), p0 a multiple of BN: one tile at p0
        # (not LOOP: the chunk is one BN-block), or a loop over its visible BN-blocks (every block holds a
        # visible position; a run-time trip count, software-pipelined over the kernel's num_stages)
        if not LOOP:
            m, l, o = _tile(q, k_base, v_base, p0, L, lo, stride_kt, stride_vt, scale, softcap, D,
                            HAS_CAP, BLOCK_D, BN)
        else:
            m = tl.full([BLOCK_G], _NEG, tl.float32)
            l = tl.zeros([BLOCK_G], tl.float32)
            o = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            p_lo = tl.maximum(p0, (lo // BN) * BN)
            p_hi = tl.minimum(p0 + size, L)
            for p in range(p_lo, p_hi, BN):
                mt, lt, ot = _tile(q, k_base, v_base, p, L, lo, stride_kt, stride_vt, scale, softcap, D,
                                   HAS_CAP, BLOCK_D, BN)
                m, l, o = _online(m, l, o, mt, lt, ot)
        return m, l, o

    @triton.jit
    def _merge_cols(m_ptr, l_ptr, o_ptr, hq, rd, c0, c1, NCH, BLOCK_D: tl.constexpr, BLOCK_DM: tl.constexpr,
                    BLOCK_C: tl.constexpr, CACHE: tl.constexpr):
        # Columns rd (BLOCK_DM of them) of workspace head hq merged over chunks c0 .. c1-1 in one pass, BLOCK_C
        # chunks per step (steps aligned to BLOCK_C): the chunks of a step are loaded together (not one
        # dependent load per chunk) and folded into the running (max, sum, out) by tl.max / tl.sum in a
        # fixed order: bitwise reproducible. Returns the normalized output, fp32 [BLOCK_DM].
        rc = tl.arange(0, BLOCK_C)
        mx = tl.max(tl.full([BLOCK_C], _NEG, tl.float32), 0)
        ls = tl.sum(tl.zeros([BLOCK_C], tl.float32), 0)
        acc = tl.zeros([BLOCK_DM], tl.float32)
        for cb in range((c0 // BLOCK_C) * BLOCK_C, c1, BLOCK_C):
            idx = cb + rc
            cm = (idx >= c0) & (idx < c1)
            mc = tl.load(m_ptr + hq * NCH + idx, mask=cm, other=_NEG, cache_modifier=CACHE)
            lc = tl.load(l_ptr + hq * NCH + idx, mask=cm, other=0.0, cache_modifier=CACHE)
            oc = tl.load(o_ptr + (hq * NCH + idx)[:, None] * BLOCK_D + rd[None, :], mask=cm[:, None], other=0.0,
                         cache_modifier=CACHE)
            mn = tl.maximum(mx, tl.max(mc, 0))
            a = tl.exp(mx - mn)
            w = tl.where(cm, tl.exp(mc - mn), 0.0)
            ls = ls * a + tl.sum(lc * w, 0)
            acc = acc * a + tl.sum(oc * w[:, None], 0)
            mx = mn
        return acc / ls

    @triton.jit
    def _split_one(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, t, m_ptr, l_ptr, o_ptr,
                   G, D, HALF, NCH, stride_qh, stride_knh, stride_vnh, stride_kh, stride_kt, stride_vh, stride_vt,
                   scale, softcap, window, T_IS_POS: tl.constexpr, ROPE: tl.constexpr, HAS_WIN: tl.constexpr,
                   HAS_CAP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                   CH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, LOOP: tl.constexpr):
        # The decode program (kv head, chunk) of one token. t: the attention length, or (T_IS_POS) the token's
        # position (length t + 1); ROPE: kn, vn are its un-roped k and its v (module docstring).
        hk = tl.program_id(0)
        c = tl.program_id(1)
        L = t + 1 if T_IS_POS else t
        lo, base, clen, c0, c1 = _chunks(L, window, HAS_WIN, CH, BN, SPLITS)
        if (c >= c0) & (c < c1):
            k_base = kc_ptr + hk * stride_kh
            v_base = vc_ptr + hk * stride_vh
            if ROPE:
                if c == (t - base) // clen:  # the chunk of the new position: append it before reading the chunk
                    ri = tl.arange(0, BLOCK_H)
                    cs = tl.load(cos_ptr + t * HALF + ri, mask=ri < HALF, other=1.0)
                    sn = tl.load(sin_ptr + t * HALF + ri, mask=ri < HALF, other=0.0)
                    rope_append_kv(kn_ptr + hk * stride_knh, vn_ptr + hk * stride_vnh, k_base + t * stride_kt,
                                   v_base + t * stride_vt, cs, sn, HALF, D, BLOCK_H, BLOCK_D)
                    tl.debug_barrier()  # the slot's stores before any thread of this program loads it
                q, hq, gmask = _load_q_roped(q_ptr, hk, G, D, HALF, stride_qh, cos_ptr + t * HALF,
                                             sin_ptr + t * HALF, BLOCK_G, BLOCK_D)
            else:
                q, hq, gmask = _load_q(q_ptr, hk, G, D, stride_qh, BLOCK_G, BLOCK_D)
            p0 = base + c * clen
            m, l, o = _chunk(q, k_base, v_base, p0, clen, L, lo, stride_kt, stride_vt, scale, softcap, D,
                             HAS_CAP, BLOCK_G, BLOCK_D, BN, LOOP)
            rd = tl.arange(0, BLOCK_D)
            tl.store(m_ptr + hq * NCH + c, m, mask=gmask)
            tl.store(l_ptr + hq * NCH + c, l, mask=gmask)
            tl.store(o_ptr + (hq[:, None] * NCH + c) * BLOCK_D + rd[None, :], o, mask=gmask[:, None])

    @triton.jit
    def _split_rows(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, t, m_ptr, l_ptr, o_ptr,
                    M, G, D, HALF, NCH, HQ, stride_qr, stride_qh, stride_knr, stride_knh, stride_vnr, stride_vnh,
                    stride_kh, stride_kt, stride_vh, stride_vt, scale, softcap, window,
                    ROPE: tl.constexpr, HAS_WIN: tl.constexpr, HAS_CAP: tl.constexpr, TPP: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                    CH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, LOOP: tl.constexpr):
        # The rows program (row block, kv head, chunk c): tokens rb * TPP .. rb * TPP + TPP - 1 (< M) at
        # positions t + r, each with its own chunk c (module docstring).
        rb = tl.program_id(0)
        hk = tl.program_id(1)
        c = tl.program_id(2)
        ri = tl.arange(0, BLOCK_G)
        r = rb * TPP + ri // G  # [BG] the token of each tile row
        hq = hk * G + ri % G  # and its query head
        live = (ri < TPP * G) & (r < M)
        L = t + r + 1
        lo, base, clen, c0, c1 = _chunks(L, window, HAS_WIN, CH, BN, SPLITS)
        zero = tl.zeros_like(L)  # lo, c0 as vectors also where _chunks gives constants
        lo = lo + zero
        act = live & (c >= c0 + zero) & (c < c1)  # rows whose chunk c holds visible positions
        if tl.max(act.to(tl.int32), 0) > 0:
            p0 = base + c * clen
            if LOOP:  # each row's blocks, as _chunk walks them
                p_lo = tl.maximum(p0, (lo // BN) * BN)
                p_hi = tl.minimum(p0 + clen, L)
            else:
                p_lo = p0
                p_hi = p0 + BN
            b_lo = tl.min(tl.where(act, p_lo, _BIG), 0)  # the union of the active rows' blocks and positions
            b_hi = tl.max(tl.where(act, p_hi, 0), 0)
            lo_u = tl.min(tl.where(act, lo, _BIG), 0)
            L_u = tl.max(tl.where(act, L, 0), 0)
            k_base = kc_ptr + hk * stride_kh
            v_base = vc_ptr + hk * stride_vh
            if ROPE:  # append the new positions this program reads (all of them: L_u - 1 <= t + M - 1)
                j_lo = tl.maximum(tl.maximum(b_lo, lo_u) - t, 0)
                j_hi = tl.minimum(b_hi, L_u) - t
                if j_hi > j_lo:  # APPEND_ROWS rows at once (one step for a verify pass)
                    for j0 in range(j_lo, j_hi, APPEND_ROWS):
                        rope_append_rows(kn_ptr + hk * stride_knh, vn_ptr + hk * stride_vnh, stride_knr,
                                         stride_vnr, k_base, v_base, stride_kt, stride_vt, cos_ptr, sin_ptr, t, j0,
                                         tl.minimum(j0 + APPEND_ROWS, j_hi), HALF, D, APPEND_ROWS, BLOCK_H,
                                         BLOCK_D)
                    tl.debug_barrier()  # the slots' stores before any thread of this program loads them
            q = _load_q_rows(q_ptr, r, hq, live, D, HALF, stride_qr, stride_qh, cos_ptr, sin_ptr, t + r,
                             ROPE, BLOCK_D)
            if LOOP:
                m = tl.full([BLOCK_G], _NEG, tl.float32)
                l = tl.zeros([BLOCK_G], tl.float32)
                o = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
                for p in range(b_lo, b_hi, BN):
                    mt, lt, ot = _tile_rows(q, k_base, v_base, p, L, lo, L_u, lo_u, stride_kt, stride_vt, scale,
                                            softcap, D, HAS_CAP, BLOCK_D, BN)
                    mn, ln, on = _online(m, l, o, mt, lt, ot)
                    inside = act & (p >= p_lo) & (p < p_hi)  # a block outside a row's range: no-op for it
                    m = tl.where(inside, mn, m)
                    l = tl.where(inside, ln, l)
                    o = tl.where(inside[:, None], on, o)
            else:
                m, l, o = _tile_rows(q, k_base, v_base, b_lo, L, lo, L_u, lo_u, stride_kt, stride_vt, scale,
                                     softcap, D, HAS_CAP, BLOCK_D, BN)
            rd = tl.arange(0, BLOCK_D)
            w = (r * HQ + hq) * NCH + c  # workspace head r * Hq + hq, chunk c
            tl.store(m_ptr + w, m, mask=act)
            tl.store(l_ptr + w, l, mask=act)
            tl.store(o_ptr + w[:, None] * BLOCK_D + rd[None, :], o, mask=act[:, None])

    @triton.jit
    def _attn_split_kernel(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, t_ptr, t_val, m_ptr, l_ptr, o_ptr,
                           M, G, D, HALF, NCH, HQ, stride_qr, stride_qh, stride_knr, stride_knh, stride_vnr,
                           stride_vnh, stride_kh, stride_kt, stride_vh, stride_vt, scale, softcap, window,
                           T_PTR: tl.constexpr, T_IS_POS: tl.constexpr, ROPE: tl.constexpr, MULTI: tl.constexpr,
                           TPP: tl.constexpr, HAS_WIN: tl.constexpr, HAS_CAP: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                           CH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, LOOP: tl.constexpr,
                           PDL: tl.constexpr):
        # MULTI off: grid (Hkv, chunks), one token (_split_one; the row arguments unused). MULTI: grid
        # (row blocks, Hkv, chunks), M tokens, t the position of the first (_split_rows). NCH: the workspace's
        # chunk stride (>= the grid's chunk count).
        pdl.pdl_enter(PDL)  # before t, q and the new K/V: all written by the previous kernels
        t = _load_len(t_ptr, t_val, T_PTR)
        if MULTI:
            _split_rows(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, t, m_ptr, l_ptr, o_ptr,
                        M, G, D, HALF, NCH, HQ, stride_qr, stride_qh, stride_knr, stride_knh, stride_vnr, stride_vnh,
                        stride_kh, stride_kt, stride_vh, stride_vt, scale, softcap, window, ROPE, HAS_WIN, HAS_CAP,
                        TPP, BLOCK_G, BLOCK_D, BLOCK_H, CH, BN, SPLITS, LOOP)
        else:
            _split_one(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, t, m_ptr, l_ptr, o_ptr,
                       G, D, HALF, NCH, stride_qh, stride_knh, stride_vnh, stride_kh, stride_kt, stride_vh, stride_vt,
                       scale, softcap, window, T_IS_POS, ROPE, HAS_WIN, HAS_CAP, BLOCK_G, BLOCK_D, BLOCK_H,
                       CH, BN, SPLITS, LOOP)

    @triton.jit
    def _attn_merge_kernel(t_ptr, t_val, m_ptr, l_ptr, o_ptr, out_ptr, D, NCH, HQ, stride_or, stride_oh, window,
                           n_rows, T_PTR: tl.constexpr, T_IS_POS: tl.constexpr, MULTI: tl.constexpr,
                           HAS_WIN: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DM: tl.constexpr, CH: tl.constexpr,
                           BN: tl.constexpr, SPLITS: tl.constexpr, BLOCK_C: tl.constexpr, FRAG_PT: tl.constexpr,
                           PDL: tl.constexpr):
        # One program per (workspace head, BLOCK_DM columns): head hx = r * HQ + h of row r (MULTI; length
        # t + r + 1), else query head hx of the one token (length t, or t + 1 with T_IS_POS). Merges the chunks
        # the split kernel wrote (_chunks with the same length: the count of adaptive chunks is known only here).
        # FRAG_PT > 0 (MULTI): out is n_rows rows of HQ * D features in fragment order (codebook_layout).
        pdl.pdl_enter(PDL)
        hx = tl.program_id(0)
        ds = tl.program_id(1)
        t = _load_len(t_ptr, t_val, T_PTR)
        if MULTI:
            r = hx // HQ
            L = t + r + 1
            out_row = out_ptr + r * stride_or + (hx - r * HQ) * stride_oh
        else:
            L = t + 1 if T_IS_POS else t
            out_row = out_ptr + hx * stride_oh
        _, _, _, c0, c1 = _chunks(L, window, HAS_WIN, CH, BN, SPLITS)
        rd = ds * BLOCK_DM + tl.arange(0, BLOCK_DM)
        out = _merge_cols(m_ptr, l_ptr, o_ptr, hx, rd, c0, c1, NCH, BLOCK_D, BLOCK_DM, BLOCK_C, "")
        if FRAG_PT > 0:
            r = hx // HQ
            dst = out_ptr + frag_offset(r, (hx - r * HQ) * D + rd, n_rows, FRAG_PT)
        else:
            dst = out_row + rd
        tl.store(dst, out.to(tl.float16), mask=rd < D)


class AttnWorkspace(NamedTuple):
    """Scratch of the split-KV kernels (from ``attention_workspace``; allocate once, outside graph capture).

    m, l  fp32 [rows * Hq, NCH]            per (row r, query head h) at index r * Hq + h and chunk: the chunk's
                                           softmax max and sum
    o     fp32 [rows * Hq, NCH, BLOCK_D]   its unnormalized output
    """
    m: torch.Tensor
    l: torch.Tensor
    o: torch.Tensor


def attention_workspace(hq: int, d: int, t_max: int, device, *, hkv: int | None = None,
                        config: AttnConfig | str | None = None, rows: int = 1) -> AttnWorkspace:
    """Scratch buffers for `rows` rows (1: decode; the largest verify M) of split-KV attention.

    Sized for `config` (an AttnConfig or a name), else for choose_config(d, hq // hkv, t_max, hkv); without hkv,
    for the largest chunk count the chooser picks for any group size of hq heads. nch = the config's split programs
    per kv head (ceil(t_max / chunk), or with splits P at most P). Shapes: AttnWorkspace.
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows: expected a positive int, got {rows!r}")
    if isinstance(config, str) and config:
        config = named_config(config)
    if isinstance(config, AttnConfig):
        nch = n_chunks(config, t_max)
    elif hkv is not None:
        nch = n_chunks(choose_config(d, hq // hkv, t_max, hkv), t_max)
    else:
        nch = max(n_chunks(choose_config(d, g, t_max, hq // g), t_max) for g in range(1, hq + 1) if hq % g == 0)
    n = rows * hq
    return AttnWorkspace(torch.empty(n, nch, dtype=torch.float32, device=device),
                         torch.empty(n, nch, dtype=torch.float32, device=device),
                         torch.empty(n, nch, block_d(d), dtype=torch.float32, device=device))


def _check_heads(hq, d, device, k_cache, v_cache, scale, window, softcap):
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 3 or c.dtype != torch.float16:
            raise ValueError(f"{name}: expected float16 [Hkv, T_max, D]")
        if c.shape[2] != d or c.stride(2) != 1:
            raise ValueError(f"{name}: last dim must be D={d} and contiguous, got shape {tuple(c.shape)}")
        if c.device != device:
            raise ValueError(f"{name}: on {c.device}, q on {device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    hkv = k_cache.shape[0]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"q: {hq} query heads is not a multiple of {hkv} kv heads")
    if d < 1 or d > 256:
        raise ValueError(f"q: head dim {d} outside 1..256")
    if hq // hkv > 64:
        raise ValueError(f"q: group size {hq // hkv} > 64")
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale: expected a positive float, got {scale!r}")
    if window is not None and int(window) < 1:
        raise ValueError(f"window: expected a positive int or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: expected a positive float or None, got {softcap!r}")


def _check_out(out, shape, device):
    """The output buffer (allocated if None) after checking it."""
    if out is None:
        return torch.empty(shape, dtype=torch.float16, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != torch.float16 or out.stride(-1) != 1 or out.device != device:
        raise ValueError(f"out: expected float16 {list(shape)} on {device} with a contiguous last dim")
    return out


def _check_workspace(ws, n, nch, bd, cfg, hq):
    if not (isinstance(ws, tuple) and len(ws) == 3):
        raise ValueError("workspace: expected the AttnWorkspace of attention_workspace()")
    m, l, o = ws
    if (m.dim() != 2 or m.shape[0] < n or m.shape[0] % hq or m.shape[1] < nch or l.shape != m.shape
            or o.shape != (*m.shape, bd) or not (m.is_contiguous() and l.is_contiguous() and o.is_contiguous())):
        raise ValueError(f"workspace: shapes {tuple(m.shape)}, {tuple(l.shape)}, {tuple(o.shape)} too small "
                         f"for {cfg.name} and {n // hq} rows ([>={n}, >={nch}], [>={n}, >={nch}, {bd}] contiguous)")


def _merge_block_c(cfg: AttnConfig, nch: int) -> int:
    """Chunks per merge step: the config's merge_chunks, capped at the chunk count (at least 16)."""
    return min(cfg.merge_chunks, max(16, 1 << (nch - 1).bit_length()))


def _launch(q3, rope, k_cache, v_cache, t, *, t_is_pos, scale, window, softcap, out3, workspace, config, kopts,
            frag_pt=0):
    """The split kernel and the merge kernel for rows q3 [M, Hq, D] into out3 [M, Hq, D]. t: the attention length
    (M = 1, not t_is_pos), or the position of row 0; rope = (k3, v3, cos, sin) of the new rows (fused) or None.
    frag_pt > 0 (M > 1, out3 contiguous): out3 holds the rows in fragment order (codebook_layout)."""
    rows, hq, d = q3.shape
    hkv, tmax, _ = k_cache.shape
    g = hq // hkv
    cfg = resolve_config(config, d, g, tmax, hkv)
    nch = n_chunks(cfg, tmax)
    bd = block_d(d)
    ws = workspace if workspace is not None else attention_workspace(hq, d, tmax, q3.device, config=cfg, rows=rows)
    _check_workspace(ws, rows * hq, nch, bd, cfg, hq)
    multi = rows > 1
    tpp = max(1, 16 // g)
    k3, v3, cos, sin = rope if rope is not None else (q3, q3, ws.m, ws.m)  # unused pointers without rope
    half = cos.shape[1] if rope is not None else 1
    is_t = isinstance(t, torch.Tensor)
    t_ptr, t_val = (t, 0) if is_t else (out3, int(t))  # dummy pointer when unused
    row_strides = (q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1))
    if not multi:  # unused by the decode program: zeros, so that they do not multiply the specializations
        row_strides = (0, q3.stride(1), 0, k3.stride(1), 0, v3.stride(1))
    grid = (triton.cdiv(rows, tpp), hkv, nch) if multi else (hkv, nch)
    common = dict(T_PTR=is_t, T_IS_POS=t_is_pos, MULTI=multi, HAS_WIN=window is not None, BLOCK_D=bd, CH=cfg.chunk,
                  BN=cfg.block_n, SPLITS=cfg.splits, **pdl.launch_kwargs(q3.device, kopts))
    win = int(window) if window is not None else 0
    _attn_split_kernel[grid](q3, k3, v3, k_cache, v_cache, cos, sin, t_ptr, t_val, ws.m, ws.l, ws.o,
                             rows if multi else 1, g, d, half, ws.m.shape[1], hq, *row_strides,
                             k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                             float(scale), float(softcap) if softcap is not None else 1.0, win,
                             ROPE=rope is not None, TPP=tpp if multi else 1, HAS_CAP=softcap is not None,
                             BLOCK_G=block_g(g), BLOCK_H=triton.next_power_of_2(half), LOOP=loops(cfg),
                             num_warps=cfg.warps, num_stages=cfg.stages, **common)
    bdm = min(cfg.merge_d, bd) if cfg.merge_d else bd
    _attn_merge_kernel[(rows * hq, bd // bdm)](t_ptr, t_val, ws.m, ws.l, ws.o, out3, d, ws.m.shape[1], hq,
                                               out3.stride(0) if multi else 0, out3.stride(1), win, rows,
                                               BLOCK_DM=bdm, BLOCK_C=_merge_block_c(cfg, nch), FRAG_PT=frag_pt,
                                               num_warps=cfg.merge_warps, **common)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length, *,
                     scale: float, window: int | None = None, softcap: float | None = None,
                     out: torch.Tensor | None = None, workspace: AttnWorkspace | None = None,
                     config: AttnConfig | str | None = None, kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """Attention of one (already roped) query token over the first `length` cache positions. Returns fp16 [Hq, D].

    workspace: an ``attention_workspace`` so that a captured step allocates nothing (sized for the config used).
    config: an AttnConfig or a candidate's name; None -> choose_config(D, G, T_max, Hkv). A config that breaks the
    static rule (config_fits) raises ValueError.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype != torch.float16 or q.stride(1) != 1:
        raise ValueError(f"q: expected float16 [Hq, D] with a contiguous last dim, got {getattr(q, 'dtype', None)} "
                         f"{tuple(getattr(q, 'shape', ()))}")
    _check_heads(q.shape[0], q.shape[1], q.device, k_cache, v_cache, scale, window, softcap)
    if isinstance(length, torch.Tensor):
        if length.numel() != 1 or length.dtype not in (torch.int32, torch.int64) or length.device != q.device:
            raise ValueError("length: expected an int or a one-element int32/int64 tensor on q's device")
    elif not (1 <= int(length) <= k_cache.shape[1]):
        raise ValueError(f"length: {length} outside 1..{k_cache.shape[1]}")
    out = _check_out(out, q.shape, q.device)
    if not triton_ok(q.device):
        resolve_config(config, q.shape[1], q.shape[0] // k_cache.shape[0], k_cache.shape[1], k_cache.shape[0])
        r = decode_attention_torch(q, k_cache, v_cache, length, scale=scale, window=window,
                                   softcap=softcap, dtype=torch.float32)
        return out.copy_(r)
    _launch(q[None], None, k_cache, v_cache, length, t_is_pos=False, scale=scale, window=window, softcap=softcap,
            out3=out[None], workspace=workspace, config=config, kopts=kopts)
    return out


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   pos, cos: torch.Tensor, sin: torch.Tensor, *, scale: float, window: int | None = None,
                   softcap: float | None = None, out: torch.Tensor | None = None,
                   workspace: AttnWorkspace | None = None, config: AttnConfig | str | None = None,
                   fused: bool = True, frag_bits: int | None = None,
                   kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor | Fragments:
    """M new tokens of one sequence at positions pos .. pos + M - 1: RoPE, KV-cache append and causal attention.
    Returns out fp16 [M, Hq, D]; with frag_bits (4 or 8; fused, M >= 2), ``Fragments`` of out viewed [M, Hq * D]
    in the fragment order of a GEMV of those bits (codebook_layout: the same values at other addresses).

    q [M, Hq, D], k, v [M, Hkv, D] un-roped (views with a contiguous last dim); caches [Hkv, T_max, D]; cos/sin
    fp32 [max_pos, rot/2] (partial rotary: rot < D); pos an int or a one-element int tensor (graph-capturable).
    Row r's k, v go to cache slot pos + r; out[r] attends to positions [lo_r, pos + r].
    Contract (module docstring): out[r] and the caches are bitwise what M successive calls at pos, ..., pos + M - 1
    give (M = 1: the decode launch itself); fused=False (per row: rope_kv_append, which rotates q in place, then the
    split kernel without RoPE, then the merge) gives the same bits as its own successive calls (within an fp16
    ulp of the fused kernel's); fused=True leaves q untouched.
    workspace: attention_workspace(..., rows >= M); config as decode_attention; kopts: the PDL choice.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name}: expected rows [M, H, D], got {tuple(getattr(x, 'shape', ()))}")
    check_rope_kv(q, k, v, k_cache, v_cache, pos, cos, sin)
    rows, hq, d = q.shape
    _check_heads(hq, d, q.device, k_cache, v_cache, scale, window, softcap)
    if not isinstance(fused, bool):
        raise ValueError(f"fused: expected a bool, got {fused!r}")
    out = _check_out(out, q.shape, q.device)
    pt = 0
    if frag_bits is not None:
        pt = frag_pieces(frag_bits)
        if not fused or rows < 2 or (hq * d) % (32 * pt) or not out.is_contiguous():
            raise ValueError(f"frag_bits: fragment order needs the fused kernel, 2 or more rows, a contiguous out "
                             f"and Hq * D % {32 * pt} == 0")
    if not triton_ok(q.device):  # row by row through the torch path: exact by construction
        resolve_config(config, d, hq // k.shape[1], k_cache.shape[1], k.shape[1])
        p0 = int(pos)
        qr = q.clone() if fused else q
        for r in range(rows):
            rope_kv_append(qr[r], k[r], v[r], k_cache, v_cache, p0 + r, cos, sin)
            out[r].copy_(decode_attention_torch(qr[r], k_cache, v_cache, p0 + r + 1, scale=scale, window=window,
                                                softcap=softcap, dtype=torch.float32))
        if pt:
            flat = out.view(rows, hq * d)
            flat.copy_(to_fragments(flat.clone(), frag_bits))
            return Fragments(flat, frag_bits)
        return out
    kw = dict(t_is_pos=True, scale=scale, window=window, softcap=softcap, out3=out, workspace=workspace,
              config=config, kopts=kopts)
    if fused:
        _launch(q, (k, v, cos.contiguous(), sin.contiguous()), k_cache, v_cache, pos, frag_pt=pt, **kw)
        if pt:
            return Fragments(out.view(rows, hq * d), frag_bits)
    elif rows > 1:
        # The unfused kill switch runs its rows one after another through its one-row launches: exact by
        # construction. (Its multi-row launch differed from successive calls by an fp16 ulp on the H200 at real
        # head shapes, where the fused one is bitwise equal; NOTES-engine.md.)
        for r in range(rows):
            attention_rows(q[r:r + 1], k[r:r + 1], v[r:r + 1], k_cache, v_cache, pos + r, cos, sin, scale=scale,
                           window=window, softcap=softcap, out=out[r:r + 1], workspace=workspace, config=config,
                           fused=False, kopts=kopts)
    else:
        rope_kv_append(q, k, v, k_cache, v_cache, pos, cos, sin, kopts=kopts)
        _launch(q, None, k_cache, v_cache, pos, **kw)
    return out


def decode_attention_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, pos, cos: torch.Tensor, sin: torch.Tensor, *, scale: float,
                           window: int | None = None, softcap: float | None = None,
                           out: torch.Tensor | None = None, workspace: AttnWorkspace | None = None,
                           config: AttnConfig | str | None = None, fused: bool = True,
                           kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """One new token's RoPE, KV-cache append and attention (the decode step's path): attention_rows with M = 1.
    q [Hq, D], k, v [Hkv, D]; returns fp16 [Hq, D]. The same as ``rope_kv_append(q, k, v, k_cache, v_cache, pos,
    cos, sin)`` followed by ``decode_attention(q, k_cache, v_cache, pos + 1, ...)`` (the same bits in the caches; q
    itself is not modified with fused=True: each program rotates it in registers)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"{name}: expected one token [H, D], got {tuple(getattr(x, 'shape', ()))}")
    out = _check_out(out, q.shape, q.device)
    attention_rows(q[None], k[None], v[None], k_cache, v_cache, pos, cos, sin, scale=scale, window=window,
                   softcap=softcap, out=out[None], workspace=workspace, config=config, fused=fused, kopts=kopts)
    return out
