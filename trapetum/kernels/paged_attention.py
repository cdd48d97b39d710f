"""Decode attention through block tables (a paged KV cache, batched serving): one new row for each of S
sequences in one launch, each over its own blocks and its own length; its torch form and the float64 reference.

Layouts: q fp16 [S, Hq, D] (already rotated; its new k / v rows already in the blocks), Hq = G * Hkv, query head h
reads kv head h // G; k_blocks, v_blocks fp16 [num_blocks, Hkv, BS, D] (one layer of runtime/paged_kv.PagedKV,
last dim contiguous, BS >= 16 a power of two); tables int32 [S, W] (each sequence's block ids in position order;
entries past its blocks are never read); lens int32 [S] (each sequence's length, its new row included). Row s
attends to positions [lo, L) of its sequence, lo = max(0, L - window) with a window; s = scale q.k, with softcap
c: c tanh(s / c); softmax; out fp16 [S, Hq * D].

Split-KV: chunk c of sequence s covers positions [c CH, (c + 1) CH), CH = NB * BS (NB whole blocks), one block at
a time with an online softmax (finite _NEG as minus infinity; positions outside [lo, L) masked, their K/V loaded
as 0, so stale or NaN contents of a block are never used), for the G query heads of its kv head (BLOCK_G =
max(16, G) rows of one tl.dot tile), and writes (max, sum, unnormalized out) to the workspace. Program (s, kv
head, c) computes chunk c, c < C; programs whose chunk holds no visible position exit. C = ``max_chunks`` (at least
ceil(L / CH) of every row: the caller's bound, e.g. a power of two over the longest row of a step, so that a wide
table does not launch thousands of programs that only exit; default: the table's width W BS / CH); C changes no
bit (it changes only which programs exist and exit). The merge program (s, query head) folds chunks
lo // CH .. ceil(L / CH) - 1 in ascending order.

RoPE + KV write (``paged_rope_append``, the launch before the attention): per row s at its own position p (int64
[S]), q rotated in place and k rotated into slot p % BS of block tables[s, p // BS], v copied there; rotate-half
over the first 2 HALF features (cos/sin fp32 [max_pos, HALF], the engine's tables), in fp32 rounded to fp16 with
fused.rope_kv_append's expressions (the engine's prefill and unfused RoPE; the k rows through the same
fused.rope_append_kv helper), so a row's bits depend on that row alone. Several rows of one sequence at
consecutive positions (a replay) write their K/V in this launch, before the attention launch reads any of them.

Contract (tests/test_paged_attention.py): row s is a function of its own q row, its blocks' contents and its
length only: bitwise the same in any batch, at any batch position, whatever the other lengths, the table width W
(the grid's chunk count) and where its blocks lie. No program reads another sequence's data, the chunking depends
on the length alone, and every program runs the same tile shapes.
"""
from __future__ import annotations

import torch

from .codebook_layout import Fragments, frag_pieces, to_fragments
from .triton_util import HAVE_TRITON, triton_ok

if HAVE_TRITON:
    import triton
    import triton.language as tl

_NEG = tl.constexpr(-1.0e30) if HAVE_TRITON else -1.0e30
CHUNK_BLOCKS = 4  # blocks per split-KV chunk (NB)


