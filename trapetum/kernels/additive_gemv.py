"""Additive-codebook (AQLM layout) GEMV for decode and verify rows: y[T, out] = x[T, in] @ W.T (+ bias) (+ residual).

W[o, 8g:8g+8] = scales[o] * sum_m codebooks[m, codes[o, g, m]]  (in_group 8, out_group 1; layouts, packing and
the dequantization reference: ``additive_layout``). The canonical layout (codes int8/int16 [out, G, M],
codebooks fp16 [M, K, 1, 8], scales fp16 [out, 1, 1, 1]) is what ``additive_gemv`` takes and reads as stored.
The decode engine instead packs the 2x8 projections that share an input once (``Packed2x8``): codes in the
kernel's "slices" layout, q/k/v or gate/up in one launch, act(gate) * up in the launch's reduction.

Backends (``additive_gemv(..., backend=None)`` picks one from the weights, the dtype and ``kopts`` only):

* "cuda" (``cuda/additive_gemv.cu``, compute capability >= 8.0, fp16, ``kopts.cuda``). 2x8 (two codebooks of
  256, in % 64 == 0): per slice of 32 input groups a block builds the lookup table
  ``lut[k][(g, m)] = x_g . codebooks[m, k]`` (fp32, 64 KB of shared memory, with mma.sync), then streams the
  codes of its rows, one table lookup per code, conflict-free; partial sums per (slice, row) go to the
  workspace and a second small kernel adds each row's partials in a fixed order and applies the epilogue.
  1x16 (one codebook of 65,536 entries): a warp owns 4 rows and gathers the 16-byte codebook entries of its
  codes through L1/L2. Up to 16 activation rows per launch (more: launches of 16). The .cu file's header has
  the design, the budgets and why each row of a multi-row launch has the one-row launch's bits. Blocks per
  SM of the 2x8 kernel: ``kopts.aqlm_blocks_per_sm``; programmatic launch: ``kopts.pdl_cuda``.
* "triton" (any supported layout, any rows, any float dtype; also the CPU under TRITON_INTERPRET=1). 2x8 and
  other 256-entry layouts (M in 1..4): lookup tables ``lut[t, g, m, k]`` (fp32, in the workspace; up to 4
  activation rows at a time) by ``_lut_kernel`` (BLOCK_G groups per program, the 8 products summed in a fixed
  order), then one program per (BLOCK_R output rows, activation row) walks the groups in order, gathers
  ``lut[t, g, m, code]``, sums each group block with ``tl.sum`` and adds block sums into a per-row fp32
  accumulator in group order. 1x16: one program per (BLOCK_R rows, activation row) gathers the 16-byte
  codebook entries of its codes and takes the dot product with x.

Batch invariance: row t of a T-row call is bitwise what a call with row t alone gives, whatever the other
rows hold. CUDA: the kernels' contract (each row's lookups, sums and epilogue are the one-row launch's;
tested bitwise on the GPU and, for 2x8, on the CPU by tests/cuda/additive_2x8_host_check.cu). Triton: every
program handles one activation row with block shapes that do not depend on T. The backend never depends on T
or on how the activations are laid out (copies make them contiguous and aligned where the CUDA kernels need it).

Workspace: ``AdditiveWorkspace`` (fp32 scratch) holds the 2x8 partial sums (CUDA) or lookup tables (Triton).
Pass one to use static buffers (CUDA graphs; any number of sequential calls on one stream may share it, see
``shared_workspace``; ``workspace_need(..., rows=16)`` covers verify rows); without one, a per-device cached
workspace is used (a fresh one while a CUDA graph is being captured).

Determinism: every sum has a fixed order and there are no atomics, so results are bitwise identical run to
run, for any grid, and the same in eager mode and CUDA graphs, which replay the same launches.

References (float64): ``additive_gemv_reference`` dequantizes in float64 and multiplies in float64.
"""
from __future__ import annotations

import torch

from ..settings import DEFAULT_KERNELS, KernelOptions
from . import cuda_ext
from .additive_layout import LAYOUTS_2X8, SLICE, dequantize_aqlm, pack_2x8, pad_rows, unpack_2x8
from .triton_util import HAVE_TRITON, ROW_POINTERS, triton_ok

