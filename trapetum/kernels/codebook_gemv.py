"""Per-row codebook GEMV: y[M, out] = x[M, in] @ W.T (+ residual), W[r, c] = codebook[r, idx(r, c)], M = 1..16.

Canonical weight layouts (the .cbk file keeps these; ``trapetum.kernels.pack`` packs them):
  bits=4: codes uint8 [out, ceil(in/2)], column 2j in the low nibble, 2j+1 in the high nibble;
          codebook fp16 [out, 16].
  bits=8: codes uint8 [out, in]; codebook fp16 [out, 256]            (LM head)
  bits=2: codes uint8 [out, ceil(in/4)], column 4j+k at bits 2k..2k+1; codebook fp16 [out, 4].
Load-time layouts (``codebook_layout``, re-exported here): ``interleave_gate_up`` (rows in groups of 16: 8 gate,
then the same 8 up rows, for ``codebook_gemv_gate_up``, which returns act(gate) * up with act = "silu" or
"gelu_tanh") and ``tile_codes`` (the CUDA kernel's tiled codes; ``tiled=True`` calls). q/k/v fusion needs no
kernel: per-row codebooks let q, k and v rows be concatenated.

Backends (``backend=None`` picks the first that applies):
  "mma"    CUDA C++ tensor-core kernel (``cuda/codebook_gemv_mma.cu``: its comment has the design): bits 4 and 8,
           M <= 16, in % 128 == 0 (4-bit) or in % 64 == 0 (8-bit), compute capability >= 8.0, ``kopts.cuda``.
           Reads canonical codes, or (``tiled=True``, the engine's layout) tiled codes; both give the same bits.
           With the kernels off, tiled codes are untiled for the fallbacks. Tiled codes also take more than 16 rows
           (up to ``MAX_GROUPED_ROWS``: groups of 16 in one launch), 4-bit ones of 17 or more on Hopper through the
           warpgroup-MMA kernel (``codebook_gemm_wgmma``, ``kopts.many_rows``), with the same bits.
  "triton" Triton kernel, bits in {2, 4, 8}, any M and shape; also runs on the CPU under TRITON_INTERPRET=1.
  "torch"  dequantize + fp32 matrix-vector products (the CPU fallback when Triton cannot run).

Contracts. Every backend accumulates in fp32 in a fixed order: bitwise reproducible run to run. Batch invariance:
under the same backend and options, row m of an M-row call has exactly the bits of an M = 1 call on row m,
whatever the other rows hold (speculative verify relies on it). "mma": see the kernel's comment (x is the mma's B
operand, columns are independent, the chunk order and the cross-warp reduction are fixed; M = 1 runs the decode
kernel as it is, M >= 3 reads a fragment-order copy of x). "triton": one program per (block of weight rows,
activation row), tile sizes chosen from K and the device kind only, never from M. "torch": one row at a time.
``kopts.triton_gather`` picks tl.gather of the codebook tile (in registers) or a load per weight in the Triton
kernel; whether this Triton can lower tl.gather is found out once per process and device kind, at the first
call (a failure then falls back for the whole process with a warning; a later failure raises).
"""
from __future__ import annotations

import threading
import warnings

import torch

from ..settings import DEFAULT_KERNELS, KernelOptions
from . import codebook_gemm_wgmma, cuda_ext
from .codebook_layout import FRAG_ROWS, Fragments, frag_pieces, to_fragments
from .codebook_layout import interleave_gate_up, tile_codes, untile_codes  # noqa: F401  (re-exported)
from .pack import unpack_codes
from .triton_util import HAVE_TRITON, ROW_POINTERS, triton_ok

if HAVE_TRITON:
    import triton
    import triton.language as tl

_BITS = (2, 4, 8)  # widths with a GEMV kernel; trapetum.kernels.pack also packs 1 and 3 bits
ACTS = {"silu": 1, "gelu_tanh": 2}  # gated activations of the fused epilogues (cuda/act.cuh ids)