def paged_attention_torch(q, k_blocks, v_blocks, tables, lens, *, scale, window=None, softcap=None,
                          dtype=torch.float32):
    """Row by row in ``dtype`` (float64: the reference): [S, Hq * D] in ``dtype``."""
    S, Hq, D = q.shape
    _, Hkv, BS, _ = k_blocks.shape
    out = []
    for s in range(S):
        L = int(lens[s])
        nb = (L + BS - 1) // BS
        ids = tables[s, :nb].long()
        k = k_blocks[ids].transpose(0, 1).reshape(Hkv, nb * BS, D)[:, :L].to(dtype)
        v = v_blocks[ids].transpose(0, 1).reshape(Hkv, nb * BS, D)[:, :L].to(dtype)
        lo = max(0, L - window) if window else 0
        k, v = k[:, lo:].repeat_interleave(Hq // Hkv, 0), v[:, lo:].repeat_interleave(Hq // Hkv, 0)
        sc = (k @ q[s].to(dtype)[:, :, None])[..., 0] * scale  # [Hq, L - lo]
        if softcap is not None:
            sc = softcap * torch.tanh(sc / softcap)
        out.append((torch.softmax(sc, -1)[:, None, :] @ v)[:, 0].reshape(-1))
    return torch.stack(out)


def paged_rope_append_reference(q, k, v, k_blocks, v_blocks, tables, positions, cos, sin):
    """float64 reference of ``paged_rope_append``: (q rotated, k_blocks, v_blocks) float64, the blocks with every
    row's rotated k / its v at the row's slot (rows in order; later rows win a slot written twice)."""
    half = cos.shape[1]

    def rot(x, p):
        x = x.double().clone()
        c, s = cos[p].double(), sin[p].double()
        x1, x2 = x[..., :half].clone(), x[..., half:2 * half].clone()
        x[..., :half], x[..., half:2 * half] = x1 * c - x2 * s, x2 * c + x1 * s
        return x

    bs = k_blocks.shape[2]
    qo, kb, vb = q.double().clone(), k_blocks.double().clone(), v_blocks.double().clone()
    for r in range(q.shape[0]):
        p = int(positions[r])
        blk = int(tables[r, p // bs])
        qo[r] = rot(q[r], p)
        kb[blk, :, p % bs] = rot(k[r], p)
        vb[blk, :, p % bs] = v[r].double()
    return qo, kb, vb


def paged_rope_append_torch(q, k, v, k_blocks, v_blocks, tables, positions, cos, sin):
    """The torch form of ``paged_rope_append`` (no Triton on the device): fp32, rounded to fp16, in place."""
    half = cos.shape[1]
    pos = positions.long()
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    bs = k_blocks.shape[2]
    blk = tables.gather(1, (pos // bs).view(-1, 1).to(tables.device)).view(-1).long()
    off = pos % bs

    def rot(x):
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:2 * half]
        out = x.clone()
        out[..., :half] = (x1 * c - x2 * s).to(x.dtype)
        out[..., half:2 * half] = (x2 * c + x1 * s).to(x.dtype)
        return out

    q.copy_(rot(q))
    k_blocks[blk, :, off] = rot(k).to(k_blocks.dtype)
    v_blocks[blk, :, off] = v.to(v_blocks.dtype)
    return q


def paged_attention_reference(q, k_blocks, v_blocks, tables, lens, *, scale, window=None, softcap=None):
    """float64 reference: [S, Hq * D] float64."""
    return paged_attention_torch(q, k_blocks, v_blocks, tables, lens, scale=scale, window=window, softcap=softcap,
                                 dtype=torch.float64)


if HAVE_TRITON:
    from .codebook_layout import frag_offset
    from .fused import rope_append_kv, rope_rotate

    @triton.jit
    def _tanh(x):  # as attention.py's (kept here: imported from there, the interpreter did not resolve it)
        x = tl.minimum(tl.maximum(x, -15.0), 15.0)
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _paged_rope_kv(q_ptr, k_ptr, v_ptr, kb_ptr, vb_ptr, tab_ptr, pos_ptr, cos_ptr, sin_ptr, HQ, D, HALF,
                       sq_s, sq_h, sk_s, sk_h, sv_s, sv_h, skb_b, skb_h, skb_t, svb_b, svb_h, svb_t, stride_tab,
                       BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        # program (row s, head h): h < HQ rotates q head h in place, else kv head h - HQ goes into the blocks
        s = tl.program_id(0)
        h = tl.program_id(1)
        p = tl.load(pos_ptr + s).to(tl.int32)
        ri = tl.arange(0, BLOCK_H)
        hm = ri < HALF
        c = tl.load(cos_ptr + p * HALF + ri, mask=hm, other=1.0)
        sn = tl.load(sin_ptr + p * HALF + ri, mask=hm, other=0.0)
        if h < HQ:
            base = q_ptr + s * sq_s + h * sq_h
            rope_rotate(base, base, c, sn, HALF, BLOCK_H)
        else:
            kh = h - HQ
            blk = tl.load(tab_ptr + s * stride_tab + p // BS).to(tl.int64)
            off = p % BS
            rope_append_kv(k_ptr + s * sk_s + kh * sk_h, v_ptr + s * sv_s + kh * sv_h,
                           kb_ptr + blk * skb_b + kh * skb_h + off * skb_t,
                           vb_ptr + blk * svb_b + kh * svb_h + off * svb_t, c, sn, HALF, D, BLOCK_H, BLOCK_D)

    @triton.jit
    def _paged_split(q_ptr, k_ptr, v_ptr, tab_ptr, len_ptr, m_ptr, l_ptr, o_ptr, G, D, HQ, NCH,
                     stride_qs, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                     stride_tab, scale, softcap, window, HAS_WIN: tl.constexpr, HAS_CAP: tl.constexpr,
                     BS: tl.constexpr, NB: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        s = tl.program_id(0)
        hk = tl.program_id(1)
        c = tl.program_id(2)
        L = tl.load(len_ptr + s)
        lo = 0
        if HAS_WIN:
            lo = tl.maximum(L - window, 0)
        p0 = c * (NB * BS)
        if (p0 < L) & (p0 + NB * BS > lo):
            rg = tl.arange(0, BLOCK_G)
            rd = tl.arange(0, BLOCK_D)
            rt = tl.arange(0, BS)
            hq = hk * G + rg
            gmask = rg < G
            dmask = rd < D
            q = tl.load(q_ptr + s * stride_qs + hq[:, None] * stride_qh + rd[None, :],
                        mask=gmask[:, None] & dmask[None, :], other=0.0)
            m = tl.full([BLOCK_G], _NEG, tl.float32)
            l = tl.zeros([BLOCK_G], tl.float32)
            o = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            for b in tl.static_range(NB):
                p = p0 + b * BS
                blk = tl.load(tab_ptr + s * stride_tab + p // BS, mask=p < L, other=0).to(tl.int64)
                pos = p + rt
                valid = (pos < L) & (pos >= lo)
                kt = tl.load(k_ptr + blk * stride_kb + hk * stride_kh + rt[:, None] * stride_kt + rd[None, :],
                             mask=valid[:, None] & dmask[None, :], other=0.0)
                vt = tl.load(v_ptr + blk * stride_vb + hk * stride_vh + rt[:, None] * stride_vt + rd[None, :],
                             mask=valid[:, None] & dmask[None, :], other=0.0)
                sc = tl.dot(q, tl.trans(kt)) * scale  # [BG, BS] fp32
                if HAS_CAP:
                    sc = softcap * _tanh(sc / softcap)
                sc = tl.where(valid[None, :], sc, _NEG)
                m_new = tl.maximum(m, tl.max(sc, 1))
                alpha = tl.exp(m - m_new)
                pr = tl.where(valid[None, :], tl.exp(sc - m_new[:, None]), 0.0)
                l = l * alpha + tl.sum(pr, 1)
                o = o * alpha[:, None] + tl.dot(pr.to(tl.float16), vt)
                m = m_new
            idx = (s * HQ + hq) * NCH + c
            tl.store(m_ptr + idx, m, mask=gmask)
            tl.store(l_ptr + idx, l, mask=gmask)
            tl.store(o_ptr + idx[:, None] * BLOCK_D + rd[None, :], o, mask=gmask[:, None])

    @triton.jit(do_not_specialize=("S",))  # the row count: one compiled merge whatever the batch
    def _paged_merge(len_ptr, m_ptr, l_ptr, o_ptr, out_ptr, D, HQ, NCH, stride_os, window, S,
                     HAS_WIN: tl.constexpr, CH: tl.constexpr, BLOCK_D: tl.constexpr, FRAG_PT: tl.constexpr):
        # FRAG_PT > 0: out is the S rows [S, HQ D] in the fragment order of that many pieces (codebook_layout)
        s = tl.program_id(0)
        h = tl.program_id(1)
        L = tl.load(len_ptr + s)
        lo = 0
        if HAS_WIN:
            lo = tl.maximum(L - window, 0)
        rd = tl.arange(0, BLOCK_D)
        base = (s * HQ + h) * NCH
        mt = tl.full([1], _NEG, tl.float32)
        lt = tl.zeros([1], tl.float32)
        ot = tl.zeros([BLOCK_D], tl.float32)
        for c in range(lo // CH, (L + CH - 1) // CH):
            mc = tl.load(m_ptr + base + c + tl.zeros([1], tl.int32))
            lc = tl.load(l_ptr + base + c + tl.zeros([1], tl.int32))
            oc = tl.load(o_ptr + (base + c) * BLOCK_D + rd)
            mn = tl.maximum(mt, mc)
            a = tl.exp(mt - mn)
            bb = tl.exp(mc - mn)
            lt = lt * a + lc * bb
            ot = ot * a + oc * bb
            mt = mn
        if FRAG_PT > 0:
            dst = out_ptr + frag_offset(s, h * D + rd, S, FRAG_PT)
        else:
            dst = out_ptr + s * stride_os + h * D + rd
        tl.store(dst, (ot / lt).to(tl.float16), mask=rd < D)


def _block(n: int) -> int:
    return max(16, 1 << (int(n) - 1).bit_length())


def paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, tables: torch.Tensor,
                    lens: torch.Tensor, *, scale: float, window: int | None = None, softcap: float | None = None,
                    out: torch.Tensor | None = None, chunk_blocks: int = CHUNK_BLOCKS,
                    max_chunks: int | None = None, frag_bits: int | None = None) -> torch.Tensor | Fragments:
    """Module docstring; returns out fp16 [S, Hq * D]. max_chunks: C, the split grid's chunks per (row, kv head)
    (None: all of the table's; a C below some row's ceil(L / CH) is the caller's error, not checked: lens may be
    on the device). frag_bits (4 or 8): ``Fragments`` of out in the fragment order of the GEMV of those bits that
    reads it (the same values at other addresses; out contiguous, Hq D % (32 pieces) == 0). Without Triton on q's
    device: the torch form in fp32, rounded to fp16 (rows independent too)."""
    S, Hq, D = q.shape
    NBLK, Hkv, BS, Dk = k_blocks.shape
    if Dk != D or tuple(v_blocks.shape) != tuple(k_blocks.shape) or Hq % Hkv:
        raise ValueError(f"paged attention: q {tuple(q.shape)} does not match blocks {tuple(k_blocks.shape)} / "
                         f"{tuple(v_blocks.shape)}")
    if tables.dim() != 2 or tables.shape[0] != S or lens.shape != (S,):
        raise ValueError(f"paged attention: tables [S, W] and lens [S] for S = {S}, got {tuple(tables.shape)}, "
                         f"{tuple(lens.shape)}")
    if BS < 16 or BS & (BS - 1):
        raise ValueError(f"paged attention: the block size must be a power of two >= 16, got {BS}")
    if out is None:
        out = torch.empty(S, Hq * D, dtype=torch.float16, device=q.device)
    pt = 0
    if frag_bits is not None:
        pt = frag_pieces(frag_bits)
        if (Hq * D) % (32 * pt) or not out.is_contiguous():
            raise ValueError(f"paged attention: fragment order needs a contiguous out and Hq * D % {32 * pt} == 0")
    if S == 0:
        return out
    if not triton_ok(q.device):
        out.copy_(paged_attention_torch(q, k_blocks, v_blocks, tables, lens, scale=scale, window=window,
                                        softcap=softcap).to(torch.float16))
        if pt:
            out.copy_(to_fragments(out.clone(), frag_bits))
            return Fragments(out, frag_bits)
        return out
    G = Hq // Hkv
    bd = _block(D)
    ch = chunk_blocks * BS
    nch = (tables.shape[1] * BS + ch - 1) // ch
    m = torch.empty(S * Hq * nch, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    o = torch.empty(S * Hq * nch, bd, dtype=torch.float32, device=q.device)
    win = int(window) if window else 0
    cap = float(softcap) if softcap is not None else 1.0
    grid_c = nch if max_chunks is None else max(1, min(int(max_chunks), nch))
    _paged_split[(S, Hkv, grid_c)](q, k_blocks, v_blocks, tables, lens, m, l, o, G, D, Hq, nch,
                                q.stride(0), q.stride(1), k_blocks.stride(0), k_blocks.stride(1), k_blocks.stride(2),
                                v_blocks.stride(0), v_blocks.stride(1), v_blocks.stride(2), tables.stride(0),
                                float(scale), cap, win, HAS_WIN=bool(window), HAS_CAP=softcap is not None,
                                BS=BS, NB=chunk_blocks, BLOCK_G=_block(G), BLOCK_D=bd)
    _paged_merge[(S, Hq)](lens, m, l, o, out, D, Hq, nch, out.stride(0), win, S, HAS_WIN=bool(window), CH=ch,
                          BLOCK_D=bd, FRAG_PT=pt)
    return Fragments(out, frag_bits) if pt else out


def paged_rope_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_blocks: torch.Tensor,
                      v_blocks: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    """RoPE + KV write of S rows in one launch (module docstring): q fp16 [S, Hq, D] rotated in place; k, v fp16
    [S, Hkv, D] (views with a contiguous last dim, e.g. of the q/k/v GEMV output); blocks and tables as
    ``paged_attention``; positions int64 [S] on the device (row s's position p: block tables[s, p // BS] must be
    its own); cos, sin fp32 [max_pos, HALF], 2 HALF <= D. Returns q. Without Triton on q's device: the torch form."""
    S, Hq, D = q.shape
    NBLK, Hkv, BS, Dk = k_blocks.shape
    if (tuple(k.shape) != (S, Hkv, D) or tuple(v.shape) != (S, Hkv, D) or Dk != D
            or tuple(v_blocks.shape) != tuple(k_blocks.shape) or Hq % Hkv):
        raise ValueError(f"paged rope append: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                         f"match blocks {tuple(k_blocks.shape)} / {tuple(v_blocks.shape)}")
    if any(t.dtype != torch.float16 or t.stride(-1) != 1 for t in (q, k, v, k_blocks, v_blocks)):
        raise ValueError("paged rope append: q, k, v and the blocks must be float16 with a contiguous last dim")
    if tables.dim() != 2 or tables.shape[0] != S or positions.shape != (S,):
        raise ValueError(f"paged rope append: tables [S, W] and positions [S] for S = {S}, got "
                         f"{tuple(tables.shape)}, {tuple(positions.shape)}")
    half = cos.shape[1]
    if cos.dtype != torch.float32 or sin.shape != cos.shape or sin.dtype != torch.float32 or not 1 <= 2 * half <= D:
        raise ValueError(f"paged rope append: cos/sin fp32 [max_pos, HALF] with 2 HALF <= {D}, got "
                         f"{tuple(cos.shape)} {cos.dtype} / {tuple(sin.shape)} {sin.dtype}")
    if S == 0:
        return q
    if not triton_ok(q.device):
        return paged_rope_append_torch(q, k, v, k_blocks, v_blocks, tables, positions, cos, sin)
    _paged_rope_kv[(S, Hq + Hkv)](q, k, v, k_blocks, v_blocks, tables, positions, cos.contiguous(), sin.contiguous(),
                                  Hq, D, half, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                                  v.stride(1), k_blocks.stride(0), k_blocks.stride(1), k_blocks.stride(2),
                                  v_blocks.stride(0), v_blocks.stride(1), v_blocks.stride(2), tables.stride(0),
                                  BS=BS, BLOCK_H=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(D),
                                  num_warps=1)
    return q
