"""Host (CPU) GEMV of GGUF block-quantized weights, read in place: the legacy blocks of 32 (Q4_0, Q4_1, Q5_0, Q8_0)
and the K-quant superblocks of 256 (Q4_K, Q6_K).

    ggml_gemv_host(x [M, K] fp32, GgmlWeight(qtype, blocks uint8 [N, K // E * bytes], K)) -> y fp32 [M, N],
    y[m, n] = sum_k x[m, k] * w[n, k]        (E = BLOCK_ELEMS[qtype]: 32, or 256 for Q4_K / Q6_K)

``blocks`` are a GGUF tensor's bytes as the file stores them (rows of blocks of E weights; layouts in
host/ggml_host.c's file comment, the same as the ``gguf`` package's), no copy and no dense weight. Every weight
is its exact fp32 value (``HostGgml.dequantize``: bitwise ``gguf.quants.dequantize``). One fixed fp32 sequence
per output element (host/ggml_host.c: 16 lane FMA accumulators over the weights in order, then a fixed tree), the
same on every code path (portable C, AVX2, AVX-512: ``path`` one of host_gemv.PATHS, capped at what the CPU
runs; avx512vbmi and avx512fp16 run avx512), so results are bitwise identical across paths, thread counts
(``threads``, default ``torch.get_num_threads()``), batch sizes (row m is the M = 1 result) and runs
(tests/test_ggml_host.py). ``reference``: float64, dequantized from the bytes by torch, independent of the C.
The C is part of the one host library (host_gemv.SOURCES), built at first use; ``available()`` is its availability.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from . import host_gemv as hg

GGML_TYPES = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q5_0": (2, 22), "Q8_0": (3, 34),  # (C type, bytes a block)
              "Q4_K": (4, 144), "Q6_K": (5, 210)}
BLOCK_ELEMS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256}  # weights a block
BLOCK = 32  # the legacy types' block (BLOCK_ELEMS per type)
BITS = 32  # host_ops.FusedGemv's / tp_gemv_multi's ``bits`` for GGUF block weights (codebook_host.h TP_BITS_GGML)


class GgmlWeight(NamedTuple):
    qtype: str  # a key of GGML_TYPES
    blocks: torch.Tensor  # uint8 [N, K // BLOCK_ELEMS[qtype] * bytes], unit column stride
    in_features: int  # K, a positive multiple of BLOCK_ELEMS[qtype] (32; Q4_K, Q6_K: 256)


def available() -> bool:
    """Whether the host kernels are built (building them on first call)."""
    return hg.available()


def _lib():
    lib = hg.library()
    if lib is None:
        raise RuntimeError(f"host kernels unavailable: {hg.error()}")
    return lib


def check_weight(w: GgmlWeight) -> int:
    """``w`` checked (ValueError naming what is wrong); its output rows N."""
    if not isinstance(w, GgmlWeight):
        raise ValueError(f"ggml host GEMV: expected a GgmlWeight, got {type(w).__name__}")  # noqa: TRY004
    if w.qtype not in GGML_TYPES:
        raise ValueError(f"ggml host GEMV: unknown block type {w.qtype!r} (supported: {', '.join(GGML_TYPES)})")
    K, E = w.in_features, BLOCK_ELEMS[w.qtype]
    if not isinstance(K, int) or isinstance(K, bool) or K < E or K % E:
        raise ValueError(f"ggml host GEMV: {w.qtype} in_features must be a positive multiple of {E}, got {K!r}")
    b = w.blocks
    width = K // E * GGML_TYPES[w.qtype][1]
    if not isinstance(b, torch.Tensor) or b.dtype != torch.uint8 or b.dim() != 2 or b.shape[1] != width \
            or b.stride(1) != 1 or (b.shape[0] > 1 and b.stride(0) < width):
        raise ValueError(f"ggml host GEMV: {w.qtype} blocks of K = {K} must be uint8 [N, {width}] with unit column "
                         f"stride, got {getattr(b, 'dtype', type(b).__name__)} {tuple(getattr(b, 'shape', ()))}")
    if b.device.type != "cpu":
        raise ValueError("ggml host GEMV: tensors must be on the CPU")
    return int(b.shape[0])


def _path(path: str | None) -> int:
    if path is None:
        return -1
    if path not in hg.PATHS:
        raise ValueError(f"ggml host GEMV: path must be one of {', '.join(hg.PATHS)}, got {path!r}")
    return hg.PATHS.index(path)  # the C caps it at what this CPU runs


def _threads(threads: int | None) -> int:
    t = torch.get_num_threads() if threads is None else int(threads)
    if t < 1:
        raise ValueError(f"ggml host GEMV: threads must be at least 1, got {t}")
    return t


def _x(x: torch.Tensor, K: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"ggml host GEMV: x must be [M, {K}], got {tuple(getattr(x, 'shape', ()))}")
    if x.device.type != "cpu":
        raise ValueError("ggml host GEMV: tensors must be on the CPU")
    if x.dtype != torch.float32 or x.stride(1) != 1 or x.stride(0) < K:
        x = x.to(torch.float32).contiguous()
    return x


def _rows_stride(b: torch.Tensor) -> int:
    return int(b.stride(0)) if b.shape[0] > 1 else int(b.shape[1])


def segment(w: GgmlWeight) -> list[int]:
    """``w`` as a segment of ``tp_gemv_multi`` with bits ``BITS`` (8 longs: blocks, row bytes, 0, N, 0, C type, 0,
    0): several block weights of one input, their types free, in one call (host_ops.FusedGemv, the CPU step)."""
    N = check_weight(w)
    return [w.blocks.data_ptr(), _rows_stride(w.blocks), 0, N, 0, GGML_TYPES[w.qtype][0], 0, 0]


def ggml_gemv_host(x: torch.Tensor, w: GgmlWeight, *, threads: int | None = None, out: torch.Tensor | None = None,
                   path: str | None = None) -> torch.Tensor:
    """y = x W^T: x [M, K] on the CPU (fp32 read in place with any row stride; other dtypes converted), out fp32
    [M, N] with unit column stride or None -> fp32 [M, N]. Raises RuntimeError when the kernels are unavailable."""
    lib = _lib()
    N = check_weight(w)
    K = w.in_features
    x = _x(x, K)
    M = int(x.shape[0])
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (M, N) or out.device.type != "cpu" \
            or (N > 1 and out.stride(1) != 1) or (M > 1 and out.stride(0) < N):
        raise ValueError(f"ggml host GEMV: out must be fp32 [{M}, {N}] on the CPU with unit column stride")
    ldy = int(out.stride(0)) if M > 1 else N
    rc = lib.tp_ggml_gemv(x.data_ptr(), int(x.stride(0)) if M > 1 else K, M, K, w.blocks.data_ptr(),
                          _rows_stride(w.blocks), GGML_TYPES[w.qtype][0], N, out.data_ptr(), ldy,
                          _threads(threads), _path(path))
    if rc != 0:
        raise RuntimeError(f"ggml host GEMV failed (code {rc})")
    return out


class HostGgml:
    """One GGUF block weight's host GEMV, checked once (the per-call cost is a ctypes call); ``blocks`` referenced,
    not copied, for the object's lifetime. ``nbytes``: what one pass reads."""

    def __init__(self, w: GgmlWeight):
        lib = _lib()
        self.out_features = check_weight(w)
        self.weight, self.qtype, self.in_features = w, w.qtype, w.in_features
        self.nbytes = int(w.blocks.numel())
        self._fn, self._dq = lib.tp_ggml_gemv, lib.tp_ggml_dequant
        self._args = (w.blocks.data_ptr(), _rows_stride(w.blocks), GGML_TYPES[w.qtype][0], self.out_features)

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """x [M, K] on the CPU -> fp32 [M, N] (a fresh tensor)."""
        x = _x(x, self.in_features)
        M, K = x.shape
        out = torch.empty(M, self.out_features, dtype=torch.float32)
        rc = self._fn(x.data_ptr(), int(x.stride(0)) if M > 1 else K, M, K, *self._args, out.data_ptr(),
                      self.out_features, _threads(threads), -1)
        if rc != 0:
            raise RuntimeError(f"ggml host GEMV failed (code {rc})")
        return out

    def dequantize(self, n0: int = 0, n1: int | None = None) -> torch.Tensor:
        """Weight rows n0 .. n1 - 1 as fp32 [n1 - n0, K] (exact), decoded in C."""
        n1 = self.out_features if n1 is None else n1
        if not 0 <= n0 <= n1 <= self.out_features:
            raise ValueError(f"ggml host GEMV: rows {n0}..{n1} outside 0..{self.out_features}")
        K = self.in_features
        w = torch.empty(n1 - n0, K, dtype=torch.float32)
        b, ldb, t, _ = self._args
        if self._dq(b, ldb, t, n0, n1, K, w.data_ptr(), K) != 0:
            raise RuntimeError("ggml host dequantize failed")
        return w

    def matmul(self, x: torch.Tensor, rows: int = 2048) -> torch.Tensor:
        """x [T, K] -> fp32 [T, N] for many rows (prefill): ``rows`` weight rows at a time dequantized into a
        temporary and multiplied by torch (no dense copy kept; not batch-invariant, unlike the GEMV)."""
        x = _x(x, self.in_features)
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        for n0 in range(0, self.out_features, rows):
            n1 = min(n0 + rows, self.out_features)
            torch.matmul(x, self.dequantize(n0, n1).T, out=out[:, n0:n1])
        return out