# ----------------------------------------------------------------------------- references
def dequantize(codes: torch.Tensor, codebook: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Dense W [out, in] in the codebook's dtype (canonical packing: ``trapetum.kernels.pack``)."""
    idx = unpack_codes(codes, bits, in_features).long()
    return torch.gather(codebook, 1, idx)


def codebook_gemv_reference(x, codes, codebook, bits, residual=None) -> torch.Tensor:
    """float64 reference: dequantize, then matmul in float64 (+ residual). Returns float64."""
    x2 = x.reshape(-1, x.shape[-1]).double()
    w = dequantize(codes, codebook, bits, x2.shape[1]).double()
    y = x2 @ w.T
    if residual is not None:
        y = y + residual.reshape(y.shape).double()
    return y.reshape(*x.shape[:-1], codes.shape[0])


def _act_ref(g: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return g * torch.sigmoid(g)
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(g, approximate="tanh")
    raise ValueError(f"act: must be 'silu' or 'gelu_tanh', got {act!r}")


def codebook_gemv_gate_up_reference(x, codes, codebook, bits, f, act="silu") -> torch.Tensor:
    """float64 reference of the fused gate/up GEMV on the interleaved layout. Returns [M, f]."""
    y = codebook_gemv_reference(x, codes, codebook, bits)  # [M, 2*fp]
    y = y.reshape(y.shape[0], -1, 2, 8)
    g = y[:, :, 0, :].reshape(y.shape[0], -1)[:, :f]
    u = y[:, :, 1, :].reshape(y.shape[0], -1)[:, :f]
    return _act_ref(g, act) * u


# ----------------------------------------------------------------------------- triton kernel
if HAVE_TRITON:

    @triton.jit
    def _gelu_tanh(g):
        # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))); tanh(u) = 1 - 2 / (exp(2u) + 1)
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        u = tl.minimum(tl.maximum(u, -15.0), 15.0)  # tanh(15) == 1 in fp32; avoids exp overflow
        t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
        return 0.5 * g * (1.0 + t)

    @triton.jit
    def gated_act(g, u, ACT: tl.constexpr):
        """act(g) * u in fp32; ACT 1 = SiLU, 2 = GELU-tanh (the ids of ``ACTS`` and cuda/act.cuh)."""
        if ACT == 1:
            a = g / (1.0 + tl.exp(-g))
        else:
            a = _gelu_tanh(g)
        return a * u

    @triton.jit(do_not_specialize=ROW_POINTERS)
    def _cb_gemv_kernel(x_ptr, codes_ptr, cb_ptr, res_ptr, y_ptr, N, K, KB, F, stride_xm, stride_ym, stride_rm,
                        BITS: tl.constexpr, HAS_RES: tl.constexpr, EPI: tl.constexpr, USE_GATHER: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # One program: weight rows [BLOCK_N * pid_n, +BLOCK_N) x activation row m = program_id(1).
        # EPI 0: y[m] = x[m] W^T (+ res[m]); EPI 1 / 2 (BLOCK_N == 16): rows interleaved 8 gate / 8 up,
        # y[m, 8 pid_n + j] = act(gate_j) * up_j for 8 pid_n + j < F.
        PER: tl.constexpr = 8 // BITS
        NC: tl.constexpr = 1 << BITS
        MASK: tl.constexpr = NC - 1
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if USE_GATHER:
            cbt = tl.load(cb_ptr + rn[:, None] * NC + tl.arange(0, NC)[None, :], mask=nmask[:, None], other=0.0)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            wmask = nmask[:, None] & kmask[None, :]
            byte = tl.load(codes_ptr + rn[:, None] * KB + rk[None, :] // PER, mask=wmask, other=0)
            idx = (byte.to(tl.int32) >> ((rk[None, :] % PER) * BITS)) & MASK
            if USE_GATHER:  # codebook tile in registers, one gather per weight
                w = tl.gather(cbt, idx, axis=1).to(tl.float32)
            else:  # centroid loaded from global memory (L1) per weight
                w = tl.load(cb_ptr + rn[:, None] * NC + idx, mask=wmask, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + m * stride_xm + rk, mask=kmask, other=0.0).to(tl.float32)
            acc += tl.sum(w * xv[None, :], axis=1)  # [BLOCK_N]
        if EPI == 0:
            if HAS_RES:
                acc += tl.load(res_ptr + m * stride_rm + rn, mask=nmask, other=0.0).to(tl.float32)
            tl.store(y_ptr + m * stride_ym + rn, acc.to(tl.float16), mask=nmask)
        else:
            g, u = tl.split(tl.permute(tl.reshape(acc, [2, 8]), [1, 0]))  # rows 0..7 gate, 8..15 up
            h = gated_act(g, u, EPI)
            ro = pid_n * 8 + tl.arange(0, 8)
            tl.store(y_ptr + m * stride_ym + ro, h.to(tl.float16), mask=ro < F)


def triton_block_k(K: int, device: torch.device) -> int:
    """The Triton GEMVs' K tile: from K and the device kind only (never from M: batch invariance); the
    interpreter takes larger steps (fewer, slower-to-interpret programs)."""
    cap = 512 if device.type == "cpu" else 256
    return max(16, min(cap, triton.next_power_of_2(K)))


_GATHER_LOCK = threading.Lock()
_GATHER_OK: dict[tuple, bool] = {}  # (device kind, kernel constexprs) -> tl.gather compiles for it (decided once)


def _launch_triton(grid, args, kw, use_gather: bool, device: torch.device) -> None:
    """Launch the Triton GEMV, with tl.gather where this Triton can compile it for the kernel's configuration.
    Some Triton builds reject tl.gather for some tile shapes (an assertion in their thread-locality pass); whether a
    configuration compiles is decided at its first launch and fixed for the process. Both forms load the same fp16
    centroid and compute the same bits, and the configuration depends on the shape only (never on M), so the
    choice changes no result and keeps the kernel batch-invariant."""
    if not use_gather:
        _cb_gemv_kernel[grid](*args, USE_GATHER=False, **kw)
        return
    key = (device.type, tuple(sorted((k, v) for k, v in kw.items() if isinstance(v, (int, bool, str)))))
    with _GATHER_LOCK:
        known = _GATHER_OK.get(key)
        if known is None:
            try:
                _cb_gemv_kernel[grid](*args, USE_GATHER=True, **kw)
                _GATHER_OK[key] = True
                return
            except Exception as e:
                _GATHER_OK[key] = False
                warnings.warn(f"trapetum: Triton tl.gather does not compile for {dict(key[1])} here "
                              f"({type(e).__name__}); that configuration loads each centroid from memory")
                known = False
    _cb_gemv_kernel[grid](*args, USE_GATHER=known, **kw)


def _triton_gemv(x2, codes, codebook, bits, residual, y, epi=0, f=0, kopts: KernelOptions = DEFAULT_KERNELS):
    M, K = x2.shape
    N, KB = codes.shape
    dev = x2.device
    if epi == 0:
        block_n = 32 if dev.type == "cpu" else 8
        grid = (triton.cdiv(N, block_n), M)
        res = residual if residual is not None else y
        srm = res.stride(0)
    else:
        block_n = 16  # one interleaved 8 gate + 8 up tile per program
        grid = (N // 16, M)
        res, srm = y, 0
    args = (x2, codes, codebook, res, y, N, K, KB, f, x2.stride(0), y.stride(0), srm)
    kw = {"BITS": bits, "HAS_RES": residual is not None, "EPI": epi, "BLOCK_N": block_n,
          "BLOCK_K": triton_block_k(K, dev), "num_warps": 4}
    _launch_triton(grid, args, kw, bool(kopts.triton_gather) and hasattr(tl, "gather"), dev)
    return y


# ----------------------------------------------------------------------------- CUDA (mma) path
def mma_available(device: torch.device | None = None, kopts: KernelOptions = DEFAULT_KERNELS) -> bool:
    """True if the CUDA tensor-core GEMV may run on `device` under `kopts` (CUDA, sm_80+, ``kopts.cuda``)."""
    return cuda_ext.available(device, kopts)


MAX_GROUPED_ROWS = 256  # rows of one mma call on tiled codes (more than 16: groups of 16 in one launch)


def mma_shape_ok(M: int, K: int, bits: int, tiled: bool = False) -> bool:
    """The mma kernel's shapes: bits 4 / 8, 1 <= M <= 16 (tiled codes: <= MAX_GROUPED_ROWS, groups of 16 rows in
    one launch, ``kopts.grouped_gemv_groups`` of them a block sharing each dequantized weight, each row with the bits
    of its one-row call), 64 code bytes per row | in (no tail handling)."""
    return bits in (4, 8) and 1 <= M <= (MAX_GROUPED_ROWS if tiled else 16) and K % (512 // bits) == 0


def use_tiled(device: torch.device | None = None, kopts: KernelOptions = DEFAULT_KERNELS) -> bool:
    """True if the engine should keep its 4-/8-bit codebook projections in the tiled layout (``tile_codes``):
    the CUDA kernels may run and build."""
    return mma_available(device, kopts) and cuda_ext.load() is not None


# ----------------------------------------------------------------------------- public API
def _check(x, codes, codebook, bits):
    if bits not in _BITS:
        raise ValueError(f"bits: must be one of {_BITS}, got {bits!r}")
    if not isinstance(x, torch.Tensor) or x.dim() not in (1, 2):
        raise ValueError(f"x: expected a 1-D [in] or 2-D [M, in] tensor, got shape {tuple(getattr(x, 'shape', ()))}")
    if x.dtype != torch.float16:
        raise ValueError(f"x: expected float16, got {x.dtype}")
    if x.shape[-1] < 1 or (x.dim() == 2 and x.shape[0] < 1):
        raise ValueError(f"x: empty shape {tuple(x.shape)}")
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.dtype != torch.uint8:
        raise ValueError("codes: expected a 2-D uint8 tensor [out, ceil(in*bits/8)]")
    K = x.shape[-1]
    kb = -(-K * bits // 8)
    if codes.shape[1] != kb:
        raise ValueError(f"codes: {bits}-bit codes for in={K} need {kb} bytes per row, got {codes.shape[1]}")
    n = codes.shape[0]
    if n < 1:
        raise ValueError("codes: no output rows")
    if not isinstance(codebook, torch.Tensor) or codebook.dtype != torch.float16 or \
            tuple(codebook.shape) != (n, 1 << bits):
        raise ValueError(f"codebook: expected float16 [{n}, {1 << bits}], got "
                         f"{getattr(codebook, 'dtype', None)} {tuple(getattr(codebook, 'shape', ()))}")
    if codes.device != x.device or codebook.device != x.device:
        raise ValueError(f"codes: x, codes and codebook must be on one device "
                         f"({x.device}, {codes.device}, {codebook.device})")


def _pick_backend(backend, x2, K, bits, kopts, tiled=False):
    if backend is None:
        if x2.device.type == "cuda" and mma_shape_ok(x2.shape[0], K, bits) and mma_available(x2.device, kopts) \
                and cuda_ext.load() is not None:
            return "mma"
        return "triton" if triton_ok(x2.device) else "torch"
    if backend not in ("mma", "triton", "torch"):
        raise ValueError(f"backend: must be 'mma', 'triton', 'torch' or None, got {backend!r}")
    if backend == "mma":
        if not mma_shape_ok(x2.shape[0], K, bits, tiled):
            raise ValueError(f"backend: 'mma' needs bits 4 or 8, M <= {MAX_GROUPED_ROWS if tiled else 16} and 64 "
                             "code bytes per row | in")
        if x2.device.type != "cuda" or not mma_available(x2.device, kopts) or cuda_ext.load() is None:
            raise ValueError(f"backend: 'mma' unavailable ({cuda_ext.error() or 'needs a CUDA device and kopts.cuda'})")
    if backend == "triton" and not triton_ok(x2.device):
        raise ValueError("backend: 'triton' needs a CUDA device or TRITON_INTERPRET=1")
    return backend


def reads_fragments(m: int, bits: int, tiled: bool, kopts: KernelOptions = DEFAULT_KERNELS) -> int | None:
    """The bits of the fragment order (codebook_layout) in which an ``m``-row call on these codes may take x
    (``Fragments``), or None: tiled codes (the mma kernel's layout: it runs), FRAG_ROWS <= m <= 16."""
    return bits if tiled and bits in (4, 8) and FRAG_ROWS <= m <= 16 and mma_available(None, kopts) else None


def _frag_x(x, bits, tiled, kopts):
    """(data, 1) for x in fragment order that this call may read (else ValueError), (x, 0) for a tensor."""
    if not isinstance(x, Fragments):
        return x, 0
    if x.bits != bits or reads_fragments(x.shape[0], bits, tiled, kopts) != bits:
        raise ValueError(f"x: {x.shape[0]} rows in {x.bits}-bit fragment order, but this {bits}-bit call reads "
                         "fragments only on tiled codes through the mma kernel with 3 to 16 rows")
    return x.data, 1


def _prepare(x, codes, codebook, bits, backend, tiled, kopts):
    """Checks; tiled codes are untiled when the mma kernel may not run. Returns (x2 [M, K], codes, tiled, squeeze)."""
    if tiled:
        if backend not in (None, "mma"):
            raise ValueError(f"backend: tiled codes run on the 'mma' kernel only, got {backend!r}")
        n = codebook.shape[0] if isinstance(codebook, torch.Tensor) and codebook.dim() == 2 else -1
        if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.shape[0] != -(-n // 16) * 16:
            raise ValueError(f"codes: tiled codes need {-(-n // 16) * 16} rows (codebook rows padded to 16), "
                             f"got {tuple(getattr(codes, 'shape', ()))}")
        _check(x, codes[:n], codebook, bits)
        if not mma_available(x.device, kopts):  # kernels off (or no sm_80): the fallbacks read canonical codes
            codes, tiled = untile_codes(codes, n), False
    else:
        _check(x, codes, codebook, bits)
    squeeze = x.dim() == 1
    x2 = x.reshape(1, -1) if squeeze else x
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return x2, codes.contiguous(), tiled, squeeze


def _many_rows(x2, codes, bits, tiled, xf, kopts) -> bool:
    """Whether this call runs the wgmma kernel (``codebook_gemm_wgmma``: the same bits as the grouped mma kernel,
    which runs otherwise): tiled 4-bit codes, rows and shape where it measured faster, and it runs here."""
    return (bits == 4 and tiled and not xf and codebook_gemm_wgmma.takes(x2.shape[0], codes.shape[0], x2.shape[1])
            and codebook_gemm_wgmma.ready(x2.device, kopts))


def _out(out, shape, device, name="out"):
    M, N = shape
    if out is None:
        return torch.empty(M, N, dtype=torch.float16, device=device)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float16 or out.numel() != M * N \
            or not out.is_contiguous() or out.device != device:
        raise ValueError(f"{name}: expected a contiguous float16 tensor with {M}x{N} elements on {device}")
    return out.view(M, N)


def codebook_gemv(x: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, bits: int,
                  residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                  backend: str | None = None, tiled: bool = False,
                  kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """y = x @ W.T (+ residual) with W given by per-row codebooks (layouts and contracts: module docstring).

    x: fp16 [in] or [M, in], or ``Fragments`` (rows in fragment order, ``reads_fragments``); codes: uint8
    [out, ceil(in*bits/8)] (tiled: from ``tile_codes``); codebook: fp16 [out, 2**bits]; residual: fp16 shaped like
    y (added in fp32 before rounding). Returns fp16 [M, out] (or [out]), written into `out` if given.
    """
    x, xf = _frag_x(x, bits, tiled, kopts)
    x2, codes, tiled, squeeze = _prepare(x, codes, codebook, bits, backend, tiled, kopts)
    M, K = x2.shape
    N = codebook.shape[0]
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.dtype != torch.float16 or residual.numel() != M * N \
                or residual.device != x.device:
            raise ValueError(f"residual: expected float16 with {M}x{N} elements on {x.device}")
        residual = residual.reshape(M, N).contiguous()
    y = _out(out, (M, N), x.device)
    codebook = codebook.contiguous()
    be = _pick_backend("mma" if tiled else backend, x2, K, bits, kopts, tiled)
    if be == "mma" and _many_rows(x2, codes, bits, tiled, xf, kopts):
        codebook_gemm_wgmma.gemm(x2, codes, codebook, y, residual=residual, wg=kopts.wgmma_warpgroups,
                                 pdl=kopts.pdl_cuda)
    elif be == "mma":
        cuda_ext.load().cb_gemv_mma(x2, codes, codebook, residual if residual is not None else y, y, bits, 0,
                                    int(residual is not None), 0, int(tiled), int(kopts.pdl_cuda), xf, 0,
                                    int(kopts.grouped_gemv_groups))
    elif be == "triton":
        _triton_gemv(x2, codes, codebook, bits, residual, y, kopts=kopts)
    else:  # one row at a time: the same matrix-vector product whatever M is
        w = dequantize(codes, codebook, bits, K).float()
        for m in range(M):
            r = torch.mv(w, x2[m].float())
            y[m].copy_(r if residual is None else r + residual[m].float())
    return y.view(N) if squeeze else y


def codebook_gemv_gate_up(x: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, bits: int,
                          f: int, act: str = "silu", *, out: torch.Tensor | None = None,
                          backend: str | None = None, tiled: bool = False, out_frag_bits: int | None = None,
                          kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor | Fragments:
    """act(x @ Wg.T) * (x @ Wu.T) in one launch, on the layout made by ``interleave_gate_up``.

    codes/codebook: [2*ceil(f/8)*8, ...] (tiled: also through ``tile_codes``); f: number of output features;
    act: 'silu' | 'gelu_tanh'; x as ``codebook_gemv``. Returns fp16 [M, f] (or [f] for 1-D x), written into `out`
    if given; with out_frag_bits (4 or 8, M >= FRAG_ROWS), ``Fragments`` of it in the fragment order of the GEMV
    that reads it (the same values; the mma kernel's epilogue writes them there, the fallbacks permute).
    """
    x, xf = _frag_x(x, bits, tiled, kopts)
    x2, codes, tiled, squeeze = _prepare(x, codes, codebook, bits, backend, tiled, kopts)
    if act not in ACTS:
        raise ValueError(f"act: must be 'silu' or 'gelu_tanh', got {act!r}")
    n = codes.shape[0]
    if n % 16 != 0 or not isinstance(f, int) or not (0 < f <= n // 2) or f <= n // 2 - 8:
        raise ValueError(f"f: {f} does not match an interleaved gate/up matrix of {n} rows")
    M, K = x2.shape
    pt = 0
    if out_frag_bits is not None:
        pt = frag_pieces(out_frag_bits)
        if squeeze or M < FRAG_ROWS or f % (32 * pt):
            raise ValueError(f"out_frag_bits: fragment order needs {FRAG_ROWS} or more rows of f % {32 * pt} == 0 "
                             f"features, got {M} x {f}")
    y = _out(out, (M, f), x.device)
    codebook = codebook.contiguous()
    be = _pick_backend("mma" if tiled else backend, x2, K, bits, kopts, tiled)
    if be == "mma" and not pt and _many_rows(x2, codes, bits, tiled, xf, kopts):
        codebook_gemm_wgmma.gemm(x2, codes, codebook, y, gate_up_f=f, act=ACTS[act], wg=kopts.wgmma_warpgroups,
                                 pdl=kopts.pdl_cuda)
        return y.view(f) if squeeze else y
    if be == "mma":
        cuda_ext.load().cb_gemv_mma(x2, codes, codebook, y, y, bits, ACTS[act], 0, f, int(tiled), int(kopts.pdl_cuda),
                                    xf, pt, int(kopts.grouped_gemv_groups))
        return Fragments(y, out_frag_bits) if pt else (y.view(f) if squeeze else y)
    elif be == "triton":
        _triton_gemv(x2, codes, codebook, bits, None, y, epi=ACTS[act], f=f, kopts=kopts)
    else:  # one row at a time (float64 reference per row)
        for m in range(M):
            y[m].copy_(codebook_gemv_gate_up_reference(x2[m:m + 1], codes, codebook, bits, f, act)[0])
    if pt:
        y.copy_(to_fragments(y.clone(), out_frag_bits))
        return Fragments(y, out_frag_bits)
    return y.view(f) if squeeze else y