__all__ = ["additive_gemv_reference", "additive_gemv", "additive_linear", "lut_reference", "supported",
           "AdditiveWorkspace", "workspace_need", "shared_workspace", "cuda_available", "Packed2x8", "pack_2x8",
           "unpack_2x8", "LAYOUTS_2X8", "CUDA_MAX_ROWS", "EXT"]

CUDA_MAX_ROWS = 16  # activation rows per CUDA launch (kMaxRows in the .cu); more rows: launches of 16
TRITON_LUT_ROWS = 4  # activation rows whose Triton lookup tables are built at a time (bounds the workspace)


# ----------------------------------------------------------------------------- references
def additive_gemv_reference(x, codes, codebooks, scales, bias=None, residual=None) -> torch.Tensor:
    """float64: x [..., in] @ W.T (+ bias) (+ residual) -> float64 [..., out]."""
    W = dequantize_aqlm(codes, codebooks, scales, torch.float64)
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
if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=("x_ptr",))
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

    @triton.jit(do_not_specialize=("res_ptr", "y_ptr"))
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

    @triton.jit(do_not_specialize=ROW_POINTERS)
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


# ----------------------------------------------------------------------------- checks
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


def workspace_need(codes: torch.Tensor, codebooks: torch.Tensor, rows: int = 1, backend: str | None = None) -> int:
    """fp32 scratch floats a GEMV over ``rows`` activation rows needs: 2x8 CUDA partial sums
    (min(rows, 16) * ceil(G / 32) * N rounded up to 16 rows) and/or Triton lookup tables
    (min(rows, 4) * G * M * 256); ``backend`` None: enough for either. 1x16 needs none."""
    if backend not in (None, "cuda", "triton"):
        raise ValueError(f"backend: must be None, 'cuda' or 'triton', got {backend!r}")
    return _need(*codes.shape, codebooks.shape[1], rows, backend)


