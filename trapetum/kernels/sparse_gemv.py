"""Sparse-input GEMV of per-row scalar codebooks (4 / 8 bits): the codes of zero inputs are not read.

Activation sparsity (models/sparsity.py) zeroes a fraction S of a projection's inputs. The dense kernels'
row-major codes (``codes [N, K*bits/8]``, kernels/pack.py) put the codes of one input k of the N rows N bytes
apart, so a zero x_k saves nothing below whole 128-column chunks. The sparse path reads an *input-major* copy,
made once at load:

    input_major_codes(codes [N, packed_width(K, bits)], bits, K) -> ct uint8 [K, packed_width(N, bits)]
        row k holds the codes of input k for every output row n, packed along n as pack.py packs along k
        (bits 4: row 2j in the low nibble, 2j + 1 in the high one; bits 8: one byte per row)

so the codes of input k for a block of BLOCK_N rows are BLOCK_N * bits / 8 contiguous bytes (one 32-byte sector
at BLOCK_N = 64, 4 bits), and a zero x_k skips them: bytes of codes read ~ (1 - S) K N bits / 8 (plus the
codebook, N 2^bits fp16, and x).

    sparse_gemv(x [M, K] (fp16 / fp32), ct, codebook fp16 [N, 2**bits], bits, N) -> y fp32 [M, N]
        y[m, n] = sum over k with x[m, k] != 0 of x[m, k] * codebook[n, idx(n, k)]

Backends: "triton" (CUDA, or the CPU under TRITON_INTERPRET=1): one program per (block of BLOCK_N rows, row m),
K in chunks of BLOCK_K; loads of codes and centroids masked by x != 0 (a masked-off lane issues no memory
request); fp32 accumulation. "torch": per row m, the nonzero inputs' codes gathered and multiplied in fp32.
Contracts: each row m is computed alone (its own nonzeros; a VERIFY pass reads the union of its rows' nonzero
code rows, each row's result is what it gives alone: batch-invariant); tile sizes depend on K and N only, never
on M or the data, so results are deterministic. ``sparse_gemv_reference``: float64 dequantize-and-multiply.
``sparse_project``: the engine's form (schemes/codebook.py ``CodebookProjection.sparse_gemv``): the threshold
select fused into the x load, position-0 rows dense, fp16 out with the residual or the gate/up activation fused,
by one of the kernels of ``KernelOptions.sparse_kernel``:
    "masked"   _sparse_gemv_kernel as above: saves the bytes of zero inputs, not the instructions (masked lanes
               still issue), one program per 64 rows and row over the whole K.
    "compact"  _compact_gemv_kernel (where ``compact_ok``: whole int32 words per input): K split into
               ``compact_splits(K, N)`` ranges (from the shape: ~1,024 programs a launch); each program lists the
               kept inputs of its range (a prefix sum, into its own scratch row), then loops over that list only,
               the 64 rows' codes of an input read as 8 (4-bit) or 16 (8-bit) int32 words; the last program of a
               row block (a device counter, kernels/sparse_split.py) adds the split partials in split order and
               writes the epilogue. Work follows the row's nonzeros; a row's bits depend on its own data only.
    "mma"      (4-bit, the default where the CUDA extension builds) kernels/sparse_mma.py and cuda/sparse_mma.cu:
               tensor cores, tile-major codes (uint8 [ceil(N/128), K, 64]), the same contracts; ``ct`` in that
               layout selects it (``enable_sparse`` makes the layout). Codes left input-major under "mma" (8-bit,
               no extension, more than sparse_mma.MAX_K inputs) run "compact" where ``compact_ok``, else "masked".
"""
from __future__ import annotations

import warnings

import torch

from . import sparse_mma
from ..settings import DEFAULT_KERNELS
from .pack import pack_codes, packed_width, unpack_codes
from .sparse_split import split_counters
from .triton_util import HAVE_TRITON, ROW_POINTERS, triton_ok

if HAVE_TRITON:
    import triton
    import triton.language as tl

SPARSE_BITS = (4, 8)
# the CUDA kernel's own 4-bit code layout: modules with is_layout, layout_shape, to_input_major, EXT, launch
CUDA_LAYOUTS = (sparse_mma,)
BLOCK_N = 64  # rows per program: 32 bytes of 4-bit codes per input (one sector)


