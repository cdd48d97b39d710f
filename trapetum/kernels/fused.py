"""Small fused decode kernels (Triton) with their float64 references.

  rmsnorm(x, weight, eps, offset=0.0)      y = x / sqrt(mean(x^2) + eps) * (weight + offset)
                                            (offset=1.0 for Gemma's (1 + w) convention); fp32 math; with
                                            frag_bits, written in a GEMV's fragment order (codebook_layout).
  rope_kv_append(q, k, v, k_cache, v_cache, pos, cos, sin)
                                            NeoX / rotate-half RoPE (as HF) on q (in place) and k,
                                            k and v written into the caches at positions pos..pos+T-1,
                                            in one launch. Partial rotary: rot_dim = 2 * cos.shape[1].
  act_mul(gate, up, act)                    act(gate) * up, act = "silu" | "gelu_tanh".
The k rotation + append of one head is a @triton.jit helper (rope_append_kv) shared with the fused attention
kernel (attention.attention_rows / decode_attention_fused), so both write the same bits into the cache.
Cache layout: [Hkv, T_max, D] (as decode_attention). `pos` may be an int or a one-element int
CUDA tensor (graph-capturable).
"""
from __future__ import annotations

import torch

from ..settings import DEFAULT_KERNELS, KernelOptions
from . import pdl
from .codebook_layout import Fragments, frag_pieces, to_fragments
from .triton_util import HAVE_TRITON, triton_ok

if HAVE_TRITON:
    from .codebook_layout import frag_offset

if HAVE_TRITON:
    import triton
    import triton.language as tl


# ----------------------------------------------------------------------------- references
def rmsnorm_reference(x, weight, eps, offset=0.0):
    xd = x.double()
    r = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return xd * r * (weight.double() + offset)


