"""Per-row codebook GEMV: y[M, out] = x[M, in] @ W.T (+ residual), W[r, c] = codebook[r, idx(r, c)].

Canonical weight layouts (the .cbk file keeps these; kernels read them as they are):
  bits=4: codes uint8 [out, ceil(in/2)], column 2j in the low nibble, 2j+1 in the high nibble;
          codebook fp16 [out, 16].
  bits=8: codes uint8 [out, in]; codebook fp16 [out, 256]            (LM head)
  bits=2: codes uint8 [out, ceil(in/4)], column 4j+k at bits 2k..2k+1; codebook fp16 [out, 4].

Backends (``codebook_gemv(..., backend=None)`` picks one):
  "mma"    CUDA C++ tensor-core kernel (``cuda/codebook_gemv_mma.cu``): bits 4 and 8, M <= 16,
           in % 128 == 0 (4-bit) or in % 64 == 0 (8-bit), compute capability >= 8.0. Weights are
           dequantized straight into mma.sync m16n8k16 operands (fp32 accumulation, fixed-order
           reduction) from per-row lookup tables in shared memory (4-bit: 256 half2 pairs, one
           lookup per code byte; 8-bit: 256 entries), each replicated 4x so that a warp's lookups
           hit 32 distinct banks. TRAPETUM_GEMV_V picks a variant (see ``_variant``), e.g. byte-permute
           (PRMT) lookups from codebook byte planes in registers instead. Reads the canonical layout
           directly, or (``tiled=True``, variant 11, the engine's default) codes repacked once by
           ``tile_codes`` so that each warp load is 512 contiguous bytes. Off with TRAPETUM_TC=0
           (Triton then; tiled codes are untiled for it).
  "triton" Triton kernel, any bits in {2, 4, 8}, any M and shape; also runs on the CPU under
           TRITON_INTERPRET=1. fp32 accumulation, fixed reduction order, no atomics.
  "torch"  dequantize + fp32 matmul (CPU fallback when Triton cannot run).

Gate/up fusion: ``interleave_gate_up`` builds (once, at load time) a matrix whose rows come in
groups of 16: 8 gate rows then the same 8 up rows; ``codebook_gemv_gate_up`` returns
act(gate) * up computed in the kernel's epilogue (act = "silu" or "gelu_tanh").
q/k/v fusion needs no kernel: per-row codebooks let q, k and v rows be concatenated.
"""
from __future__ import annotations

import os

import torch

from ..quant.pack import unpack_codes
from . import cuda_ext

try:  # Triton is optional on CPU-only installs
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

_BITS = (2, 4, 8)  # widths with a GEMV kernel; trapetum.quant.pack also packs 1 and 3 bits