def input_major_codes(codes: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Canonical row-major codes [N, packed_width(K)] -> input-major [K, packed_width(N)] (module docstring)."""
    if bits not in SPARSE_BITS:
        raise ValueError(f"sparse GEMV: bits must be one of {SPARSE_BITS}, got {bits}")
    idx = unpack_codes(codes, bits, in_features)  # [N, K]
    return pack_codes(idx.t().contiguous(), bits).reshape(-1).view(in_features, -1)  # row-major strides at K = 1


def sparse_gemv_reference(x: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, bits: int) -> torch.Tensor:
    """float64: the dense W [N, K] from the row-major codes times x (zeros included); [M, N] float64."""
    K = x.shape[-1]
    w = torch.gather(codebook.double(), 1, unpack_codes(codes, bits, K).long())
    return x.double() @ w.t()


if HAVE_TRITON:
    from .codebook_gemv import gated_act

    @triton.jit(do_not_specialize=ROW_POINTERS)
    def _sparse_gemv_kernel(x_ptr, ct_ptr, cb_ptr, res_ptr, dense_ptr, y_ptr, t, N, K, NB, F,
                            stride_xm, stride_ym, stride_rm,
                            BITS: tl.constexpr, SELECT: tl.constexpr, HAS_RES: tl.constexpr, EPI: tl.constexpr,
                            OUT16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # One program: rows [BLOCK_N pid_n, +BLOCK_N) x activation row m. SELECT: x[m, k] kept where |x| > t or
        # dense[m] != 0, else 0 (the threshold fused into the x load). EPI 0: y[m] = x W^T (+ res[m]), fp16 when
        # OUT16 else fp32; EPI 1 / 2: rows interleaved 8 gate / 8 up, y[m, 32 pid_n + j] = act(gate_j) * up_j (fp16).
        PER: tl.constexpr = 8 // BITS
        NC: tl.constexpr = 1 << BITS
        MASK: tl.constexpr = NC - 1
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        if SELECT:
            dense = tl.load(dense_ptr + m) != 0
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + m * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
            if SELECT:
                xv = tl.where((tl.abs(xv) > t) | dense, xv, 0.0)
            live = (xv != 0.0)[:, None] & nmask[None, :]  # [BLOCK_K, BLOCK_N]: codes of zero inputs not read
            byte = tl.load(ct_ptr + rk[:, None] * NB + rn[None, :] // PER, mask=live, other=0)
            idx = (byte.to(tl.int32) >> ((rn[None, :] % PER) * BITS)) & MASK
            w = tl.load(cb_ptr + rn[None, :] * NC + idx, mask=live, other=0.0).to(tl.float32)
            acc += tl.sum(w * xv[:, None], axis=0)
        if EPI == 0:
            if HAS_RES:
                acc += tl.load(res_ptr + m * stride_rm + rn, mask=nmask, other=0.0).to(tl.float32)
            if OUT16:
                tl.store(y_ptr + m * stride_ym + rn, acc.to(tl.float16), mask=nmask)
            else:
                tl.store(y_ptr + m * stride_ym + rn, acc, mask=nmask)
        else:  # BLOCK_N rows = BLOCK_N / 16 groups of (8 gate, 8 up)
            G: tl.constexpr = BLOCK_N // 16
            g, u = tl.split(tl.permute(tl.reshape(acc, [G, 2, 8]), [0, 2, 1]))  # [G, 8] each
            h = tl.reshape(gated_act(g, u, EPI), [G * 8])
            ro = pid_n * (G * 8) + tl.arange(0, G * 8)
            tl.store(y_ptr + m * stride_ym + ro, h.to(tl.float16), mask=ro < F)


    @triton.jit
    def _epilogue(acc, rn, nmask, res_ptr, y_ptr, m, pid_n, F, stride_ym, stride_rm, HAS_RES: tl.constexpr,
                  EPI: tl.constexpr, BLOCK_N: tl.constexpr):
        if EPI == 0:
            if HAS_RES:
                acc += tl.load(res_ptr + m * stride_rm + rn, mask=nmask, other=0.0).to(tl.float32)
            tl.store(y_ptr + m * stride_ym + rn, acc.to(tl.float16), mask=nmask)
        else:  # BLOCK_N rows = BLOCK_N / 16 groups of (8 gate, 8 up)
            G: tl.constexpr = BLOCK_N // 16
            g, u = tl.split(tl.permute(tl.reshape(acc, [G, 2, 8]), [0, 2, 1]))
            h = tl.reshape(gated_act(g, u, EPI), [G * 8])
            ro = pid_n * (G * 8) + tl.arange(0, G * 8)
            tl.store(y_ptr + m * stride_ym + ro, h.to(tl.float16), mask=ro < F)

    @triton.jit(do_not_specialize=ROW_POINTERS)
    def _compact_gemv_kernel(x_ptr, ctw_ptr, cb_ptr, res_ptr, dense_ptr, y_ptr, scr_ptr, part_ptr, cnt_ptr, t,
                             N, K, NW, F, KS, stride_xm, stride_ym, stride_rm,
                             BITS: tl.constexpr, HAS_RES: tl.constexpr, EPI: tl.constexpr, SPLITS: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr):
        # Program (pid_n, m, s): rows [BLOCK_N pid_n, +BLOCK_N) of activation row m over inputs [s KS, (s+1) KS).
        # 1. The indices of the kept inputs (the select: |x| > t, or x != 0 on a dense row), ascending, into the
        #    program's own scratch row (a prefix sum per chunk of BLOCK_K).
        # 2. Over that list in chunks of BLOCK_J: per input the rows' codes are BLOCK_N * BITS / 32 int32 words
        #    (``ctw``: the input-major codes as int32 [K, NW]), unpacked in registers; fp32 accumulation.
        # 3. SPLITS > 1: the partial sum to part [SPLITS, M, N]; the program that finishes last for (pid_n, m)
        #    (a counter, acq_rel) sums the SPLITS partials in the order s = 0, 1, .. and writes the epilogue, then
        #    resets the counter for the next call. Sums and order depend on the row's own data only.
        RPW: tl.constexpr = 32 // BITS  # rows per word
        WPB: tl.constexpr = BLOCK_N // RPW  # words per input and program
        NC: tl.constexpr = 1 << BITS
        MASK: tl.constexpr = NC - 1
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        s = tl.program_id(2)
        grid_n = tl.num_programs(0)
        M = tl.num_programs(1)
        k_lo = s * KS
        k_hi = tl.minimum(k_lo + KS, K)
        scr = scr_ptr + ((m * SPLITS + s) * grid_n + pid_n) * KS
        dense = tl.load(dense_ptr + m) != 0
        nnz = tl.sum(tl.zeros([BLOCK_K], dtype=tl.int32), axis=0)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + m * stride_xm + rk, mask=rk < k_hi, other=0.0).to(tl.float32)
            keep = tl.where(dense, xv != 0.0, tl.abs(xv) > t)  # (t >= 0: |x| > t implies x != 0)
            ki = keep.to(tl.int32)
            tl.store(scr + (nnz + tl.cumsum(ki, axis=0) - 1), rk.to(scr_ptr.dtype.element_ty), mask=keep)
            nnz += tl.sum(ki, axis=0)
        tl.debug_barrier()  # the list's stores visible to every thread of the program
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        rw = pid_n * WPB + tl.arange(0, WPB)
        shift = tl.arange(0, RPW) * BITS
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j0 in range(0, nnz, BLOCK_J):
            rj = j0 + tl.arange(0, BLOCK_J)
            jmask = rj < nnz
            kj = tl.load(scr + rj, mask=jmask, other=0)
            xj = tl.load(x_ptr + m * stride_xm + kj, mask=jmask, other=0.0).to(tl.float32)
            words = tl.load(ctw_ptr + kj[:, None] * NW + rw[None, :], mask=jmask[:, None] & (rw < NW)[None, :],
                            other=0)
            idx = tl.reshape((words[:, :, None] >> shift[None, None, :]) & MASK, [BLOCK_J, BLOCK_N])
            w = tl.load(cb_ptr + rn[None, :] * NC + idx, mask=jmask[:, None] & nmask[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * xj[:, None], axis=0)
        if SPLITS == 1:
            _epilogue(acc, rn, nmask, res_ptr, y_ptr, m, pid_n, F, stride_ym, stride_rm, HAS_RES, EPI, BLOCK_N)
        else:
            tl.store(part_ptr + (s * M + m) * N + rn, acc, mask=nmask)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + m * grid_n + pid_n, 1, sem="acq_rel")
            if done == SPLITS - 1:
                tl.debug_barrier()
                tot = tl.zeros([BLOCK_N], dtype=tl.float32)
                for s2 in tl.static_range(SPLITS):
                    tot += tl.load(part_ptr + (s2 * M + m) * N + rn, mask=nmask, other=0.0, cache_modifier=".cg")
                _epilogue(tot, rn, nmask, res_ptr, y_ptr, m, pid_n, F, stride_ym, stride_rm, HAS_RES, EPI, BLOCK_N)
                tl.atomic_xchg(cnt_ptr + m * grid_n + pid_n, 0)


def compact_ok(N: int, bits: int, kernel: str) -> bool:
    """Whether ``sparse_project`` runs the compacted-list kernel on input-major codes: asked for ("mma" on codes
    left input-major: 8-bit, no extension, K > sparse_mma.MAX_K), and the input-major rows whole int32 words
    (N * bits / 8 % 4 == 0)."""
    return kernel in ("compact", "mma") and (N * bits // 8) % 4 == 0 and N * bits % 8 == 0


TARGET_PROGRAMS = 1024  # split K until a launch has about this many programs (latency hiding on 132 SMs)


def compact_splits(K: int, N: int) -> int:
    """How many K ranges the compacted kernel splits a row into: from the shape only (never M or the data)."""
    grid_n = -(-N // BLOCK_N)
    return max(1, min(-(-TARGET_PROGRAMS // grid_n), K // 256, 16))


def _launch_compact(x2, ct, codebook, bits, N, y, residual, t, dense, epi, f, splits=None):
    M, K = x2.shape
    S = compact_splits(K, N) if splits is None else splits
    KS = -(-K // S)
    grid = (triton.cdiv(N, BLOCK_N), M, S)
    cnt = split_counters(x2.device, grid[0] * M)  # M * ceil(N / BLOCK_N) blocks
    scr = torch.empty(grid[0] * M * S * KS, dtype=torch.int16 if K < 1 << 15 else torch.int32, device=x2.device)
    part = torch.empty(S * M * N if S > 1 else 1, dtype=torch.float32, device=x2.device)
    res = residual if residual is not None else y
    ctw = ct.reshape(-1).view(torch.int32).view(K, -1)  # (a [1, NB] ct may have stride (1, 1): K = 1)
    _compact_gemv_kernel[grid](x2, ctw, codebook, res, dense, y, scr, part, cnt, t, N, K, ctw.shape[1], f, KS,
                               x2.stride(0), y.stride(0), res.stride(0), BITS=bits, HAS_RES=residual is not None,
                               EPI=epi, SPLITS=S, BLOCK_N=BLOCK_N, BLOCK_K=max(16, min(1024, triton.next_power_of_2(KS))),
                               BLOCK_J=_block_j(bits), num_warps=4)


def _block_j(bits: int) -> int:
    """Kept inputs per loop step: 2 KB of codes in flight per program and step (64 rows x 64 inputs at 4 bits)."""
    return 64 if bits == 4 else 32


def _block_k(K: int) -> int:
    return 16 if K <= 16 else 32 if K <= 256 else 64


def _torch(x2: torch.Tensor, ct: torch.Tensor, codebook: torch.Tensor, bits: int, N: int) -> torch.Tensor:
    y = torch.empty(x2.shape[0], N, dtype=torch.float32, device=x2.device)
    for m in range(x2.shape[0]):
        nz = torch.nonzero(x2[m]).view(-1)
        if nz.numel() == 0:
            y[m] = 0
            continue
        idx = unpack_codes(ct[nz], bits, N).long()  # [nnz, N]
        w = torch.gather(codebook.float().t(), 0, idx)  # [nnz, N]: w[j, n] = codebook[n, idx[j, n]]
        y[m] = x2[m, nz].float() @ w
    return y


def sparse_gemv(x: torch.Tensor, ct: torch.Tensor, codebook: torch.Tensor, bits: int, N: int,
                backend: str | None = None) -> torch.Tensor:
    """y fp32 [M, N] (module docstring); ``backend`` "triton" | "torch" | None (triton where it runs)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    K = x2.shape[1]
    if bits not in SPARSE_BITS:
        raise ValueError(f"sparse GEMV: bits must be one of {SPARSE_BITS}, got {bits}")
    if tuple(ct.shape) != (K, packed_width(N, bits)) or ct.dtype != torch.uint8:
        raise ValueError(f"sparse GEMV: input-major codes must be uint8 [{K}, {packed_width(N, bits)}], got "
                         f"{ct.dtype} {list(ct.shape)}")
    if tuple(codebook.shape) != (N, 1 << bits):
        raise ValueError(f"sparse GEMV: codebook must be [{N}, {1 << bits}], got {list(codebook.shape)}")
    if backend is None:
        backend = "triton" if triton_ok(x2.device) else "torch"
    if backend == "torch":
        return _torch(x2, ct, codebook, bits, N).view(*x.shape[:-1], N)
    y = torch.empty(x2.shape[0], N, dtype=torch.float32, device=x2.device)
    _launch(x2, ct, codebook, bits, N, y, None, 0.0, None, 0, 0)
    return y.view(*x.shape[:-1], N)


def _launch(x2, ct, codebook, bits, N, y, residual, t, dense, epi, f):
    K = x2.shape[1]
    grid = (triton.cdiv(N, BLOCK_N), x2.shape[0])
    res = residual if residual is not None else y
    _sparse_gemv_kernel[grid](x2, ct, codebook, res, dense if dense is not None else x2, y, t, N, K, ct.shape[1], f,
                              x2.stride(0), y.stride(0), res.stride(0), BITS=bits, SELECT=dense is not None,
                              HAS_RES=residual is not None, EPI=epi, OUT16=y.dtype == torch.float16,
                              BLOCK_N=BLOCK_N, BLOCK_K=_block_k(K), num_warps=4)


def threshold_in(t: float, dtype: torch.dtype) -> float:
    """t as the select compares it: rounded to x's dtype (``x.abs() > t`` of torch on an fp16 x compares in fp16)."""
    return float(torch.tensor(float(t), dtype=dtype))


def sparse_project(x: torch.Tensor, ct: torch.Tensor, codebook: torch.Tensor, bits: int, N: int, *, threshold: float,
                   dense_rows: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None,
                   act: str | None = None, f: int = 0, backend: str | None = None,
                   kernel: str = "compact", splits: int | None = None, kopts=None) -> torch.Tensor:
    """The engine's sparse projection, thresholding fused: x fp16 [M, K] (the site's input before the select),
    ``dense_rows`` bool [M] (rows kept whole: positions < DENSE_POSITIONS), xs = where(|x| > threshold | dense, x, 0)
    (``threshold`` compared in x's dtype, models/sparsity.py's rule). ``act`` None: out fp16 [M, N] =
    round(xs W^T (+ residual)); ``act`` "silu" | "gelu_tanh": W's rows interleaved 8 gate / 8 up
    (codebook_layout.interleave_gate_up), out fp16 [M, f] = round(act(gate) * up) in fp32. Each row alone (its
    bits do not depend on M or on the other rows), one launch, no host sync on CUDA (capturable). ``kernel``
    "compact" (KernelOptions.sparse_kernel): the kernel whose work follows the row's nonzeros
    (_compact_gemv_kernel) where ``compact_ok``, else "masked": _sparse_gemv_kernel, loads masked by x != 0.
    ``ct`` tile-major (sparse_mma.tile_codes, 4-bit; what ``enable_sparse`` makes for sparse_kernel "mma" where
    the extension runs): the tensor-core kernel (``kopts``: its PDL), else converted back to input-major."""
    from .codebook_gemv import ACTS, _act_ref
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = x2.shape
    cuda = next((mod for mod in CUDA_LAYOUTS if mod.is_layout(ct)), None)
    if cuda is not None:  # a CUDA kernel's own layout (4-bit): converted back to input-major where it cannot run
        want = cuda.layout_shape(N, K)
        if bits != 4 or tuple(ct.shape) != want:
            raise ValueError(f"sparse GEMV: {cuda.LAYOUT} codes must be 4-bit {cuda.CODE_DTYPE} {list(want)}, got "
                             f"{bits}-bit {list(ct.shape)}")
        kopts = DEFAULT_KERNELS if kopts is None else kopts
        if backend == "torch" or cuda.EXT.ready(x2.device, kopts) is None:
            ct, cuda = cuda.to_input_major(ct, N), None
    if cuda is None and (tuple(ct.shape) != (K, packed_width(N, bits)) or ct.dtype != torch.uint8):
        raise ValueError(f"sparse GEMV: input-major codes must be uint8 [{K}, {packed_width(N, bits)}], got "
                         f"{ct.dtype} {list(ct.shape)}")
    if act is not None and (act not in ACTS or N % 16):
        raise ValueError(f"sparse GEMV: act {act!r} needs one of {sorted(ACTS)} and rows in groups of 16")
    want = (M, f if act is not None else N)
    if tuple(out.shape) != want or out.dtype != torch.float16 or not out.is_contiguous():
        raise ValueError(f"sparse GEMV: out must be contiguous float16 {list(want)}, got {out.dtype} {list(out.shape)}")
    dense = dense_rows.reshape(-1)
    if dense.numel() != M or dense.dtype != torch.bool:
        raise ValueError(f"sparse GEMV: dense_rows must be bool with {M} elements")
    if residual is not None:
        residual = residual.reshape(M, N).contiguous()
    t = threshold_in(threshold, x2.dtype)
    if cuda is not None:
        return cuda.launch(x2, ct, codebook, N, out, residual, t, dense.view(torch.uint8), ACTS[act] if act else 0,
                           f, kopts, splits)
    if backend is None:
        backend = "triton" if triton_ok(x2.device) else "torch"
    if backend == "torch":
        xs = torch.where((x2.abs() > t) | dense.view(-1, 1), x2, torch.zeros((), dtype=x2.dtype, device=x2.device))
        y = _torch(xs, ct, codebook, bits, N)
        if act is not None:
            y = y.view(M, -1, 2, 8)
            y = _act_ref(y[:, :, 0].reshape(M, -1)[:, :f], act) * y[:, :, 1].reshape(M, -1)[:, :f]
        elif residual is not None:
            y = y + residual.float()
        out.copy_(y)
        return out
    args = (x2, ct, codebook, bits, N, out, residual, t, dense.view(torch.uint8), ACTS[act] if act else 0, f)
    if not compact_ok(N, bits, kernel):
        _launch(*args)
        return out
    key = (x2.device.type, bits, args[9], residual is not None)
    if _COMPACT_OK.get(key) is False:
        _launch(*args)
        return out
    try:
        _launch_compact(*args, splits=splits)
        _COMPACT_OK[key] = True
    except Exception as e:  # a Triton that cannot compile it: the masked kernel, decided once for the process
        if _COMPACT_OK.get(key):
            raise
        _COMPACT_OK[key] = False
        warnings.warn(f"trapetum: the compacted sparse GEMV does not compile here ({type(e).__name__}: "
                      f"{' '.join(str(e).split())[:100]}); the masked kernel runs instead")
        _launch(*args)
    return out


_COMPACT_OK: dict[tuple, bool] = {}  # (device kind, bits, epilogue, residual) -> the compact kernel compiled


def bytes_read(K: int, N: int, bits: int, sparsity: float, x_bytes: int = 2) -> float:
    """The sparse GEMV's bytes per row at input sparsity S, at sector granularity of whole inputs: codes
    (1 - S) K N bits / 8, the codebook N 2^bits fp16, x K x_bytes (the floor NOTES-engine.md states)."""
    return (1 - sparsity) * K * N * bits / 8 + N * (1 << bits) * 2 + K * x_bytes
