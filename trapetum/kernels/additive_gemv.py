"""Additive-codebook (AQLM layout) GEMV: y[T, out] = x[T, in] @ W.T (+ bias) (+ residual).

W[o, 8g:8g+8] = scales[o] * sum_m codebooks[m, codes[o, g, m]]  (in_group 8, out_group 1; see
``trapetum.quant.additive``). The canonical layout (codes int8/int16 [out, G, M], codebooks fp16
[M, K, 1, 8], scales fp16 [out, 1, 1, 1]) is what ``additive_gemv`` takes and reads as stored. The
decode engine instead packs the 2x8 projections that share an input once (``Packed2x8``): codes in
the kernel's "slices" layout, q/k/v or gate/up in one launch.

Backends (``additive_gemv(..., backend=None)`` picks one):

* "cuda" (``cuda/additive_gemv.cu``, compute capability >= 8.0, fp16 tensors; off with
  TRAPETUM_TC=0). 2x8 (two codebooks of 256, in % 64 == 0, up to ``CUDA_MAX_ROWS_2X8`` rows, one
  launch per row): per slice of 32 input groups a block builds the lookup table
  ``lut[k][(g, m)] = x_g . codebooks[m, k]`` (fp32, 64 KB of shared memory, with mma.sync), then
  streams the codes of its rows, one table lookup per code, laid out so that a warp's 32 lookups
  hit 32 distinct banks; partial sums per (slice, row) go to a workspace and a second small kernel
  adds each row's partials in a fixed order and applies scale, bias and residual.
  1x16 (one codebook of 65,536 entries, one row): a warp owns 4 rows, gathers the 16-byte codebook
  entries of its codes through L1/L2 and takes fp32 dot products with x. The .cu file's header
  has the design and the wavefront/byte budget; blocks per SM of the 2x8 kernel:
  TRAPETUM_AQLM_BPS (default 2).
* "triton" (any supported layout, any rows, any float dtype; also runs on the CPU under
  TRITON_INTERPRET=1). 2x8 and other 256-entry layouts (M in 1..4): a lookup table per input group
  ``lut[t, g, m, k]`` (fp32, in the workspace, built by ``_lut_kernel``: BLOCK_G groups per program,
  the 8 products summed in a fixed order), then one program per BLOCK_R output rows walks the groups
  in order, gathers ``lut[g, m, code]`` for its rows, sums each group block with ``tl.sum`` and adds
  block sums into a per-row fp32 accumulator in group order. 1x16: one program per BLOCK_R rows
  gathers the 16-byte codebook entries of its codes and takes the dot product with x.

A GEMV reads 2 bytes of codes per 8 weights (8x fewer bytes than fp16).

Workspace: ``AdditiveWorkspace`` (fp32 scratch) holds the 2x8 partial sums (CUDA) or lookup
tables (Triton). Pass one to use static buffers (CUDA graphs; any
number of sequential calls on one stream may share it, see ``shared_workspace``); without one,
a per-device cached workspace is used (a fresh one while a CUDA graph is being captured).

Determinism: every sum has a fixed order and there are no atomics, so results are bitwise identical
run to run, for any grid, and the same in eager mode and CUDA graphs, which replay the same launches.

References (float64): ``additive_gemv_reference`` dequantizes in float64 and multiplies in float64.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from . import cuda_ext

try:  # Triton is optional on CPU-only installs
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

__all__ = ["additive_gemv_reference", "additive_gemv", "additive_linear", "lut_reference", "supported",
           "AdditiveWorkspace", "workspace_need", "shared_workspace", "cuda_available", "Packed2x8", "layout_2x8", "pack_2x8", "unpack_2x8"]


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
    def _epilogue(acc, rr, rmask, t, scales_ptr, bias_ptr, res_ptr, y_ptr, stride_yt, stride_rt,
                  HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
        # y[t, rr] = scale * acc (+ bias) (+ residual), rounded once to y's dtype
        y = acc * tl.load(scales_ptr + rr, mask=rmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rr, mask=rmask, other=0.0).to(tl.float32)
        if HAS_RES:
            y += tl.load(res_ptr + t * stride_rt + rr, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_yt + rr, y.to(y_ptr.dtype.element_ty), mask=rmask)

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
        _epilogue(acc, rr, rmask, t, scales_ptr, bias_ptr, res_ptr, y_ptr, stride_yt, stride_rt, HAS_BIAS, HAS_RES)

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
        _epilogue(acc, rr, rmask, t, scales_ptr, bias_ptr, res_ptr, y_ptr, stride_yt, stride_rt, HAS_BIAS, HAS_RES)


# ----------------------------------------------------------------------------- layouts and checks
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


# ----------------------------------------------------------------------------- workspace
class AdditiveWorkspace:
    """fp32 scratch of ``additive_gemv``: the 2x8 CUDA partial sums, or the Triton lookup tables.
    Any number of sequential calls on one stream may share one workspace."""

    def __init__(self, device, floats: int):
        self.scratch = torch.empty(max(1, floats), dtype=torch.float32, device=device)

    def fits(self, floats: int) -> bool:
        return self.scratch.numel() >= floats


def workspace_need(codes: torch.Tensor, codebooks: torch.Tensor, rows: int = 1) -> int:
    """fp32 scratch floats a GEMV over ``rows`` activation rows needs: 2x8 CUDA partial sums
    (ceil(G/32) * N rounded up to 16 rows) or Triton lookup tables (rows * G * M * 256); 1x16 needs none."""
    return _need(*codes.shape, codebooks.shape[1], rows)


def _need(N: int, G: int, M: int, K: int, rows: int = 1) -> int:
    if K != 256:
        return 0
    return max(-(-G // _SLICE) * _pad_rows(N), rows * G * M * 256)


def _pad_rows(N: int) -> int:
    """Rows of a 2x8 CUDA part padded to whole units (the kernel's partial sums and packed codes)."""
    return -(-N // _UNIT_ROWS) * _UNIT_ROWS


_SHARED_WS: dict[str, AdditiveWorkspace] = {}


def shared_workspace(device, floats: int) -> AdditiveWorkspace:
    """The per-device cached workspace, replaced by a larger one when it does not fit. Holders of
    an older one keep it alive (CUDA graphs captured with it stay valid)."""
    key = str(torch.device(device))
    ws = _SHARED_WS.get(key)
    if ws is None or not ws.fits(floats):
        if ws is not None:
            floats = max(floats, ws.scratch.numel())
        ws = _SHARED_WS[key] = AdditiveWorkspace(device, floats)
    return ws


def _workspace(x, codes, codebooks, rows, workspace):
    need = workspace_need(codes, codebooks, rows)
    if workspace is not None:
        if not workspace.fits(need):
            raise ValueError(f"workspace: too small, need {need} floats")
        return workspace
    if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return AdditiveWorkspace(x.device, need)  # graph-pool memory
    return shared_workspace(x.device, need)


# ----------------------------------------------------------------------------- CUDA extension
_SLICE = 32  # input groups per 2x8 slice (kSlice in the .cu)
_UNIT_ROWS = 16  # rows per 2x8 unit of work (kUnitRows in the .cu)
_ACTS = {"silu": 1, "gelu_tanh": 2}  # the 2x8 launcher's gate/up activations (act.cuh)
CUDA_MAX_ROWS_2X8 = 4  # more activation rows: Triton (the CUDA kernel runs once per row)
_EXT = None  # the compiled extension once built
_EXT_ERR: str | None = None  # why it could not be built
_CU_PATH = Path(__file__).with_name("cuda") / "additive_gemv.cu"
_CPP_DECLS = (
    "void aqlm_gemv_2x8(torch::Tensor x, std::vector<torch::Tensor> codes, torch::Tensor cb, torch::Tensor scales, "
    "torch::Tensor bias, torch::Tensor res, torch::Tensor y, torch::Tensor partial, "
    "torch::Tensor meta, int64_t has_bias, int64_t has_res, int64_t blocks_per_sm, int64_t act);\n"
    "void aqlm_gemv_1x16(torch::Tensor x, torch::Tensor codes, torch::Tensor cb, torch::Tensor scales, "
    "torch::Tensor bias, torch::Tensor res, torch::Tensor y, int64_t has_bias, int64_t has_res, int64_t ks_log2);")


@functools.lru_cache(maxsize=1)
def _build():
    # A separate extension from ``cuda_ext`` (so a failure here leaves the other kernels alone);
    # torch caches the build under ~/.cache/torch_extensions and rebuilds when the source changes.
    from torch.utils.cpp_extension import load_inline

    from . import cuda_ext

    return load_inline(name="trapetum_aqlm_gemv_v3", cpp_sources=_CPP_DECLS,
                       cuda_sources=cuda_ext.cuda_source([_CU_PATH.name]),
                       functions=["aqlm_gemv_2x8", "aqlm_gemv_1x16"], extra_cuda_cflags=["-O3", "-lineinfo"],
                       extra_include_paths=[str(_CU_PATH.parent)], verbose=False)


def _load_ext():
    """The compiled extension (built on first use), or None if it cannot be built (warned once)."""
    global _EXT, _EXT_ERR
    if _EXT is None and _EXT_ERR is None:
        try:
            _EXT = _build()
        except Exception as e:  # Triton stays the fallback
            import warnings

            _EXT_ERR = f"{type(e).__name__}: {e}"
            warnings.warn(f"trapetum: additive CUDA GEMV unavailable, using Triton ({_EXT_ERR[:300]})")
    return _EXT


def cuda_available(device: torch.device | None = None) -> bool:
    """True if the CUDA kernels may run on ``device`` (CUDA, sm_80+, TRAPETUM_TC not 0)."""
    return _CU_PATH.exists() and cuda_ext.available(torch.device(device) if device is not None else None)


def _blocks_per_sm() -> int:
    v = os.environ.get("TRAPETUM_AQLM_BPS", "")
    return int(v) if v.isdigit() and int(v) > 0 else 2


def _aligned(t: torch.Tensor, n: int) -> bool:
    return t.data_ptr() % n == 0


def _cuda_refusal(x2, codes, codebooks, scales, bias, residual, y) -> str | None:
    """Why the CUDA kernel cannot take this call (None: it can)."""
    M, K = codebooks.shape[:2]
    G = codes.shape[1]
    if (M, K) == (2, 256):
        if G % 8 or x2.shape[0] > CUDA_MAX_ROWS_2X8:
            return f"2x8 needs in % 64 == 0 and <= {CUDA_MAX_ROWS_2X8} rows"
        align = (codes, 16), (x2, 4), (codebooks, 4)
    elif (M, K) == (1, 65536):
        if x2.shape[0] != 1:
            return "1x16 takes one row"
        align = (x2, 16), (codebooks, 16)
    else:
        return f"no CUDA kernel for {M}x{K.bit_length() - 1}"
    opt = [t for t in (bias, residual) if t is not None]
    if any(t.dtype != torch.float16 for t in [x2, y, codebooks, scales] + opt):
        return "the CUDA kernels take fp16 tensors"
    if not all(t.is_contiguous() for t in [x2, y, codes, codebooks, scales] + opt):
        return "the CUDA kernels take contiguous tensors"
    if not all(_aligned(t, n) for t, n in align):
        return "misaligned tensor"
    if not cuda_available(x2.device):
        return "needs a CUDA device with compute capability >= 8.0 (and TRAPETUM_TC != 0)"
    if _load_ext() is None:
        return f"extension unavailable ({_EXT_ERR})"
    return None


def _canonical_meta(codes: torch.Tensor) -> torch.Tensor:
    """Launcher meta of one 2x8 part read in the canonical layout: (rows, offset, row stride, slice stride,
    packed = 0)."""
    N, G, _ = codes.shape
    return torch.tensor([[N, 0, 2 * G, 2 * _SLICE, 0]], dtype=torch.int64)


def _cuda_gemv(x2, codes, codebooks, scales, bias, res, y, ws) -> None:
    """One launch per activation row (2x8, canonical layout read as stored) or one launch (1x16)."""
    hb, hr = int(bias is not None), int(res is not None)
    b = bias if bias is not None else y[0]
    meta = _canonical_meta(codes) if codebooks.shape[1] == 256 else None
    for t in range(x2.shape[0]):
        r = res[t] if res is not None else y[t]
        if codebooks.shape[1] == 256:
            _EXT.aqlm_gemv_2x8(x2[t], [codes], codebooks, scales, b, r, y[t], ws.scratch, meta, hb, hr,
                               _blocks_per_sm(), 0)
        else:
            _EXT.aqlm_gemv_1x16(x2[t], codes, codebooks, scales, b, r, y[t], hb, hr, -1)


LAYOUTS_2X8 = ("slices", "rows")


def layout_2x8() -> str:
    """Code layout of packed 2x8 projections: TRAPETUM_AQLM_LAYOUT=slices (default: [slice][row][64 B],
    each block reads one contiguous stream) or rows (the canonical [row][group][2], read as stored)."""
    v = os.environ.get("TRAPETUM_AQLM_LAYOUT", "slices")
    if v not in LAYOUTS_2X8:
        raise ValueError(f"TRAPETUM_AQLM_LAYOUT: must be one of {LAYOUTS_2X8}, got {v!r}")
    return v


@functools.lru_cache(maxsize=None)
def _packed_pos(device: str = "cpu") -> torch.Tensor:
    """Where the "slices" layout stores byte b (0..63) of row rr (0..15) of a 16-row unit, in the unit's
    1,024 bytes: index rr * 64 + b. The kernel's ``packed_pos`` (cuda/additive_gemv.cu, checked against
    this by tests/test_additive_kernels.py): odd 16-byte chunks of rows r and r + 8 trade places, and
    rows r % 8 in 2..5 store each chunk with its two 8-byte halves swapped."""
    rr = torch.arange(16).view(16, 1)
    b = torch.arange(64).view(1, 64)
    r = rr & 7
    half_swap = ((r >> 1) ^ (r >> 2)) & 1
    pos = 512 * ((rr >> 3) ^ ((b >> 4) & 1)) + 64 * r + 16 * (b >> 4) + ((b & 15) ^ (8 * half_swap))
    return pos.reshape(-1).to(device)


def pack_2x8(codes: torch.Tensor, layout: str = "slices") -> torch.Tensor:
    """2x8 codes int8 [N, G, 2] in the CUDA kernel's layout, as a flat uint8 buffer. "slices":
    [ceil(G/32)][N padded to 16][64 bytes], zeros past G and N, each 16-row unit's 1,024 bytes permuted
    by ``_packed_pos`` (filled one slice at a time: no full-size temporary); "rows": the canonical bytes
    (a view when contiguous)."""
    N, G, _ = codes.shape
    if layout == "rows":
        return codes.contiguous().view(torch.uint8).reshape(-1)
    nslices, npad = -(-G // _SLICE), _pad_rows(N)
    out = torch.empty(nslices, npad // _UNIT_ROWS, _UNIT_ROWS * 2 * _SLICE, dtype=torch.uint8, device=codes.device)
    pos = _packed_pos(str(codes.device))
    for s in range(nslices):
        g0, g1 = s * _SLICE, min(G, (s + 1) * _SLICE)
        rows = torch.zeros(npad, 2 * _SLICE, dtype=torch.uint8, device=codes.device)
        rows[:N, : 2 * (g1 - g0)] = codes[:, g0:g1].reshape(N, -1).view(torch.uint8)
        out[s].index_copy_(1, pos, rows.view(npad // _UNIT_ROWS, -1))  # out[s][:, pos[i]] = rows[:, i]
    return out.reshape(-1)


def unpack_2x8(buf: torch.Tensor, N: int, G: int, layout: str = "slices") -> torch.Tensor:
    """Inverse of ``pack_2x8``: int8 [N, G, 2] (a view for "rows", a copy for "slices")."""
    if layout == "rows":
        return buf.view(torch.int8).view(N, G, 2)
    nslices, npad = -(-G // _SLICE), _pad_rows(N)
    v = buf.view(nslices, npad // _UNIT_ROWS, -1)[:, :, _packed_pos(str(buf.device))]  # canonical row order
    v = v.reshape(nslices, npad, 2 * _SLICE).transpose(0, 1)[:N].reshape(N, -1)[:, : 2 * G]
    return v.view(torch.int8).reshape(N, G, 2)


class Packed2x8:
    """2x8 projections that share an input (q, k, v; gate, up), packed once for one CUDA launch.

    parts: (codes int8 [N, G, 2], codebooks fp16 [2, 256, 1, 8], scales [N, 1, 1, 1], bias [N] or None),
    all with the same G (G % 8 == 0) on one CUDA device. layout "slices": part q's codes become
    [ceil(G/32) slices][N padded to 16][64 bytes] (zeros past G and N, each 16-row unit permuted for
    the kernel's lanes: ``pack_2x8``), so that the (slice, 16-row) units a block takes are one
    contiguous stream; "rows": the canonical codes as they are (no copy). Each part keeps its own
    buffer; outputs, scales and bias are the parts' rows concatenated."""

    def __init__(self, parts, layout: str | None = None):
        layout = layout or layout_2x8()
        if layout not in LAYOUTS_2X8:
            raise ValueError(f"layout: must be one of {LAYOUTS_2X8}, got {layout!r}")
        if not 1 <= len(parts) <= 4:
            raise ValueError(f"parts: 1 to 4 projections per launch, got {len(parts)}")
        G = parts[0][0].shape[1]
        for codes, cb, sc, _ in parts:
            if tuple(cb.shape) != (2, 256, 1, 8) or codes.dtype != torch.int8 or codes.shape[1:] != (G, 2):
                raise ValueError(f"parts: need 2x8 codes [N, {G}, 2] with codebooks [2, 256, 1, 8]")
        if G % 8:
            raise ValueError(f"parts: in_features {8 * G} is not a multiple of 64")
        self.layout, self.G, self.nslices = layout, G, -(-G // _SLICE)
        dev = parts[0][0].device
        self.codes, meta = [], []
        for codes, _, _, _ in parts:
            self.codes.append(pack_2x8(codes, layout))
            meta.append(self._meta(codes.shape[0]))
        self.meta = torch.tensor(meta, dtype=torch.int64)
        self.codebooks = torch.stack([cb.reshape(2, 256, 8) for _, cb, _, _ in parts]).to(torch.float16).contiguous()
        self.scales = torch.cat([sc.reshape(-1) for _, _, sc, _ in parts]).to(torch.float16).contiguous()
        self.rows = [c.shape[0] for c, _, _, _ in parts]
        self.bias = None
        if any(b is not None for _, _, _, b in parts):
            self.bias = torch.cat([b.reshape(-1) if b is not None else torch.zeros(c.shape[0], device=dev)
                                   for c, _, _, b in parts]).to(torch.float16).contiguous()
        self.need = self.nslices * sum(_pad_rows(n) for n in self.rows)  # fp32 partial sums

    def _meta(self, N: int) -> list[int]:
        """Launcher meta of one part: (rows, byte offset, row stride, slice stride, packed)."""
        if self.layout == "slices":
            return [N, 0, 2 * _SLICE, 2 * _SLICE * _pad_rows(N), 1]
        return [N, 0, 2 * self.G, 2 * _SLICE, 0]

    def canonical_codes(self, i: int) -> torch.Tensor:
        """Part i's codes in the canonical layout int8 [N, G, 2] (a view for "rows", a copy for "slices")."""
        return unpack_2x8(self.codes[i], self.rows[i], self.G, self.layout)

    def gemv(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None, *,
             workspace: AdditiveWorkspace | None = None) -> torch.Tensor:
        """out [sum N] = concat_q(x [8 G] @ W_q.T (+ bias_q)) (+ residual): one launch, fp16 in and out."""
        n = sum(self.rows)
        if x.numel() != 8 * self.G or out.numel() != n or (residual is not None and residual.numel() != n):
            raise ValueError(f"x/out/residual: expected {8 * self.G} inputs and {n} outputs")
        return self._launch(x, out, residual, 0, workspace)

    def fuses_gate_up(self) -> bool:
        """True if the parts are a gate/up pair that ``gemv_gate_up`` can run (two parts of equal rows)."""
        return len(self.rows) == 2 and self.rows[0] == self.rows[1]

    def gemv_gate_up(self, x: torch.Tensor, out: torch.Tensor, act: str, *,
                     workspace: AdditiveWorkspace | None = None) -> torch.Tensor:
        """out [N] = act(gate) * up for the parts (gate, up), in the launch's reduction kernel: the gate and
        up rows are rounded to fp16 first, as ``fused.act_mul`` on ``gemv``'s output sees them."""
        if not self.fuses_gate_up():
            raise ValueError(f"gemv_gate_up: needs two parts of equal rows, got {self.rows}")
        if act not in _ACTS:
            raise ValueError(f"act: must be one of {tuple(_ACTS)}, got {act!r}")
        if x.numel() != 8 * self.G or out.numel() != self.rows[0]:
            raise ValueError(f"x/out: expected {8 * self.G} inputs and {self.rows[0]} outputs")
        return self._launch(x, out, None, _ACTS[act], workspace)

    def _launch(self, x, out, residual, act: int, workspace) -> torch.Tensor:
        """The kernel pair (main + reduction) on checked shapes; act 0 = the parts' rows, else a gate/up pair."""
        if _load_ext() is None:
            raise RuntimeError(f"Packed2x8: the CUDA extension is unavailable ({_EXT_ERR})")
        ws = workspace if workspace is not None else shared_workspace(x.device, self.need)
        if not ws.fits(self.need):
            raise ValueError(f"workspace: too small, need {self.need} floats")
        y = out.view(-1)
        _EXT.aqlm_gemv_2x8(x.reshape(-1), self.codes, self.codebooks, self.scales,
                           self.bias if self.bias is not None else y, residual.view(-1) if residual is not None else y,
                           y, ws.scratch, self.meta, int(self.bias is not None), int(residual is not None),
                           _blocks_per_sm(), act)
        return out

    def nbytes(self) -> int:
        return sum(c.numel() for c in self.codes) + self.codebooks.numel() * 2 + self.scales.numel() * 2


# ----------------------------------------------------------------------------- public API
def additive_gemv(x: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, *, workspace: AdditiveWorkspace | None = None,
                  backend: str | None = None, block_r: int = 64, block_g: int = 16) -> torch.Tensor:
    """y [..., out] = x [..., in] @ W.T (+ bias) (+ residual), in x's dtype (fp32 accumulation).

    backend: None (CUDA kernel when it takes the call, else Triton), "cuda" or "triton".
    workspace: static scratch (see ``AdditiveWorkspace``) for CUDA graphs. Raises ValueError on bad
    shapes or a backend that cannot take the call; RuntimeError when no backend can run here."""
    _check(x, codes, codebooks, scales, bias, residual, out)
    if backend not in (None, "cuda", "triton"):
        raise ValueError(f"backend: must be None, 'cuda' or 'triton', got {backend!r}")
    M, K = codebooks.shape[:2]
    N, G, _ = codes.shape
    x2 = x.reshape(-1, G * 8)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    y = out.view(T, N) if out is not None else torch.empty(T, N, dtype=x.dtype, device=x.device)
    res = residual.reshape(T, N) if residual is not None else None
    why = _cuda_refusal(x2, codes, codebooks, scales, bias, res, y) if backend != "triton" else "triton asked"
    if backend == "cuda" and why is not None:
        raise ValueError(f"backend: 'cuda' cannot take this call: {why}")
    ws = _workspace(x, codes, codebooks, T, workspace) if K == 256 else None
    if why is None:
        _cuda_gemv(x2, codes, codebooks, scales, bias, res, y, ws)
        return y.view(*x.shape[:-1], N)
    if not _triton_ok(x.device):
        raise RuntimeError("additive_gemv: needs CUDA or TRITON_INTERPRET=1")
    res = res if res is not None else y
    b = bias if bias is not None else y
    codes, cbk, sc = codes.contiguous(), codebooks.contiguous(), scales.contiguous()
    grid = (triton.cdiv(N, block_r), T)
    if K == 256:
        lut = ws.scratch
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
BENCH_SHAPES = ((4096, 4096), (4096, 11008), (11008, 4096), (8192, 28672), (28672, 8192))


def _random_layout(n, k, M, nb, gen, device="cuda"):
    """Random codes, codebooks and scales of an n x k additive matrix (canonical layout)."""
    from ..quant.additive import index_to_codes

    K = 1 << nb
    codes = index_to_codes(torch.randint(0, K, (n, k // 8, M), device=device, generator=gen), nb)
    cb = torch.randn(M, K, 1, 8, device=device, generator=gen).half()
    sc = (torch.rand(n, 1, 1, 1, device=device, generator=gen) * 0.05 + 0.01).half()
    return codes, cb, sc


def _bench_variants(layout, backends, bps_sweep):
    """(label, backend, TRAPETUM_AQLM_BPS or None) to time for one layout (the sweep: 2x8 only)."""
    out = [(b, b, None) for b in backends if b != "cuda" or cuda_available()]
    if cuda_available() and layout == (2, 8) and "cuda" in backends:
        out.append(("cuda_slices", "cuda_slices", None))  # the engine's path: Packed2x8, "slices" layout
        out += [(f"cuda_bps{v}", "cuda", str(v)) for v in bps_sweep]
    return out


def _time_additive(k, n, M, nb, backend, bps, gen, block_r, block_g, device="cuda"):
    from ..eval.bench_e2e import with_env
    from ..eval.bench_kernels import graph_time_us

    q_bytes = n * (k // 8) * M * (nb // 8) + M * (1 << nb) * 16 + n * 2 + k * 2 + n * 2
    ws = AdditiveWorkspace(device, _need(n, k // 8, M, 1 << nb))

    def make_q(i):
        codes, cb, sc = _random_layout(n, k, M, nb, gen, device)
        x = torch.randn(1, k, device=device, dtype=torch.float16, generator=gen)
        y = torch.empty(1, n, device=device, dtype=torch.float16)
        if backend == "cuda_slices":
            packed = Packed2x8([(codes, cb, sc, None)], layout="slices")
            return lambda: packed.gemv(x, y, workspace=ws)
        return lambda: additive_gemv(x, codes, cb, sc, out=y, workspace=ws, backend=backend,
                                     block_r=block_r, block_g=block_g)

    with with_env("TRAPETUM_AQLM_BPS", bps or os.environ.get("TRAPETUM_AQLM_BPS", "")):
        return graph_time_us(make_q, q_bytes), q_bytes


def bench(shapes=BENCH_SHAPES, layouts=((2, 8), (1, 16)), backends=("cuda", "triton"), bps_sweep=(),
          block_r: int = 64, block_g: int = 16, device="cuda") -> list[dict]:
    """Batch-1 GEMV vs cuBLAS fp16 in one process (shape = in x out), CUDA-graph replays with weights
    rotated past L2 (``trapetum.eval.bench_kernels.graph_time_us``); the Triton 2x8 time includes its
    LUT launch. ``bps_sweep``: extra CUDA rows with TRAPETUM_AQLM_BPS set to each value."""
    from ..eval.bench_kernels import graph_time_us

    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for k, n in shapes:
        fp16_bytes = n * k * 2 + k * 2 + n * 2

        def make_dense(i, n=n, k=k):
            w = torch.randn(n, k, device=device, dtype=torch.float16, generator=gen)
            x = torch.randn(1, k, device=device, dtype=torch.float16, generator=gen)
            y = torch.empty(1, n, device=device, dtype=torch.float16)
            return lambda: torch.matmul(x, w.t(), out=y)

        cublas = graph_time_us(make_dense, fp16_bytes)
        for M, nb in layouts:
            for label, backend, bps in _bench_variants((M, nb), backends, bps_sweep):
                us, q_bytes = _time_additive(k, n, M, nb, backend, bps, gen, block_r, block_g, device)
                rows.append({"shape": f"{k}x{n}", "layout": f"{M}x{nb}", "backend": label, "us": round(us, 2),
                             "cublas_us": round(cublas, 2), "vs_cublas": round(cublas / us, 3),
                             "GBps": round(q_bytes / us / 1e3, 1)})
                print(rows[-1], flush=True)
    print(bench_table(rows))
    return rows


def bench_table(rows: list[dict]) -> str:
    lines = ["| shape (in x out) | layout | backend | us | cuBLAS fp16 us | vs cuBLAS | GB/s |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['layout']} | {r['backend']} | {r['us']:.1f} | {r['cublas_us']:.1f} | "
              f"{r['vs_cublas']:.2f}x | {r['GBps']:.0f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="additive GEMV vs cuBLAS fp16 (batch 1, CUDA graphs)")
    p.add_argument("--backends", default="cuda,triton")
    p.add_argument("--bps", default="", help="extra CUDA 2x8 rows with TRAPETUM_AQLM_BPS=each value, e.g. 1,3")
    p.add_argument("--layouts", default="2x8,1x16")
    p.add_argument("--block-r", type=int, default=64)
    p.add_argument("--block-g", type=int, default=16)
    p.add_argument("--json", default="", help="write the rows here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the additive GEMV benchmark needs a CUDA GPU")
        return 1
    layouts = [tuple(int(v) for v in s.split("x")) for s in a.layouts.split(",") if s]
    rows = bench(layouts=layouts, backends=tuple(b for b in a.backends.split(",") if b),
                 bps_sweep=tuple(int(v) for v in a.bps.split(",") if v), block_r=a.block_r, block_g=a.block_g)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":  # python -m trapetum.kernels.additive_gemv [--bps 1,3] [--json PATH]
    raise SystemExit(main())
