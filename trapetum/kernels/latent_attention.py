"""Absorbed multi-head latent attention for DECODE / VERIFY rows (DeepSeek-V2/V3, models/blocks/mla.py), over the
compressed latent cache: per position the normalized latent c [R] (kv_lora_rank) and the rotated shared key k_rot
[P] (qk_rope_head_dim), R + P values (576 for DeepSeek) instead of 2 x H x head_dim.

With kv_b's rows per head h split as W_uk[h] [nope, R] (keys) and W_uv[h] [vd, R] (values):
    q_lat[m, h] = W_uk[h]^T q_nope[m, h]                              ``head_gemv(q_nope, W_uk^T)``   [M, H, R]
    s[m, h, t]  = scale * (q_lat[m, h] . c_t + q_rot[m, h] . k_rot_t)    t < start + m + 1 (causal)
    o[m, h]     = sum_t softmax_t(s) c_t                              ``latent_attention``            [M, H, R]
    a[m, h]     = W_uv[h] o[m, h]                                     ``head_gemv(o, W_uv)``          [M, H, vd]
the same as attending with k_h = [W_uk[h] c, k_rot], v_h = W_uv[h] c (exact arithmetic).

Layouts: cache fp16 [T_max, R + P] (row t = [c_t, k_rot_t], rows >= the length never read); q_lat fp16 [M, H, R],
q_rot fp16 [M, H, P] (rotated); ``start`` an int tensor [1] on the device (the graph's position) or an int.
Any R, P (padded to powers of two in registers: R = 512 is one [16, 512] fp32 accumulator per program) and any H
(16 heads per program, a grid over head blocks: 128 heads per latent are 8 programs per row and split).

Split-KV, deterministic: row m's positions [0, L), L = start + m + 1, are cut into chunks of CHUNK positions
(a constant: never from M or the other rows); one program per (head block, row, chunk) writes its chunk's
unnormalized sum, max and denominator (fp32), empty chunks write (0, -inf, 0); the merge kernel combines the chunks
of a row in ascending order. Row m's result is bitwise that of a one-row call at start + m (the VERIFY contract;
tested). Triton (CUDA, or the CPU under TRITON_INTERPRET=1); where Triton cannot run, a torch fallback computes
each row on its own in fp32 (the same contracts; it reads the start on the host). float64 references beside each
kernel.
"""
from __future__ import annotations

import torch

from .triton_util import HAVE_TRITON, triton_ok

if HAVE_TRITON:
    import triton
    import triton.language as tl

CHUNK = 64  # positions per split program
BH = 16  # heads per program (the tl.dot's M dimension)


def available(device: torch.device) -> bool:
    return triton_ok(device)


# ----------------------------------------------------------------------------- float64 references
def latent_attention_reference(q_lat, q_rot, cache, start: int, scale: float) -> torch.Tensor:
    """float64 o [M, H, R] (module docstring)."""
    M, H, R = q_lat.shape
    c, kr = cache[:, :R].double(), cache[:, R:].double()
    out = torch.empty(M, H, R, dtype=torch.float64, device=q_lat.device)
    for m in range(M):
        L = int(start) + m + 1
        s = (q_lat[m].double() @ c[:L].T + q_rot[m].double() @ kr[:L].T) * scale  # [H, L]
        out[m] = torch.softmax(s, -1) @ c[:L]
    return out


def head_gemv_reference(x, w) -> torch.Tensor:
    """float64 y [M, H, N] = w[h] [N, K] @ x[m, h] [K]."""
    return torch.einsum("hnk,mhk->mhn", w.double(), x.double())


