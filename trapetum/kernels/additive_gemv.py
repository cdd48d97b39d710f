"""Additive-codebook (AQLM layout) GEMV: y[T, out] = x[T, in] @ W.T (+ bias) (+ residual).

W[o, 8g:8g+8] = scales[o] * sum_m codebooks[m, codes[o, g, m]]  (in_group 8, out_group 1; see
``trapetum.quant.additive``). The canonical layout (codes int8/int16 [out, G, M], codebooks fp16
[M, K, 1, 8], scales fp16 [out, 1, 1, 1]) is read as it is stored; nothing is repacked.

Kernels (Triton; they also run on the CPU under TRITON_INTERPRET=1):

* 2x8 (M codebooks of 256 entries, M in 1..4): a lookup table per input group,
  ``lut[t, g, m, k] = x[t, 8g:8g+8] . codebooks[m, k]`` (fp32, 1 KiB per group per codebook, built by
  ``_lut_kernel``: BLOCK_G groups per program, the 8 products summed in a fixed order), then one
  program per BLOCK_R output rows walks the groups in order, gathers ``lut[g, m, code]`` for its rows
  (the table stays in L1/L2: G*M KiB, 2 MiB at in = 8192), sums each group block with ``tl.sum`` and
  adds block sums into a per-row fp32 accumulator in group order. A GEMV then reads 2 bytes of codes per
  8 weights (8x fewer bytes than fp16).
* 1x16 (one codebook of 65,536 entries): one program per BLOCK_R rows gathers the 16-byte codebook
  entries of its codes (through L2: the 1 MiB codebook stays resident) and takes the dot product with x.

Determinism: every output element is produced by one program, with sums in a fixed order, no atomics
and no split over the input dimension, so results are bitwise identical run to run (and the same in
eager mode and CUDA graphs, which replay the same launches).

References (float64): ``additive_gemv_reference`` dequantizes in float64 and multiplies in float64.
"""
from __future__ import annotations

import os

import torch

try:  # Triton is optional on CPU-only installs
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

__all__ = ["additive_gemv_reference", "additive_gemv", "additive_linear", "lut_reference", "supported"]


# ----------------------------------------------------------------------------- references
def _dequantize64(codes, codebooks, scales) -> torch.Tensor:
    from ..quant.additive import dequantize_aqlm

    return dequantize_aqlm(codes, codebooks, scales, torch.float64)


def additive_gemv_reference(x, codes, codebooks, scales, bias=None, residual=None) -> torch.Tensor:
    """float64: x [..., in] @ W.T (+ bias) (+ residual) -> float64 [..., out]."""
    W = _dequantize64(codes, codebooks, scales)
    y = x.reshape(-1, x.shape[-1]).double() @ W.T
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.reshape(y.shape).double()
    return y.reshape(*x.shape[:-1], W.shape[0])


def lut_reference(x, codebooks) -> torch.Tensor:
    """float64 lookup tables [T, G, M, K]: lut[t, g, m, k] = x[t, 8g:8g+8] . codebooks[m, k, 0]."""
    M, K, _, ig = codebooks.shape
    x2 = x.reshape(-1, x.shape[-1]).double()
    xg = x2.view(x2.shape[0], -1, ig)  # [T, G, 8]
    return torch.einsum("tgj,mkj->tgmk", xg, codebooks[:, :, 0, :].double())