def _need(N: int, G: int, M: int, K: int, rows: int = 1, backend: str | None = None) -> int:
    if rows < 1:
        raise ValueError(f"rows: must be at least 1, got {rows}")
    if K != 256:
        return 0
    cuda = min(rows, CUDA_MAX_ROWS) * -(-G // SLICE) * pad_rows(N)
    tri = min(rows, TRITON_LUT_ROWS) * G * M * 256
    return cuda if backend == "cuda" else tri if backend == "triton" else max(cuda, tri)


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


def _workspace(device, need: int, workspace):
    if workspace is not None:
        if not workspace.fits(need):
            raise ValueError(f"workspace: too small, need {need} floats")
        return workspace
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return AdditiveWorkspace(device, need)  # graph-pool memory
    return shared_workspace(device, need)


# ----------------------------------------------------------------------------- CUDA extension
_ACTS = {"silu": 1, "gelu_tanh": 2}  # the 2x8 launcher's gate/up activations (act.cuh)
_DECLS = (
    "void aqlm_gemv_2x8(torch::Tensor x, std::vector<torch::Tensor> codes, torch::Tensor cb, torch::Tensor scales, "
    "torch::Tensor bias, torch::Tensor res, torch::Tensor y, torch::Tensor partial, torch::Tensor meta, "
    "int64_t has_bias, int64_t has_res, int64_t blocks_per_sm, int64_t act, int64_t pdl);\n"
    "void aqlm_gemv_1x16(torch::Tensor x, torch::Tensor codes, torch::Tensor cb, torch::Tensor scales, "
    "torch::Tensor bias, torch::Tensor res, torch::Tensor y, int64_t has_bias, int64_t has_res, int64_t ks_log2, "
    "int64_t pdl);")
# A separate extension from the main one (a failure here leaves the other kernels alone).
EXT = cuda_ext.Extension("trapetum_aqlm_gemv_v4", ("additive_gemv.cu",), _DECLS, ["aqlm_gemv_2x8", "aqlm_gemv_1x16"])


def cuda_available(device: torch.device | None = None, kopts: KernelOptions = DEFAULT_KERNELS) -> bool:
    """True if the CUDA kernels run on ``device`` (CUDA, sm_80+, ``kopts.cuda``, the extension builds)."""
    return EXT.ready(torch.device(device) if device is not None else None, kopts) is not None


def _aligned(t: torch.Tensor, n: int) -> bool:
    return t.data_ptr() % n == 0


def _cuda_refusal(x2, codes, codebooks, scales, bias, y, kopts) -> str | None:
    """Why the CUDA kernels cannot take this call (None: they can). Only the weights, the dtypes, the device
    and ``kopts`` decide (never the rows or the activations' layout: the caller copies those)."""
    M, K = codebooks.shape[:2]
    G = codes.shape[1]
    if (M, K) == (2, 256):
        if G % 8:
            return "2x8 needs in % 64 == 0"
        align = (codes, 16), (codebooks, 4)
    elif (M, K) == (1, 65536):
        align = ((codebooks, 16),)
    else:
        return f"no CUDA kernel for {M}x{K.bit_length() - 1}"
    if any(t.dtype != torch.float16 for t in [x2, y, codebooks, scales] + ([bias] if bias is not None else [])):
        return "the CUDA kernels take fp16 tensors"
    if not all(t.is_contiguous() for t in [codes, codebooks, scales] + ([bias] if bias is not None else [])):
        return "the CUDA kernels take contiguous weights"
    if not all(_aligned(t, n) for t, n in align):
        return "misaligned weights"
    if not cuda_available(x2.device, kopts):
        err = EXT.error()
        return f"extension unavailable ({err})" if err else "needs a CUDA device with compute capability >= 8.0 " \
                                                            "and kopts.cuda"
    return None


def rows_ready(t: torch.Tensor | None, align: int = 16) -> torch.Tensor | None:
    """t [T, n] contiguous and aligned for the CUDA launchers (a copy only when it is not)."""
    if t is None:
        return None
    t = t.contiguous()
    return t if _aligned(t, align) else t.clone()


def _cuda_gemv(x2, codes, codebooks, scales, bias, res, y, ws, kopts) -> None:
    """Launches of up to 16 activation rows (2x8: canonical layout read as stored, partials in ``ws``)."""
    T, N = y.shape
    x2, res = rows_ready(x2), rows_ready(res)
    yc = y if y.is_contiguous() and _aligned(y, 16) else torch.empty(T, N, dtype=y.dtype, device=y.device)
    hb, hr, pdl = int(bias is not None), int(res is not None), int(kopts.pdl_cuda)
    ext = EXT.load()
    meta = torch.tensor([[N, 0, 2 * codes.shape[1], 2 * SLICE, 0]], dtype=torch.int64)
    for t0 in range(0, T, CUDA_MAX_ROWS):
        t1 = min(T, t0 + CUDA_MAX_ROWS)
        xs, ys = x2[t0:t1], yc[t0:t1]
        rs = res[t0:t1] if res is not None else ys
        b = bias if bias is not None else ys
        if codebooks.shape[1] == 256:
            ext.aqlm_gemv_2x8(xs, [codes], codebooks, scales, b, rs, ys, ws.scratch, meta, hb, hr,
                              kopts.aqlm_blocks_per_sm, 0, pdl)
        else:
            ext.aqlm_gemv_1x16(xs, codes, codebooks, scales, b, rs, ys, hb, hr, -1, pdl)
    if yc is not y:
        y.copy_(yc)


class Packed2x8:
    """2x8 projections that share an input (q, k, v; gate, up), packed once for one CUDA launch.

    parts: (codes int8 [N, G, 2], codebooks fp16 [2, 256, 1, 8], scales [N, 1, 1, 1], bias [N] or None),
    all with the same G (G % 8 == 0) on one CUDA device. layout "slices" (``additive_layout.pack_2x8``):
    the (slice, 16-row) units a block takes are one contiguous stream; "rows": the canonical codes as they
    are (no copy). Each part keeps its own buffer; outputs, scales and bias are the parts' rows concatenated.
    ``need``: fp32 partial sums of one activation row (``need_for(rows)``: of a call over ``rows``)."""

    def __init__(self, parts, layout: str = "slices"):
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
        self.layout, self.G, self.nslices = layout, G, -(-G // SLICE)
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
        self.need = self.nslices * sum(pad_rows(n) for n in self.rows)  # fp32 partial sums per activation row

    def need_for(self, rows: int) -> int:
        """fp32 partial sums of a call over ``rows`` activation rows (launches of up to 16 rows)."""
        if rows < 1:
            raise ValueError(f"rows: must be at least 1, got {rows}")
        return min(rows, CUDA_MAX_ROWS) * self.need

    def _meta(self, N: int) -> list[int]:
        """Launcher meta of one part: (rows, byte offset, row stride, slice stride, packed)."""
        if self.layout == "slices":
            return [N, 0, 2 * SLICE, 2 * SLICE * pad_rows(N), 1]
        return [N, 0, 2 * self.G, 2 * SLICE, 0]

    def canonical_codes(self, i: int) -> torch.Tensor:
        """Part i's codes in the canonical layout int8 [N, G, 2] (a view for "rows", a copy for "slices")."""
        return unpack_2x8(self.codes[i], self.rows[i], self.G, self.layout)

    def _rows_of(self, x: torch.Tensor, name: str = "x") -> int:
        if x.numel() == 0 or x.numel() % (8 * self.G) or x.shape[-1] != 8 * self.G:
            raise ValueError(f"{name}: expected [rows, {8 * self.G}] (or [{8 * self.G}]), got {tuple(x.shape)}")
        return x.numel() // (8 * self.G)

    def gemv(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None, *,
             workspace: AdditiveWorkspace | None = None, kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
        """out [T, sum N] = concat_q(x [T, 8 G] @ W_q.T (+ bias_q)) (+ residual [T, sum N]), fp16 in and out
        (1-D x, out, residual: one row); launches of up to 16 rows, every row the one-row call's bits."""
        T, n = self._rows_of(x), sum(self.rows)
        if out.numel() != T * n or (residual is not None and residual.numel() != T * n):
            raise ValueError(f"out/residual: expected {T} x {n} outputs, got {tuple(out.shape)}"
                             f"{'' if residual is None else ' / ' + str(tuple(residual.shape))}")
        return self._launch(x, out, residual, 0, workspace, kopts)

    def fuses_gate_up(self) -> bool:
        """True if the parts are a gate/up pair that ``gemv_gate_up`` can run (two parts of equal rows)."""
        return len(self.rows) == 2 and self.rows[0] == self.rows[1]

    def gemv_gate_up(self, x: torch.Tensor, out: torch.Tensor, act: str, *, workspace: AdditiveWorkspace | None = None,
                     kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
        """out [T, N] = act(gate) * up for the parts (gate, up), in the launch's reduction kernel: the gate and
        up rows are rounded to fp16 first, as ``fused.act_mul`` on ``gemv``'s output sees them."""
        if not self.fuses_gate_up():
            raise ValueError(f"gemv_gate_up: needs two parts of equal rows, got {self.rows}")
        if act not in _ACTS:
            raise ValueError(f"act: must be one of {tuple(_ACTS)}, got {act!r}")
        T = self._rows_of(x)
        if out.numel() != T * self.rows[0]:
            raise ValueError(f"out: expected {T} x {self.rows[0]} outputs, got {tuple(out.shape)}")
        return self._launch(x, out, None, _ACTS[act], workspace, kopts)

    def _launch(self, x, out, residual, act: int, workspace, kopts) -> torch.Tensor:
        """The kernel pair (main + reduction) per 16 rows; act 0 = the parts' rows, else a gate/up pair."""
        ext = EXT.ready(x.device, kopts)
        if ext is None:
            raise RuntimeError(f"Packed2x8: the CUDA kernels are unavailable ({EXT.error() or 'kopts or device'})")
        if x.dtype != torch.float16 or out.dtype != torch.float16 or (residual is not None and
                                                                    residual.dtype != torch.float16):
            raise ValueError("x/out/residual: Packed2x8 takes fp16 tensors")
        T = self._rows_of(x)
        ws = _workspace(x.device, self.need_for(T), workspace)
        n_out = out.numel() // T
        x2 = rows_ready(x.reshape(T, -1))
        res = rows_ready(residual.reshape(T, -1)) if residual is not None else None
        y = out.view(T, n_out) if out.is_contiguous() and _aligned(out, 16) else \
            torch.empty(T, n_out, dtype=out.dtype, device=out.device)
        b = self.bias if self.bias is not None else y
        for t0 in range(0, T, CUDA_MAX_ROWS):
            t1 = min(T, t0 + CUDA_MAX_ROWS)
            ys = y[t0:t1]
            ext.aqlm_gemv_2x8(x2[t0:t1], self.codes, self.codebooks, self.scales, b,
                              res[t0:t1] if res is not None else ys, ys, ws.scratch, self.meta,
                              int(self.bias is not None), int(res is not None), kopts.aqlm_blocks_per_sm, act,
                              int(kopts.pdl_cuda))
        if y.data_ptr() != out.data_ptr():
            out.copy_(y.view(out.shape))
        return out

    def nbytes(self) -> int:
        return sum(c.numel() for c in self.codes) + self.codebooks.numel() * 2 + self.scales.numel() * 2


# ----------------------------------------------------------------------------- public API
def additive_gemv(x: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, *, workspace: AdditiveWorkspace | None = None,
                  backend: str | None = None, block_r: int = 64, block_g: int = 16,
                  kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """y [..., out] = x [..., in] @ W.T (+ bias) (+ residual), in x's dtype (fp32 accumulation).

    backend: None (the CUDA kernels when they take the weights and dtypes, else Triton), "cuda" or "triton".
    workspace: static scratch (see ``AdditiveWorkspace``) for CUDA graphs. Every row of the result is bitwise
    what the call gives for that row alone (module docstring). Raises ValueError on bad shapes or a backend
    that cannot take the call; RuntimeError when no backend can run here."""
    _check(x, codes, codebooks, scales, bias, residual, out)
    if backend not in (None, "cuda", "triton"):
        raise ValueError(f"backend: must be None, 'cuda' or 'triton', got {backend!r}")
    if block_r < 1 or block_r & (block_r - 1) or block_g < 1 or block_g & (block_g - 1):
        raise ValueError(f"block_r/block_g: powers of two, got {block_r}/{block_g}")
    M, K = codebooks.shape[:2]
    N, G, _ = codes.shape
    x2 = x.reshape(-1, G * 8)
    T = x2.shape[0]
    y = out.view(T, N) if out is not None else torch.empty(T, N, dtype=x.dtype, device=x.device)
    res = residual.reshape(T, N) if residual is not None else None
    why = _cuda_refusal(x2, codes, codebooks, scales, bias, y, kopts) if backend != "triton" else "triton asked"
    if backend == "cuda" and why is not None:
        raise ValueError(f"backend: 'cuda' cannot take this call: {why}")
    if why is None:
        ws = _workspace(x.device, workspace_need(codes, codebooks, T, "cuda"), workspace) if K == 256 else None
        _cuda_gemv(x2, codes, codebooks, scales, bias, res, y, ws, kopts)
        return y.view(*x.shape[:-1], N)
    if not triton_ok(x.device):
        raise RuntimeError("additive_gemv: needs CUDA or TRITON_INTERPRET=1")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    res = res if res is not None else y
    b = bias if bias is not None else y
    codes, cbk, sc = codes.contiguous(), codebooks.contiguous(), scales.contiguous()
    common = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK_R=block_r, BLOCK_G=block_g)
    if K != 256:
        grid = (triton.cdiv(N, block_r), T)
        _gemv_gather_kernel[grid](x2, codes, cbk, sc, b, res, y, N, G, x2.stride(0), y.stride(0), res.stride(0),
                                  K=K, **common)
        return y.view(*x.shape[:-1], N)
    lut = _workspace(x.device, workspace_need(codes, codebooks, T, "triton"), workspace).scratch
    for t0 in range(0, T, TRITON_LUT_ROWS):  # the tables of up to 4 rows, then their GEMV programs
        t1 = min(T, t0 + TRITON_LUT_ROWS)
        xs, ys, rs = x2[t0:t1], y[t0:t1], res[t0:t1] if residual is not None else y[t0:t1]
        _lut_kernel[(triton.cdiv(G, 8), t1 - t0)](xs, cbk, lut, G, xs.stride(0), M=M, K=K, BLOCK_G=8)
        _gemv_lut_kernel[(triton.cdiv(N, block_r), t1 - t0)](codes, lut, sc, b, rs, ys, N, G, ys.stride(0),
                                                             rs.stride(0), M=M, K=K, **common)
    return y.view(*x.shape[:-1], N)


GEMV_MAX_ROWS = 8  # more rows than this (prefill): dequantize once, then a tensor-core matmul


def additive_linear(x, codes, codebooks, scales, bias=None, *, kopts: KernelOptions = DEFAULT_KERNELS):
    """The module hook (``AdditiveLinear.forward`` on CUDA): the GEMV kernel for a few rows, None to
    decline (unsupported layout, no Triton, many rows: the caller dequantizes and multiplies)."""
    if not supported(codes, codebooks) or not triton_ok(x.device):
        return None
    if x.numel() // x.shape[-1] > GEMV_MAX_ROWS or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    return additive_gemv(x, codes, codebooks, scales, bias, kopts=kopts)