# ----------------------------------------------------------------------------- references
def dequantize(codes: torch.Tensor, codebook: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Dense W [out, in] in the codebook's dtype (canonical packing: ``trapetum.quant.pack``)."""
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


def interleave_gate_up(gate_codes, gate_codebook, up_codes, up_codebook):
    """Load-time repack for ``codebook_gemv_gate_up``: rows in groups of 16 (8 gate, then the same 8
    up rows); F is padded to a multiple of 8 with zero rows. Returns (codes, codebook, F)."""
    if gate_codes.shape != up_codes.shape or gate_codebook.shape != up_codebook.shape:
        raise ValueError("up_codes: gate and up projections must have the same shapes")
    f, kb = gate_codes.shape
    fp = -(-f // 8) * 8
    nc = gate_codebook.shape[1]

    def pad(t):
        out = torch.zeros(fp, t.shape[1], dtype=t.dtype, device=t.device)
        out[:f] = t
        return out.reshape(fp // 8, 8, t.shape[1])

    codes = torch.stack([pad(gate_codes), pad(up_codes)], 1).reshape(2 * fp, kb).contiguous()
    cb = torch.stack([pad(gate_codebook), pad(up_codebook)], 1).reshape(2 * fp, nc).contiguous()
    return codes, cb, f


def codebook_gemv_gate_up_reference(x, codes, codebook, bits, f, act="silu") -> torch.Tensor:
    """float64 reference of the fused gate/up GEMV on the interleaved layout. Returns [M, f]."""
    y = codebook_gemv_reference(x, codes, codebook, bits)  # [M, 2*fp]
    y = y.reshape(y.shape[0], -1, 2, 8)
    g = y[:, :, 0, :].reshape(y.shape[0], -1)[:, :f]
    u = y[:, :, 1, :].reshape(y.shape[0], -1)[:, :f]
    return _act_ref(g, act) * u


# ----------------------------------------------------------------------------- triton kernel
if triton is not None:

    @triton.jit
    def _gelu_tanh(g):
        # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))); tanh(u) = 1 - 2 / (exp(2u) + 1)
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        u = tl.minimum(tl.maximum(u, -15.0), 15.0)  # tanh(15) == 1 in fp32; avoids exp overflow
        t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
        return 0.5 * g * (1.0 + t)

    @triton.jit
    def _cb_gemv_kernel(x_ptr, codes_ptr, cb_ptr, res_ptr, y_ptr,
                        M, N, K, KB, stride_xm, stride_ym, stride_rm,
                        BITS: tl.constexpr, HAS_RES: tl.constexpr, EPI: tl.constexpr, USE_GATHER: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # EPI 0: y = x W^T (+res); EPI 1/2: rows interleaved 8 gate / 8 up, y = act(gate) * up
        PER: tl.constexpr = 8 // BITS
        NC: tl.constexpr = 1 << BITS
        MASK: tl.constexpr = NC - 1
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if EPI == 0:
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        else:
            # BLOCK_N == 16: program owns output rows [8*pid, 8*pid+8), i.e. weight rows 16*pid + 0..15
            rn = pid_n * 16 + tl.arange(0, BLOCK_N)
        nmask = rn < N
        mmask = rm < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
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
            else:  # centroid gathered from global memory (L1) per weight
                w = tl.load(cb_ptr + rn[:, None] * NC + idx, mask=wmask, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                         mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(xv[:, None, :] * w[None, :, :], axis=2)  # [BM, BN]
        if EPI == 0:
            if HAS_RES:
                r = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :],
                            mask=mmask[:, None] & nmask[None, :], other=0.0)
                acc += r.to(tl.float32)
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(tl.float16),
                     mask=mmask[:, None] & nmask[None, :])
        else:
            a3 = tl.reshape(acc, [BLOCK_M, 2, 8])
            a3 = tl.permute(a3, [0, 2, 1])  # [BM, 8, 2]
            g, u = tl.split(a3)
            if EPI == 1:
                h = g / (1.0 + tl.exp(-g)) * u
            else:
                h = _gelu_tanh(g) * u
            ro = pid_n * 8 + tl.arange(0, 8)
            # N here is F (output features)
            tl.store(y_ptr + rm[:, None] * stride_ym + ro[None, :], h.to(tl.float16),
                     mask=mmask[:, None] & (ro[None, :] < stride_rm))


def _triton_ok(device: torch.device) -> bool:
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_GATHER_BROKEN = False


def _use_gather() -> bool:
    return (not _GATHER_BROKEN and hasattr(tl, "gather")
            and os.environ.get("TRAPETUM_TRITON_GATHER", "1") != "0")


def _triton_gemv(x2, codes, codebook, bits, residual, y, epi=0, f=0):
    M, K = x2.shape
    N, KB = codes.shape
    if epi == 0:
        BLOCK_N = 8
    else:
        BLOCK_N = 16
    BLOCK_M = 1 if M == 1 else min(16, triton.next_power_of_2(M))
    BLOCK_K = max(16, min(256 if BLOCK_M == 1 else 64, triton.next_power_of_2(K)))
    if x2.device.type == "cpu":  # interpreter: fewer, larger steps
        BLOCK_K = max(16, min(512, triton.next_power_of_2(K)))
    if epi == 0:
        grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M))
        res = residual if residual is not None else y
        srm = res.stride(0)
    else:
        grid = (N // 16, triton.cdiv(M, BLOCK_M))
        res = y
        srm = f  # passes F for the epilogue's store mask
    global _GATHER_BROKEN
    args = (x2, codes, codebook, res, y, M, N, K, KB, x2.stride(0), y.stride(0), srm)
    kw = dict(BITS=bits, HAS_RES=residual is not None, EPI=epi,
              BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    if _use_gather():
        try:
            _cb_gemv_kernel[grid](*args, USE_GATHER=True, **kw)
            return y
        except Exception as e:  # a Triton build that cannot lower tl.gather here: global gather
            _GATHER_BROKEN = True
            import warnings
            warnings.warn(f"trapetum: Triton tl.gather failed ({type(e).__name__}); using global gathers")
    _cb_gemv_kernel[grid](*args, USE_GATHER=False, **kw)
    return y


# ----------------------------------------------------------------------------- CUDA (mma) path
def _load_ext():
    """The CUDA extension (``trapetum.kernels.cuda_ext``), or None if it cannot be built here."""
    return cuda_ext.load()


def mma_available(device: torch.device | None = None) -> bool:
    """True if the CUDA tensor-core GEMV can run on `device` (and TRAPETUM_TC is not 0)."""
    return cuda_ext.available(device)


DEFAULT_VARIANT = 11  # fastest measured on the H200 (NOTES-kernels.md, session 3: tiled codes)
_VARIANTS = ("3", "4", "5", "7", "11")
TILED_VARIANT = 11  # variant 7 on the tiled code layout (``tile_codes``)


def _variant() -> int:
    """Kernel variant of the mma path: TRAPETUM_GEMV_V=3|4|5|7, default DEFAULT_VARIANT.

    3: shared-memory pair tables; 4: byte-permute lookups from codebook byte planes in registers
    (4-bit only; the 8-bit LM head uses the table kernel); 5: 3 with the activation x loaded only
    by the lanes whose row exists; 7: 5 with no code loads past the last chunk; 11: 7 on codes
    tiled at load (``tile_codes``; only through ``tiled=True`` calls, i.e. the engine: a canonical
    call under 11 runs 7). NOTES-kernels.md has the measurements (and those of variants 6 and 8-10,
    removed as slower)."""
    v = os.environ.get("TRAPETUM_GEMV_V", "")
    return int(v) if v in _VARIANTS else DEFAULT_VARIANT


def _kernel_variant(tiled: bool) -> int:
    """The variant a call runs: 11 for tiled codes, else the selected one (7 in place of 11)."""
    if tiled:
        return TILED_VARIANT
    v = _variant()
    return 7 if v == TILED_VARIANT else v


def use_tiled(device: torch.device | None = None) -> bool:
    """True if the engine should keep its codebook projections in the tiled layout (variant 11
    selected and the CUDA kernels available)."""
    return _variant() == TILED_VARIANT and mma_available(device) and _load_ext() is not None


def tile_codes(codes: torch.Tensor) -> torch.Tensor:
    """Load-time repack for variant 11: uint8 [N, KB] (KB % 64 == 0) -> [ceil(N/16)*16, KB] holding,
    per 16-row tile and 64-byte chunk c, 1,024 bytes ordered [h][g][t][16 B] = rows g + 8h, bytes
    16t..16t+15 of chunk c: the kernel's lane (g, t) then loads 512 contiguous bytes per warp
    instruction. Padded rows are zero (never stored)."""
    N, KB = codes.shape
    if KB % 64:
        raise ValueError(f"codes: {KB} bytes per row is not a multiple of 64")
    npad = -(-N // 16) * 16
    full = codes if npad == N else torch.cat([codes, codes.new_zeros(npad - N, KB)])
    t = full.reshape(npad // 16, 2, 8, KB // 64, 4, 16).permute(0, 3, 1, 2, 4, 5)
    return t.contiguous().reshape(npad, KB)


def untile_codes(tiled: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``tile_codes``: the canonical [n, KB] codes."""
    npad, KB = tiled.shape
    t = tiled.reshape(npad // 16, KB // 64, 2, 8, 4, 16).permute(0, 2, 3, 1, 4, 5)
    return t.contiguous().reshape(npad, KB)[:n]


def _mma_shape_ok(M, K, bits):
    # the kernel streams 64 code bytes per row per warp step with no tail handling
    return bits in (4, 8) and 1 <= M <= 16 and K % (512 // bits) == 0


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


def _pick_backend(backend, x2, K, bits):
    if backend is None:
        if x2.device.type == "cuda" and _mma_shape_ok(x2.shape[0], K, bits) and mma_available(x2.device) \
                and _load_ext() is not None:
            return "mma"
        return "triton" if _triton_ok(x2.device) else "torch"
    if backend not in ("mma", "triton", "torch"):
        raise ValueError(f"backend: must be 'mma', 'triton', 'torch' or None, got {backend!r}")
    if backend == "mma":
        if not _mma_shape_ok(x2.shape[0], K, bits):
            raise ValueError("backend: 'mma' needs bits 4 or 8, M <= 16 and 64 code bytes per row | in")
        if x2.device.type != "cuda" or _load_ext() is None:
            raise ValueError(f"backend: 'mma' unavailable ({cuda_ext.error() or 'needs a CUDA device'})")
    if backend == "triton" and not _triton_ok(x2.device):
        raise ValueError("backend: 'triton' needs a CUDA device or TRITON_INTERPRET=1")
    return backend


def _tiled_call(x, codes, codebook, bits, backend):
    """Checks of a ``tiled=True`` call (codes from ``tile_codes``): the mma kernel (untiled for the
    fallbacks only when the kernel is switched off)."""
    if backend not in (None, "mma"):
        raise ValueError(f"backend: tiled codes run on the 'mma' kernel only, got {backend!r}")
    n = codebook.shape[0] if isinstance(codebook, torch.Tensor) and codebook.dim() == 2 else -1
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.shape[0] != -(-n // 16) * 16:
        raise ValueError(f"codes: tiled codes need {-(-n // 16) * 16} rows (codebook rows padded to 16), "
                         f"got {tuple(getattr(codes, 'shape', ()))}")
    _check(x, codes[:n], codebook, bits)


def codebook_gemv(x: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, bits: int,
                  residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                  backend: str | None = None, tiled: bool = False) -> torch.Tensor:
    """y = x @ W.T (+ residual) with W given by per-row codebooks (canonical layout, see module doc).

    x: fp16 [in] or [M, in]; codes: uint8 [out, ceil(in*bits/8)]; codebook: fp16 [out, 2**bits];
    residual: fp16 shaped like y (added in fp32 before rounding). Returns fp16 [M, out] (or [out]).
    tiled: codes come from ``tile_codes`` (variant 11 of the mma kernel).
    fp32 accumulation, fixed-order reductions: results are bitwise reproducible run to run.
    """
    if tiled:
        _tiled_call(x, codes, codebook, bits, backend)
        if not mma_available(x.device):  # TRAPETUM_TC=0 (or no sm_80): the fallbacks read canonical codes
            codes, tiled = untile_codes(codes, codebook.shape[0]), False
    else:
        _check(x, codes, codebook, bits)
    squeeze = x.dim() == 1
    x2 = x.reshape(1, -1) if squeeze else x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    N = codebook.shape[0]
    if residual is not None:
        if residual.dtype != torch.float16 or residual.numel() != M * N or residual.device != x.device:
            raise ValueError(f"residual: expected float16 with {M}x{N} elements on {x.device}")
        residual = residual.reshape(M, N)
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    if out is None:
        y = torch.empty(M, N, dtype=torch.float16, device=x.device)
    else:
        if out.dtype != torch.float16 or out.numel() != M * N or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous float16 tensor with {M}x{N} elements")
        y = out.view(M, N)
    codes = codes if codes.is_contiguous() else codes.contiguous()
    codebook = codebook if codebook.is_contiguous() else codebook.contiguous()
    be = _pick_backend("mma" if tiled else backend, x2, K, bits)
    if be == "mma":
        x2 = x2.contiguous()
        _load_ext().cb_gemv_mma(x2, codes, codebook, residual if residual is not None else y, y,
                                bits, 0, int(residual is not None), 0, _kernel_variant(tiled))
    elif be == "triton":
        _triton_gemv(x2, codes, codebook, bits, residual, y)
    else:
        w = dequantize(codes, codebook, bits, K).float()
        r = x2.float() @ w.T
        if residual is not None:
            r = r + residual.float()
        y.copy_(r)
    return y.view(N) if squeeze else y


def codebook_gemv_gate_up(x: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, bits: int,
                          f: int, act: str = "silu", *, out: torch.Tensor | None = None,
                          backend: str | None = None, tiled: bool = False) -> torch.Tensor:
    """act(x @ Wg.T) * (x @ Wu.T) in one launch, on the layout made by ``interleave_gate_up``.

    codes/codebook: [2*ceil(f/8)*8, ...]; f: number of output features; act: 'silu' | 'gelu_tanh'.
    tiled: codes also went through ``tile_codes``. Returns fp16 [M, f] (or [f] for 1-D x).
    """
    if tiled:
        _tiled_call(x, codes, codebook, bits, backend)
        if not mma_available(x.device):  # TRAPETUM_TC=0: untile for the fallbacks
            codes, tiled = untile_codes(codes, codebook.shape[0]), False
    else:
        _check(x, codes, codebook, bits)
    if act not in ("silu", "gelu_tanh"):
        raise ValueError(f"act: must be 'silu' or 'gelu_tanh', got {act!r}")
    n = codes.shape[0]
    if n % 16 != 0 or not (0 < f <= n // 2) or f <= n // 2 - 8:
        raise ValueError(f"f: {f} does not match an interleaved gate/up matrix of {n} rows")
    squeeze = x.dim() == 1
    x2 = x.reshape(1, -1) if squeeze else x
    x2 = x2.contiguous()
    M, K = x2.shape
    y = torch.empty(M, f, dtype=torch.float16, device=x.device) if out is None else out.view(M, f)
    epi = 1 if act == "silu" else 2
    be = _pick_backend("mma" if tiled else backend, x2, K, bits)
    if be == "mma":
        _load_ext().cb_gemv_mma(x2, codes.contiguous(), codebook.contiguous(), y, y, bits, epi, 0, f,
                                _kernel_variant(tiled))
    elif be == "triton":
        _triton_gemv(x2, codes.contiguous(), codebook.contiguous(), bits, None, y, epi=epi, f=f)
    else:
        r = codebook_gemv_gate_up_reference(x2, codes, codebook, bits, f, act)
        y.copy_(r)
    return y.view(f) if squeeze else y