def rope_tables(max_pos: int, rot_dim: int, theta: float = 10000.0, inv_freq: torch.Tensor | None = None,
                device=None):
    """cos, sin fp32 [max_pos, rot_dim // 2] for HF rotate-half RoPE (inv_freq overrides theta,
    e.g. for Llama-3 frequency scaling)."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    t = torch.arange(max_pos, dtype=torch.float64)
    f = torch.outer(t, inv_freq.to(torch.float64).cpu())
    return f.cos().float().to(device), f.sin().float().to(device)


def rope_reference(x, positions, cos, sin):
    """x [T, H, D]; positions int64 [T]. float64 result."""
    xd = x.double()
    half = cos.shape[1]
    c = cos.double()[positions][:, None, :]
    s = sin.double()[positions][:, None, :]
    x1, x2 = xd[..., :half], xd[..., half:2 * half]
    out = xd.clone()
    out[..., :half] = x1 * c - x2 * s
    out[..., half:2 * half] = x2 * c + x1 * s
    return out


def act_mul_reference(gate, up, act="silu"):
    g = gate.double()
    if act == "silu":
        a = g * torch.sigmoid(g)
    elif act == "gelu_tanh":
        a = torch.nn.functional.gelu(g, approximate="tanh")
    else:
        raise ValueError(f"act: must be 'silu' or 'gelu_tanh', got {act!r}")
    return a * up.double()


# ----------------------------------------------------------------------------- kernels
if HAVE_TRITON:

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, N, M, stride_x, stride_y, eps, offset, BLOCK: tl.constexpr,
                        FRAG_PT: tl.constexpr, PDL: tl.constexpr):
        # FRAG_PT > 0: y is M rows in the fragment order of that many pieces (codebook_layout), else row-major
        pdl.pdl_enter(PDL)
        row = tl.program_id(0)
        acc = tl.zeros([BLOCK], tl.float32)
        for n0 in range(0, N, BLOCK):
            rn = n0 + tl.arange(0, BLOCK)
            xv = tl.load(x_ptr + row * stride_x + rn, mask=rn < N, other=0.0).to(tl.float32)
            acc += xv * xv
        r = 1.0 / tl.sqrt(tl.sum(acc, 0) / N + eps)
        for n0 in range(0, N, BLOCK):
            rn = n0 + tl.arange(0, BLOCK)
            xv = tl.load(x_ptr + row * stride_x + rn, mask=rn < N, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
            if FRAG_PT > 0:
                dst = y_ptr + frag_offset(row, rn, M, FRAG_PT)
            else:
                dst = y_ptr + row * stride_y + rn
            tl.store(dst, (xv * r * (wv + offset)).to(tl.float16), mask=rn < N)

    @triton.jit
    def rope_rotate(src, dst, c, s, HALF, BLOCK_H: tl.constexpr):
        """Rotate-half RoPE of one head's first 2 * HALF features from src into dst (may be src: in place), in
        fp32, rounded to fp16; c, s: the position's cos/sin [BLOCK_H] (masked lanes 1, 0). The one expression of
        the rotation for every kernel that writes a rotated q or k (rope_append_kv, the fused kernels' q heads,
        kernels/paged_attention.py), so that they give the same bits."""
        ri = tl.arange(0, BLOCK_H)
        hm = ri < HALF
        x1 = tl.load(src + ri, mask=hm, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + ri, mask=hm, other=0.0).to(tl.float32)
        tl.store(dst + ri, (x1 * c - x2 * s).to(tl.float16), mask=hm)
        tl.store(dst + HALF + ri, (x2 * c + x1 * s).to(tl.float16), mask=hm)

    @triton.jit
    def rope_append_kv(k_row, v_row, kc_row, vc_row, c, s, HALF, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """Rotate one head's k (k_row) into kc_row and copy its v (v_row) into vc_row; c, s: the position's
        cos/sin [BLOCK_H] (masked lanes 1, 0). Shared with the fused attention kernel (attention.py), so
        that both write the same bits into the cache."""
        rope_rotate(k_row, kc_row, c, s, HALF, BLOCK_H)
        rd = tl.arange(0, BLOCK_D)
        pm = (rd >= 2 * HALF) & (rd < D)  # pass-through part of a partial rotary
        tl.store(kc_row + rd, tl.load(k_row + rd, mask=pm, other=0.0), mask=pm)
        vm = rd < D
        tl.store(vc_row + rd, tl.load(v_row + rd, mask=vm, other=0.0), mask=vm)

    @triton.jit
    def rope_append_rows(kn_ptr, vn_ptr, stride_knr, stride_vnr, kc_base, vc_base, stride_kt, stride_vt,
                         cos_ptr, sin_ptr, t, j_lo, j_hi, HALF, D, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr):
        """``rope_append_kv`` of new rows j_lo .. j_hi - 1 (< j_lo + BLOCK_J) of one head at once: row j's k
        (kn_ptr + j * stride_knr) rotated with the cos/sin of position t + j into cache row t + j, its v copied.
        The same elementwise expressions as rope_append_kv (the same bits), with every row's loads in flight
        together instead of one row after another."""
        jj = j_lo + tl.arange(0, BLOCK_J)
        jm = jj < j_hi
        ri = tl.arange(0, BLOCK_H)
        hm = jm[:, None] & (ri < HALF)[None, :]
        tab = (t + jj)[:, None] * HALF + ri[None, :]
        c = tl.load(cos_ptr + tab, mask=hm, other=1.0)
        s = tl.load(sin_ptr + tab, mask=hm, other=0.0)
        k_rows = kn_ptr + jj[:, None] * stride_knr
        x1 = tl.load(k_rows + ri[None, :], mask=hm, other=0.0).to(tl.float32)
        x2 = tl.load(k_rows + HALF + ri[None, :], mask=hm, other=0.0).to(tl.float32)
        rd = tl.arange(0, BLOCK_D)
        pm = jm[:, None] & ((rd >= 2 * HALF) & (rd < D))[None, :]
        vm = jm[:, None] & (rd < D)[None, :]
        kp = tl.load(k_rows + rd[None, :], mask=pm, other=0.0)
        vv = tl.load(vn_ptr + jj[:, None] * stride_vnr + rd[None, :], mask=vm, other=0.0)
        kc_rows = kc_base + (t + jj)[:, None] * stride_kt
        tl.store(kc_rows + ri[None, :], (x1 * c - x2 * s).to(tl.float16), mask=hm)
        tl.store(kc_rows + HALF + ri[None, :], (x2 * c + x1 * s).to(tl.float16), mask=hm)
        tl.store(kc_rows + rd[None, :], kp, mask=pm)
        tl.store(vc_base + (t + jj)[:, None] * stride_vt + rd[None, :], vv, mask=vm)

    @triton.jit
    def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, pos_val,
                        HQ, D, HALF, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
                        skc_h, skc_t, svc_h, svc_t, POS_PTR: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        pdl.pdl_enter(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)
        if POS_PTR:
            p = tl.load(pos_ptr).to(tl.int32) + t
        else:
            p = pos_val + t
        ri = tl.arange(0, BLOCK_H)
        hm = ri < HALF
        c = tl.load(cos_ptr + p * HALF + ri, mask=hm, other=1.0)
        s = tl.load(sin_ptr + p * HALF + ri, mask=hm, other=0.0)
        if h < HQ:
            base = q_ptr + t * sq_t + h * sq_h
            rope_rotate(base, base, c, s, HALF, BLOCK_H)
        else:
            kh = h - HQ
            rope_append_kv(k_ptr + t * sk_t + kh * sk_h, v_ptr + t * sv_t + kh * sv_h,
                           kc_ptr + kh * skc_h + p * skc_t, vc_ptr + kh * svc_h + p * svc_t,
                           c, s, HALF, D, BLOCK_H, BLOCK_D)

    @triton.jit
    def _act_mul_kernel(g_ptr, u_ptr, y_ptr, N, sg, su, sy, ACT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(1)
        rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = rn < N
        g = tl.load(g_ptr + row * sg + rn, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + rn, mask=m, other=0.0).to(tl.float32)
        if ACT == 0:
            a = g / (1.0 + tl.exp(-g))
        else:
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            z = tl.minimum(tl.maximum(z, -15.0), 15.0)
            a = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
        tl.store(y_ptr + row * sy + rn, (a * u).to(tl.float16), mask=m)


# ----------------------------------------------------------------------------- wrappers
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0,
            out: torch.Tensor | None = None, frag_bits: int | None = None,
            kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., N] (fp16, or fp32 for a residual stream kept in fp32)
    with weight [N] (fp16/fp32). Returns fp16. kopts: the PDL choice of the launch.
    frag_bits (4 or 8): x is [M, N] rows and the result is ``Fragments`` in the fragment order of a GEMV of those
    bits (codebook_layout; the same values, other addresses) instead of a row-major tensor."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.float32) or x.dim() < 1:
        raise ValueError("x: expected a float16 or float32 tensor [..., N]")
    n = x.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.shape != (n,) or weight.device != x.device:
        raise ValueError(f"weight: expected [{n}] on {x.device}, got {tuple(getattr(weight, 'shape', ()))}")
    if not eps > 0:
        raise ValueError(f"eps: must be positive, got {eps!r}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    pt = 0
    if frag_bits is not None:
        if x.dim() != 2 or out is not None:
            raise ValueError("frag_bits: fragment order is written for [M, N] rows into a fresh buffer")
        pt = frag_pieces(frag_bits)
        if n % (32 * pt):
            raise ValueError(f"frag_bits: {n} features are not a multiple of {32 * pt}")
    y = torch.empty(x2.shape, dtype=torch.float16, device=x.device) if out is None else out.view(-1, n)
    if not triton_ok(x.device):
        r = rmsnorm_reference(x2, weight, eps, offset)
        y.copy_(to_fragments(r.to(torch.float16), frag_bits) if pt else r)
    else:
        block = min(4096, triton.next_power_of_2(n))
        _rmsnorm_kernel[(x2.shape[0],)](x2, weight, y, n, x2.shape[0], x2.stride(0), y.stride(0), float(eps),
                                        float(offset), BLOCK=block, FRAG_PT=pt, num_warps=4 if block <= 1024 else 8,
                                        **pdl.launch_kwargs(x.device, kopts))
    return Fragments(y, frag_bits) if pt else y.view(x.shape)


def check_rope_kv(q, k, v, k_cache, v_cache, pos, cos, sin) -> tuple:
    """Validate rope_kv_append's arguments (also those of attention.decode_attention_fused); return q, k, v
    as [T, H, D] views. Raises ValueError naming the first bad argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float16 or t.dim() not in (2, 3) or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected float16 [T, H, D] or [H, D] with a contiguous last dim")
    q3 = q if q.dim() == 3 else q.unsqueeze(0)
    k3 = k if k.dim() == 3 else k.unsqueeze(0)
    v3 = v if v.dim() == 3 else v.unsqueeze(0)
    T, hq, d = q3.shape
    if k3.shape[0] != T or v3.shape != k3.shape or k3.shape[2] != d:
        raise ValueError(f"k: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    hkv = k3.shape[1]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dtype != torch.float16 or c.dim() != 3 or \
                c.shape[0] != hkv or c.shape[2] != d or c.stride(2) != 1:
            raise ValueError(f"{name}: expected float16 [{hkv}, T_max, {d}] with a contiguous last dim")
    if cos.dtype != torch.float32 or sin.shape != cos.shape or cos.dim() != 2 or 2 * cos.shape[1] > d or cos.shape[1] < 1:
        raise ValueError(f"cos: expected fp32 [max_pos, rot/2] with rot <= D={d}, and sin alike")
    for name, t in (("k", k3), ("v", v3), ("k_cache", k_cache), ("v_cache", v_cache), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, q on {q.device}")
    if isinstance(pos, torch.Tensor):
        if pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64) or pos.device != q.device:
            raise ValueError("pos: expected an int or a one-element int32/int64 tensor on q's device")
    elif not (0 <= int(pos) and int(pos) + T <= min(k_cache.shape[1], cos.shape[0])):
        raise ValueError(f"pos: {pos} + {T} tokens outside the cache ({k_cache.shape[1]}) or tables ({cos.shape[0]})")
    return q3, k3, v3


def rope_kv_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, pos, cos: torch.Tensor, sin: torch.Tensor, *,
                   kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """Rotate q in place and k into k_cache[:, pos + t], copy v into v_cache[:, pos + t]; one launch.

    q [T, Hq, D] or [Hq, D]; k, v [T, Hkv, D] or [Hkv, D] (views with a contiguous last dim are fine,
    e.g. slices of a fused qkv output); caches [Hkv, T_max, D]; cos/sin fp32 [max_pos, rot/2].
    kopts: the PDL choice of the launch. Returns q.
    """
    q3, k3, v3 = check_rope_kv(q, k, v, k_cache, v_cache, pos, cos, sin)
    T, hq, d = q3.shape
    hkv = k3.shape[1]
    half = cos.shape[1]
    if not triton_ok(q.device):
        p0 = int(pos)
        positions = torch.arange(p0, p0 + T, device=q.device)
        q3.copy_(rope_reference(q3, positions, cos, sin))
        k_cache[:, p0:p0 + T].copy_(rope_reference(k3, positions, cos, sin).transpose(0, 1))
        v_cache[:, p0:p0 + T].copy_(v3.transpose(0, 1))
        return q
    is_t = isinstance(pos, torch.Tensor)
    _rope_kv_kernel[(T, hq + hkv)](q3, k3, v3, k_cache, v_cache, cos.contiguous(), sin.contiguous(),
                                   pos if is_t else q3, 0 if is_t else int(pos),
                                   hq, d, half, q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
                                   v3.stride(0), v3.stride(1), k_cache.stride(0), k_cache.stride(1),
                                   v_cache.stride(0), v_cache.stride(1), POS_PTR=is_t,
                                   BLOCK_H=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(d),
                                   num_warps=1, **pdl.launch_kwargs(q.device, kopts))
    return q


def act_mul(gate: torch.Tensor, up: torch.Tensor, act: str = "silu", *, out: torch.Tensor | None = None) -> torch.Tensor:
    """act(gate) * up in fp32, rounded to fp16. gate, up: fp16 [..., F] of equal shapes."""
    if act not in ("silu", "gelu_tanh"):
        raise ValueError(f"act: must be 'silu' or 'gelu_tanh', got {act!r}")
    if not isinstance(gate, torch.Tensor) or gate.dtype != torch.float16 or gate.dim() < 1:
        raise ValueError("gate: expected a float16 tensor")
    if not isinstance(up, torch.Tensor) or up.shape != gate.shape or up.dtype != torch.float16 or up.device != gate.device:
        raise ValueError(f"up: expected float16 {tuple(gate.shape)} on {gate.device}")
    f = gate.shape[-1]
    g2 = gate.reshape(-1, f)
    u2 = up.reshape(-1, f)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    y = torch.empty(g2.shape, dtype=torch.float16, device=gate.device) if out is None else out.view(-1, f)
    if not triton_ok(gate.device):
        y.copy_(act_mul_reference(g2, u2, act))
        return y.view(gate.shape)
    block = min(1024, triton.next_power_of_2(f))
    _act_mul_kernel[(triton.cdiv(f, block), g2.shape[0])](g2, u2, y, f, g2.stride(0), u2.stride(0), y.stride(0),
                                                         ACT=0 if act == "silu" else 1, BLOCK=block, num_warps=4)
    return y.view(gate.shape)