# per block, the largest |weight| as terms (byte offset of an fp16 scale, factor) summed: |d| * max|q| (+ |m| for
# Q4_1; Q4_K: |d| * 63 * 15 + |dmin| * 63, its 6-bit sub-block scales and mins; Q6_K: |d| * 128 * 32, int8 scales)
_BOUND = {"Q4_0": ((0, 8),), "Q4_1": ((0, 15), (2, 1)), "Q5_0": ((0, 16),), "Q8_0": ((0, 128),),
          "Q4_K": ((0, 63 * 15), (2, 63)), "Q6_K": ((208, 128 * 32),)}
FP16_MAX = 65504.0


def fits_fp16(w: GgmlWeight) -> bool:
    """Whether every weight of ``w`` is finite and within the fp16 range (the engine stores them so; a GGUF's
    loader and the scheme's check refuse the rest): bounded from the blocks' scales, and only where that bound fails
    decoded (``dequantize_reference``)."""
    N = check_weight(w)
    bs = GGML_TYPES[w.qtype][1]
    b = np.asarray(w.blocks.numpy()).reshape(N * (w.in_features // BLOCK_ELEMS[w.qtype]), bs)
    if not b.size:
        return True
    bound = sum(np.abs(b[:, o:o + 2].copy().view(np.float16).astype(np.float32)) * f for o, f in _BOUND[w.qtype])
    if float(bound.max()) <= FP16_MAX:
        return True
    v = dequantize_reference(w)
    return bool(torch.isfinite(v).all()) and float(v.abs().max()) <= FP16_MAX


def dequantize_reference(w: GgmlWeight) -> torch.Tensor:
    """float64 [N, K]: the weights decoded from the block bytes by numpy (the layouts of host/ggml_host.c),
    independent of the C."""
    N = check_weight(w)
    K, bs, E = w.in_features, GGML_TYPES[w.qtype][1], BLOCK_ELEMS[w.qtype]
    b = np.ascontiguousarray(w.blocks.numpy()).reshape(N, K // E, bs)
    if w.qtype == "Q4_K":
        d = b[..., 0:2].copy().view("<f2").astype(np.float64)  # [N, nb, 1]
        dmin = b[..., 2:4].copy().view("<f2").astype(np.float64)
        s = b[..., 4:16].astype(np.int64)  # [N, nb, 12]
        j = np.arange(4)
        sc = np.concatenate([s[..., j] & 63, (s[..., j + 8] & 15) | (s[..., j] >> 6) << 4], axis=-1)  # [N, nb, 8]
        mn = np.concatenate([s[..., j + 4] & 63, (s[..., j + 8] >> 4) | (s[..., j + 4] >> 6) << 4], axis=-1)
        qs = b[..., 16:].reshape(N, K // E, 4, 32).astype(np.int64)  # pairs of sub-blocks: low, high nibbles
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(N, K // E, 8, 32)  # sub-block j = 2 i + (high)
        v = (d * sc)[..., None] * q - (dmin * mn)[..., None]
        return torch.from_numpy(v.reshape(N, K))
    if w.qtype == "Q6_K":
        ql = b[..., 0:128].reshape(N, K // E, 2, 64).astype(np.int64)  # halves of 128 weights
        qh = b[..., 128:192].reshape(N, K // E, 2, 32).astype(np.int64)
        sc = b[..., 192:208].copy().view(np.int8).astype(np.float64)  # [N, nb, 16]
        d = b[..., 208:210].copy().view("<f2").astype(np.float64)
        lo = np.concatenate([ql & 15, ql >> 4], axis=-1)  # [N, nb, 2, 128]: element 32 s + l of the half
        hi = np.concatenate([(qh >> (2 * s)) & 3 for s in range(4)], axis=-1)
        q = (lo | hi << 4).reshape(N, K // E, 16, 16) - 32
        v = (d * sc)[..., None] * q
        return torch.from_numpy(v.reshape(N, K))
    d = b[..., 0:2].copy().view("<f2").astype(np.float64)  # [N, nb, 1]
    if w.qtype == "Q8_0":
        q = b[..., 2:].copy().view(np.int8).astype(np.float64)
        return torch.from_numpy((d * q).reshape(N, K))
    qs = b[..., {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[w.qtype]:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)  # element j, then j + 16
    if w.qtype == "Q4_0":
        v = d * (q - 8)
    elif w.qtype == "Q4_1":
        v = d * q + b[..., 2:4].copy().view("<f2").astype(np.float64)
    else:
        qh = b[..., 2:6].copy().view("<u4").astype(np.int64)  # [N, nb, 1]
        v = d * ((q | (((qh >> np.arange(32)) & 1) << 4)) - 16)
    return torch.from_numpy(v.reshape(N, K))


def reference(x: torch.Tensor, w: GgmlWeight) -> torch.Tensor:
    """float64 dequantize-and-multiply: [M, N]."""
    return x.double() @ dequantize_reference(w).T