# ----------------------------------------------------------------------------- triton kernels
if triton is not None:

    @triton.jit
    def _lut_kernel(x_ptr, cb_ptr, lut_ptr, G, stride_xt,
                    M: tl.constexpr, K: tl.constexpr, BLOCK_G: tl.constexpr):
        # lut[t, g, m, k] = sum_j x[t, 8g + j] * cb[m, k, j], j = 0..7 in order
        pid_g = tl.program_id(0)
        t = tl.program_id(1)
        rg = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)
        gmask = rg < G
        rk = tl.arange(0, K)
        rj = tl.arange(0, 8)
        xv = tl.load(x_ptr + t * stride_xt + rg[:, None] * 8 + rj[None, :], mask=gmask[:, None], other=0.0)
        xv = xv.to(tl.float32)  # [BG, 8]
        for m in tl.static_range(M):
            cb = tl.load(cb_ptr + m * K * 8 + rk[:, None] * 8 + rj[None, :]).to(tl.float32)  # [K, 8]
            lut = tl.sum(xv[:, None, :] * cb[None, :, :], axis=2)  # [BG, K]
            tl.store(lut_ptr + ((t * G + rg[:, None]) * M + m) * K + rk[None, :], lut, mask=gmask[:, None])

    @triton.jit
    def _gemv_lut_kernel(codes_ptr, lut_ptr, scales_ptr, bias_ptr, res_ptr, y_ptr, N, G,
                         stride_yt, stride_rt,
                         M: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        pid_r = tl.program_id(0)
        t = tl.program_id(1)
        rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rr < N
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for g0 in range(0, G, BLOCK_G):
            rg = g0 + tl.arange(0, BLOCK_G)
            mask = rmask[:, None] & (rg[None, :] < G)
            part = tl.zeros([BLOCK_R, BLOCK_G], dtype=tl.float32)
            for m in tl.static_range(M):
                c = tl.load(codes_ptr + (rr[:, None] * G + rg[None, :]) * M + m, mask=mask, other=0)
                c = c.to(tl.int32) & (K - 1)
                v = tl.load(lut_ptr + ((t * G + rg[None, :]) * M + m) * K + c, mask=mask, other=0.0)
                part += v
            acc += tl.sum(part, axis=1)
        y = acc * tl.load(scales_ptr + rr, mask=rmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rr, mask=rmask, other=0.0).to(tl.float32)
        if HAS_RES:
            y += tl.load(res_ptr + t * stride_rt + rr, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_yt + rr, y.to(y_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _gemv_gather_kernel(x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, res_ptr, y_ptr, N, G,
                            stride_xt, stride_yt, stride_rt,
                            K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        # one codebook (1x16): y[r] = scale[r] * sum_g x[8g:8g+8] . cb[codes[r, g]]
        pid_r = tl.program_id(0)
        t = tl.program_id(1)
        rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rr < N
        rj = tl.arange(0, 8)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for g0 in range(0, G, BLOCK_G):
            rg = g0 + tl.arange(0, BLOCK_G)
            gmask = rg < G
            mask = rmask[:, None] & gmask[None, :]
            c = tl.load(codes_ptr + rr[:, None] * G + rg[None, :], mask=mask, other=0)
            c = c.to(tl.int32) & (K - 1)  # [BR, BG]
            e = tl.load(cb_ptr + c[:, :, None] * 8 + rj[None, None, :], mask=mask[:, :, None], other=0.0)
            xv = tl.load(x_ptr + t * stride_xt + rg[:, None] * 8 + rj[None, :], mask=gmask[:, None], other=0.0)
            d = tl.sum(e.to(tl.float32) * xv.to(tl.float32)[None, :, :], axis=2)  # [BR, BG]
            acc += tl.sum(d, axis=1)
        y = acc * tl.load(scales_ptr + rr, mask=rmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rr, mask=rmask, other=0.0).to(tl.float32)
        if HAS_RES:
            y += tl.load(res_ptr + t * stride_rt + rr, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_yt + rr, y.to(y_ptr.dtype.element_ty), mask=rmask)


# ----------------------------------------------------------------------------- wrappers
def _triton_ok(device: torch.device) -> bool:
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def supported(codes: torch.Tensor, codebooks: torch.Tensor) -> bool:
    """Layouts the kernels take: out_group 1, in_group 8, and 1..4 codebooks of 256 or one of 65,536."""
    if codebooks.dim() != 4 or codes.dim() != 3:
        return False
    M, K, og, ig = codebooks.shape
    return og == 1 and ig == 8 and ((K == 256 and 1 <= M <= 4) or (K == 65536 and M == 1))


def _check(x, codes, codebooks, scales, bias, residual, out):
    if not supported(codes, codebooks):
        raise ValueError(f"codebooks: unsupported additive layout {tuple(codebooks.shape)} "
                         "(need [M, 256, 1, 8] with M <= 4, or [1, 65536, 1, 8])")
    M, K = codebooks.shape[:2]
    N, G, Mc = codes.shape
    if Mc != M:
        raise ValueError(f"codes: {Mc} codebooks per group, codebooks hold {M}")
    if codes.dtype != (torch.int8 if K == 256 else torch.int16):
        raise ValueError(f"codes: dtype {codes.dtype} does not match {K}-entry codebooks")
    if x.shape[-1] != G * 8:
        raise ValueError(f"x: last dimension {x.shape[-1]} != in_features {G * 8}")
    if tuple(scales.shape) != (N, 1, 1, 1):
        raise ValueError(f"scales: shape {tuple(scales.shape)} != {(N, 1, 1, 1)}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias: shape {tuple(bias.shape)} != ({N},)")
    T = x.numel() // max(1, x.shape[-1])
    if residual is not None and residual.numel() != T * N:
        raise ValueError(f"residual: {residual.numel()} elements, expected {T * N}")
    if out is not None and out.numel() != T * N:
        raise ValueError(f"out: {out.numel()} elements, expected {T * N}")
    devs = {t.device for t in (x, codes, codebooks, scales, bias, residual, out) if t is not None}
    if len(devs) != 1:
        raise ValueError(f"x: all tensors must be on one device, got {sorted(map(str, devs))}")


def additive_gemv(x: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, *, lut: torch.Tensor | None = None,
                  block_r: int = 64, block_g: int = 16) -> torch.Tensor:
    """y [..., out] = x [..., in] @ W.T (+ bias) (+ residual), in x's dtype (fp32 accumulation).

    ``lut``: optional preallocated fp32 workspace [T*G*M*256] for the 2x8 tables (static buffers for
    CUDA graphs). Raises ValueError on bad shapes; RuntimeError when Triton cannot run here."""
    _check(x, codes, codebooks, scales, bias, residual, out)
    if not _triton_ok(x.device):
        raise RuntimeError("additive_gemv: needs CUDA or TRITON_INTERPRET=1")
    M, K = codebooks.shape[:2]
    N, G, _ = codes.shape
    x2 = x.reshape(-1, G * 8)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    y = out.view(T, N) if out is not None else torch.empty(T, N, dtype=x.dtype, device=x.device)
    res = residual.reshape(T, N) if residual is not None else y
    b = bias if bias is not None else y
    codes, cbk, sc = codes.contiguous(), codebooks.contiguous(), scales.contiguous()
    grid = (triton.cdiv(N, block_r), T)
    if K == 256:
        need = T * G * M * K
        if lut is None or lut.numel() < need:
            lut = torch.empty(need, dtype=torch.float32, device=x.device)
        _lut_kernel[(triton.cdiv(G, 8), T)](x2, cbk, lut, G, x2.stride(0), M=M, K=K, BLOCK_G=8)
        _gemv_lut_kernel[grid](codes, lut, sc, b, res, y, N, G, y.stride(0), res.stride(0),
                               M=M, K=K, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                               BLOCK_R=block_r, BLOCK_G=block_g)
    else:
        _gemv_gather_kernel[grid](x2, codes, cbk, sc, b, res, y, N, G, x2.stride(0), y.stride(0), res.stride(0),
                                  K=K, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                                  BLOCK_R=block_r, BLOCK_G=block_g)
    return y.view(*x.shape[:-1], N)


GEMV_MAX_ROWS = 8  # more rows than this (prefill): dequantize once, then a tensor-core matmul


def additive_linear(x, codes, codebooks, scales, bias=None) -> torch.Tensor | None:
    """The module hook (``AdditiveLinear.forward`` on CUDA): the GEMV kernel for a few rows, None to
    decline (unsupported layout, no Triton, many rows: the caller dequantizes and multiplies)."""
    if not supported(codes, codebooks) or not _triton_ok(x.device):
        return None
    if x.numel() // x.shape[-1] > GEMV_MAX_ROWS or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    return additive_gemv(x, codes, codebooks, scales, bias)


# ----------------------------------------------------------------------------- benchmark (GPU)
def bench(shapes=((4096, 4096), (4096, 11008), (11008, 4096), (8192, 28672), (28672, 8192)),
          layouts=((2, 8), (1, 16)), block_r: int = 64, block_g: int = 16) -> list[dict]:
    """Batch-1 GEMV vs cuBLAS fp16 in one process (shape = in x out), CUDA-graph replays with weights
    rotated past L2 (``trapetum.eval.bench_kernels.graph_time_us``); the 2x8 time includes its LUT launch."""
    from ..eval.bench_kernels import graph_time_us
    from ..quant.additive import index_to_codes

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, n in shapes:
        fp16_bytes = n * k * 2 + k * 2 + n * 2

        def make_dense(i):
            w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen)
            x = torch.randn(1, k, device="cuda", dtype=torch.float16, generator=gen)
            y = torch.empty(1, n, device="cuda", dtype=torch.float16)
            return lambda: torch.matmul(x, w.t(), out=y)

        cublas = graph_time_us(make_dense, fp16_bytes)
        for M, nb in layouts:
            K = 1 << nb
            q_bytes = n * (k // 8) * M * (nb // 8) + M * K * 16 + n * 2 + k * 2 + n * 2

            def make_q(i, M=M, nb=nb, K=K):
                codes = index_to_codes(torch.randint(0, K, (n, k // 8, M), device="cuda", generator=gen), nb)
                cb = torch.randn(M, K, 1, 8, device="cuda", generator=gen).half()
                sc = torch.rand(n, 1, 1, 1, device="cuda", generator=gen).half()
                x = torch.randn(1, k, device="cuda", dtype=torch.float16, generator=gen)
                y = torch.empty(1, n, device="cuda", dtype=torch.float16)
                lut = torch.empty((k // 8) * M * 256, device="cuda")
                return lambda: additive_gemv(x, codes, cb, sc, out=y, lut=lut, block_r=block_r, block_g=block_g)

            us = graph_time_us(make_q, q_bytes)
            rows.append({"shape": f"{k}x{n}", "layout": f"{M}x{nb}", "cublas_us": round(cublas, 2),
                         "us": round(us, 2), "vs_cublas": round(cublas / us, 3), "GBps": round(q_bytes / us / 1e3, 1)})
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":  # python -m trapetum.kernels.additive_gemv [BLOCK_R BLOCK_G]
    import sys

    args = [int(a) for a in sys.argv[1:3]]
    bench(**dict(zip(("block_r", "block_g"), args)))