# ----------------------------------------------------------------------------- triton kernels
if HAVE_TRITON:

    @triton.jit(do_not_specialize=("ql_ptr", "qr_ptr", "part_ptr", "ml_ptr"))
    def _split_kernel(ql_ptr, qr_ptr, cache_ptr, start_ptr, part_ptr, ml_ptr, H, R, P, NS, stride_t, scale,
                      CH: tl.constexpr, BLOCK_H: tl.constexpr, BT: tl.constexpr, RP: tl.constexpr,
                      PP: tl.constexpr):
        hb = tl.program_id(0)
        m = tl.program_id(1)
        s = tl.program_id(2)
        L = tl.load(start_ptr) + m + 1
        t0 = s * CH
        end = tl.minimum(t0 + CH, L)
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        rr = tl.arange(0, RP)
        rmask = rr < R
        pp = tl.arange(0, PP)
        pmask = pp < P
        rows = m * H + heads
        ql = tl.load(ql_ptr + rows[:, None] * R + rr[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
        qr = tl.load(qr_ptr + rows[:, None] * P + pp[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
        mi = tl.full([BLOCK_H], float("-inf"), tl.float32)
        li = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, RP], dtype=tl.float32)
        for t in range(t0, end, BT):
            tt = t + tl.arange(0, BT)
            tmask = tt < end
            c = tl.load(cache_ptr + tt[:, None] * stride_t + rr[None, :], mask=tmask[:, None] & rmask[None, :],
                        other=0.0)
            kr = tl.load(cache_ptr + tt[:, None] * stride_t + R + pp[None, :], mask=tmask[:, None] & pmask[None, :],
                         other=0.0)
            sc = tl.dot(ql, tl.trans(c)) + tl.dot(qr, tl.trans(kr))  # [BLOCK_H, BT] fp32
            sc = tl.where(tmask[None, :], sc * scale, float("-inf"))
            mn = tl.maximum(mi, tl.max(sc, 1))
            alpha = tl.exp(mi - mn)
            p = tl.exp(sc - mn[:, None])
            li = li * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), c)
            mi = mn
        base = (m * NS + s) * H + heads
        tl.store(part_ptr + base[:, None] * R + rr[None, :], acc, mask=hmask[:, None] & rmask[None, :])
        tl.store(ml_ptr + base * 2, mi, mask=hmask)
        tl.store(ml_ptr + base * 2 + 1, li, mask=hmask)

    @triton.jit(do_not_specialize=("part_ptr", "ml_ptr", "o_ptr"))
    def _merge_kernel(part_ptr, ml_ptr, start_ptr, o_ptr, H, R, NS, CH: tl.constexpr, RP: tl.constexpr):
        h = tl.program_id(0)
        m = tl.program_id(1)
        L = tl.load(start_ptr) + m + 1
        n = (L + CH - 1) // CH
        rr = tl.arange(0, RP)
        rmask = rr < R
        mx = tl.full([1], float("-inf"), tl.float32)
        den = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([RP], dtype=tl.float32)
        for s in range(0, n):
            base = (m * NS + s) * H + h
            ms = tl.load(ml_ptr + base * 2 + tl.arange(0, 1))
            ls = tl.load(ml_ptr + base * 2 + 1 + tl.arange(0, 1))
            a = tl.load(part_ptr + base * R + rr, mask=rmask, other=0.0)
            mn = tl.maximum(mx, ms)
            al = tl.exp(mx - mn)
            be = tl.exp(ms - mn)
            acc = acc * al + a * be
            den = den * al + ls * be
            mx = mn
        tl.store(o_ptr + (m * H + h) * R + rr, (acc / den).to(tl.float16), mask=rmask)

    @triton.jit(do_not_specialize=("x_ptr", "y_ptr"))
    def _head_gemv_kernel(x_ptr, w_ptr, y_ptr, H, N, K, stride_xm, stride_xh, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        h = tl.program_id(1)
        m = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            w = tl.load(w_ptr + (h * N + rn)[:, None] * K + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + m * stride_xm + h * stride_xh + rk, mask=kmask, other=0.0).to(tl.float32)
            acc += tl.sum(w * xv[None, :], axis=1)
        tl.store(y_ptr + (m * H + h) * N + rn, acc.to(tl.float16), mask=nmask)


if HAVE_TRITON:

    @triton.jit(do_not_specialize=("q_ptr", "c_ptr", "kr_ptr", "qr_ptr"))
    def _rope_append_kernel(q_ptr, c_ptr, kr_ptr, cos_ptr, sin_ptr, start_ptr, cache_ptr, qr_ptr, H, R, P, NOPE,
                            stride_qm, stride_qh, stride_cm, stride_km, stride_t, stride_tab,
                            INTERLEAVE: tl.constexpr, HP: tl.constexpr, RP: tl.constexpr):
        # program (m, h): h < H rotates q's rotary features of head h into qr[m, h]; h == H writes the cache row
        # start + m = [c[m], RoPE(k_rot[m])]
        m = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(start_ptr) + m
        half = P // 2
        i = tl.arange(0, HP)
        imask = i < half
        cs = tl.load(cos_ptr + pos * stride_tab + i, mask=imask, other=0.0)
        sn = tl.load(sin_ptr + pos * stride_tab + i, mask=imask, other=0.0)
        if h < H:
            src = q_ptr + m * stride_qm + h * stride_qh + NOPE
        else:
            src = kr_ptr + m * stride_km
        if INTERLEAVE:
            x1 = tl.load(src + 2 * i, mask=imask, other=0.0).to(tl.float32)
            x2 = tl.load(src + 2 * i + 1, mask=imask, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(src + i, mask=imask, other=0.0).to(tl.float32)
            x2 = tl.load(src + half + i, mask=imask, other=0.0).to(tl.float32)
        o1 = (x1 * cs - x2 * sn).to(tl.float16)
        o2 = (x2 * cs + x1 * sn).to(tl.float16)
        if h < H:
            dst = qr_ptr + (m * H + h) * P
        else:
            dst = cache_ptr + pos * stride_t + R
            rr = tl.arange(0, RP)
            cv = tl.load(c_ptr + m * stride_cm + rr, mask=rr < R, other=0.0)
            tl.store(cache_ptr + pos * stride_t + rr, cv.to(tl.float16), mask=rr < R)
        tl.store(dst + i, o1, mask=imask)
        tl.store(dst + half + i, o2, mask=imask)


def rope_latent_append(q: torch.Tensor, c: torch.Tensor, k_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       start, cache: torch.Tensor, nope: int, interleave: bool) -> torch.Tensor:
    """RoPE of the queries' rotary features and of the shared key, and the new cache rows, in one launch.

    q [n, H, nope + P] (fp16, unit stride in features), c [n, R], k_rot [n, P]; cos / sin fp32 [T, P/2] (row p
    rotates position p); rows start .. start + n - 1 of cache [T, R + P] become [c, RoPE(k_rot)]. Rotation: pairs
    (x[2i], x[2i + 1]) with ``interleave`` (DeepSeek), else (x[i], x[i + P/2]); either way written de-interleaved
    ([x1 cos - x2 sin, x2 cos + x1 sin]: q and k alike, so their dot products are the rotation's). Returns q_rot fp16
    [n, H, P]. Element by element (each row its own bits)."""
    n, H, D = q.shape
    P = k_rot.shape[-1]
    R = c.shape[-1]
    if D != nope + P or cache.shape[1] != R + P or P % 2 or cos.shape[-1] != P // 2:
        raise ValueError(f"q: shapes q {tuple(q.shape)}, c {tuple(c.shape)}, k_rot {tuple(k_rot.shape)}, cache "
                         f"{tuple(cache.shape)}, cos {tuple(cos.shape)} do not fit nope={nope}")
    q_rot = torch.empty(n, H, P, dtype=torch.float16, device=q.device)
    if not triton_ok(q.device):  # torch fallback (reads the start on the host)
        s0 = int(start)
        cs, sn = cos[s0:s0 + n, None].float(), sin[s0:s0 + n, None].float()

        def rot(x):
            x = x.float()
            x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :P // 2], x[..., P // 2:])
            return torch.cat([x1 * cs - x2 * sn, x2 * cs + x1 * sn], -1).to(torch.float16)
        q_rot.copy_(rot(q[..., nope:]))
        cache[s0:s0 + n].copy_(torch.cat([c.to(torch.float16), rot(k_rot.view(n, 1, P)).view(n, P)], -1))
        return q_rot
    if q.stride(2) != 1:
        q = q.contiguous()
    c, k_rot = c.reshape(n, R), k_rot.reshape(n, P)
    cos, sin = cos.contiguous(), sin.contiguous()
    _rope_append_kernel[(n, H + 1)](q, c, k_rot, cos, sin, _start_tensor(start, q.device), cache, q_rot, H, R, P,
                                    nope, q.stride(0), q.stride(1), c.stride(0), k_rot.stride(0), cache.stride(0),
                                    cos.stride(0), INTERLEAVE=bool(interleave),
                                    HP=max(16, triton.next_power_of_2(P // 2)),
                                    RP=max(16, triton.next_power_of_2(R)), num_warps=4)
    return q_rot


def _start_tensor(start, device) -> torch.Tensor:
    if isinstance(start, torch.Tensor):
        return start.reshape(1).to(device=device, dtype=torch.int32) if start.dtype != torch.int32 else start.reshape(1)
    return torch.tensor([int(start)], dtype=torch.int32, device=device)


def workspace(rows: int, heads: int, rank: int, max_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split programs' fp32 partial sums [rows, NS, H, R] and (max, denominator) [rows, NS, H, 2]."""
    ns = -(-max_len // CHUNK)
    return (torch.empty(rows, ns, heads, rank, dtype=torch.float32, device=device),
            torch.empty(rows, ns, heads, 2, dtype=torch.float32, device=device))


def latent_attention(q_lat: torch.Tensor, q_rot: torch.Tensor, cache: torch.Tensor, start, scale: float, *,
                     out: torch.Tensor | None = None, ws: tuple | None = None) -> torch.Tensor:
    """o fp16 [M, H, R] (module docstring). ``ws``: a ``workspace`` for at least M rows and the cache's length."""
    for name, t, d in (("q_lat", q_lat, 3), ("q_rot", q_rot, 3), ("cache", cache, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != d or t.dtype != torch.float16:
            raise ValueError(f"{name}: expected a {d}-D float16 tensor, got {getattr(t, 'dtype', None)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
    M, H, R = q_lat.shape
    P = q_rot.shape[2]
    if tuple(q_rot.shape[:2]) != (M, H) or cache.shape[1] != R + P or cache.stride(1) != 1:
        raise ValueError(f"cache: expected [T, {R} + {q_rot.shape[2]}] rows for q_lat {tuple(q_lat.shape)} and "
                         f"q_rot {tuple(q_rot.shape)}, got {tuple(cache.shape)}")
    y = torch.empty(M, H, R, dtype=torch.float16, device=q_lat.device) if out is None else out
    if not triton_ok(q_lat.device):  # torch fallback: row by row, shapes from the row's length only
        s0 = int(start)
        for m in range(M):
            L = s0 + m + 1
            c, kr = cache[:L, :R].float(), cache[:L, R:].float()
            sc = (q_lat[m].float() @ c.T + q_rot[m].float() @ kr.T) * scale
            y[m].copy_(torch.softmax(sc, -1) @ c)
        return y
    q_lat, q_rot = q_lat.contiguous(), q_rot.contiguous()
    dev = q_lat.device
    st = _start_tensor(start, dev)
    part, ml = ws if ws is not None else workspace(M, H, R, cache.shape[0], dev)
    ns = part.shape[1]
    if part.shape[0] < M or tuple(part.shape[2:]) != (H, R) or ns * CHUNK < cache.shape[0]:
        raise ValueError(f"ws: a workspace for {M} rows, {H} heads, rank {R} and {cache.shape[0]} positions needed")
    rp, pp = max(16, triton.next_power_of_2(R)), max(16, triton.next_power_of_2(P))
    _split_kernel[(triton.cdiv(H, BH), M, ns)](q_lat, q_rot, cache, st, part, ml, H, R, P, ns, cache.stride(0),
                                               float(scale), CH=CHUNK, BLOCK_H=BH, BT=32, RP=rp, PP=pp,
                                               num_warps=8)
    _merge_kernel[(H, M)](part, ml, st, y, H, R, ns, CH=CHUNK, RP=rp, num_warps=4)
    return y


def head_gemv(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """y fp16 [M, H, N] = w[h] [N, K] @ x[m, h] [K], fp32 accumulation, one program per (rows block, head, row);
    x may be a strided view (unit stride in K: q's nope features read in place)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.dtype != torch.float16:
        raise ValueError(f"x: expected float16 [M, H, K], got {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype != torch.float16 or w.shape[0] != x.shape[1] \
            or w.shape[2] != x.shape[2]:
        raise ValueError(f"w: expected float16 [{x.shape[1]}, N, {x.shape[2]}], got {tuple(getattr(w, 'shape', ()))}")
    M, H, K = x.shape
    N = w.shape[1]
    w = w.contiguous()
    if x.stride(2) != 1:
        x = x.contiguous()
    y = torch.empty(M, H, N, dtype=torch.float16, device=x.device) if out is None else out
    if not triton_ok(x.device):  # torch fallback, one row at a time
        wf = w.float()
        for m in range(M):
            y[m].copy_(torch.bmm(wf, x[m].float().unsqueeze(-1)).squeeze(-1))
        return y
    bk = max(16, min(512 if x.device.type == "cpu" else 256, triton.next_power_of_2(K)))
    bn = 32 if x.device.type == "cpu" else 16
    _head_gemv_kernel[(triton.cdiv(N, bn), H, M)](x, w, y, H, N, K, x.stride(0), x.stride(1), BLOCK_N=bn,
                                                  BLOCK_K=bk, num_warps=4)
    return y
