"""AQLM 2x8 GEMV on tensor cores (``cuda/additive_mma.cu``), 1..16 activation rows: the "mma" 2x8 kernel option.

y[T, sum N] = concat_q(x [T, 8 G] @ W_q.T (+ bias_q)) (+ residual), fp16 in and out, fp32 accumulation, where
W_q[o, 8g + e] = scales[o] * fp16(C0[c0(o, g)][e] + C1[c1(o, g)][e]) (the codebook sum rounded once to fp16: not
the table kernel's bits, ``KernelOptions.aqlm_kernel`` selects one kernel for decode and verify alike).

``PackedMma2x8(parts)`` packs 1..4 projections sharing an input (q/k/v, gate/up) once, in the kernel's layout
(``additive_layout.pack_2x8_mma``: [tile of 32 rows][chunk of 8 groups][lane][16 bytes]), and runs them in one
launch. No workspace (the partial sums stay in shared memory). Batch invariance: row t of a T-row call is bitwise
the one-row call of that row (the .cu's file comment says why; tests/test_additive_mma.py checks it on the GPU).
The act(gate) * up epilogue is not fused here: a gate/up pair runs as one launch writing gate and up as two
contiguous planes (``gemv_planes``), then the activation kernel (``fused.act_mul``): one launch more per layer
than the table kernel's fused reduction, no copies.

References (float64): ``mma_weight_reference`` (the kernel's weights: fp16-rounded codebook sums times the scale)
and ``mma_gemv_reference``.
"""
from __future__ import annotations

import torch

from ..settings import DEFAULT_KERNELS, KernelOptions
from . import cuda_ext
from .additive_gemv import rows_ready
from .additive_layout import MMA_TILE_ROWS, codes_to_index, pack_2x8_mma, unpack_2x8_mma

__all__ = ["mma_weight_reference", "mma_gemv_reference", "PackedMma2x8", "EXT", "MAX_ROWS", "mma_available"]

MAX_ROWS = 16  # activation rows per launch (NT = 2); more rows: launches of 16

_DECLS = ("void aqlm_mma_2x8(torch::Tensor x, std::vector<torch::Tensor> codes, torch::Tensor cb, "
          "torch::Tensor scales, torch::Tensor bias, torch::Tensor res, torch::Tensor y, torch::Tensor meta, "
          "int64_t has_bias, int64_t has_res, int64_t tiles_per_block, int64_t pdl, int64_t planes);")
EXT = cuda_ext.Extension("trapetum_aqlm_mma_v1", ("additive_mma.cu",), _DECLS, ["aqlm_mma_2x8"])


def mma_weight_reference(codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [N, 8 G]: scales[o] * fp16(C0[c0] + C1[c1]), the weight the mma kernel multiplies by.
    codes int8 [N, G, 2]; codebooks [2, 256, 1, 8]; scales [N, 1, 1, 1]."""
    N, G, _ = codes.shape
    idx = codes_to_index(codes, 8)
    cb = codebooks.reshape(2, 256, 8).double()
    w = (cb[0][idx[..., 0]] + cb[1][idx[..., 1]]).to(torch.float16).double()  # the exact sum, rounded to fp16
    return (w * scales.reshape(N, 1, 1).double()).reshape(N, 8 * G)


def mma_gemv_reference(x, parts, residual=None) -> torch.Tensor:
    """float64 [T, sum N]: x @ concat(W_q).T (+ bias) (+ residual) with the kernel's weights;
    parts: (codes, codebooks, scales, bias or None) as ``PackedMma2x8`` takes them."""
    x2 = x.reshape(-1, x.shape[-1]).double()
    ys = []
    for codes, cb, sc, b in parts:
        y = x2 @ mma_weight_reference(codes, cb, sc).T
        ys.append(y + b.double() if b is not None else y)
    y = torch.cat(ys, -1)
    return y + residual.reshape(y.shape).double() if residual is not None else y


def mma_available(device=None, kopts: KernelOptions = DEFAULT_KERNELS) -> bool:
    """True if the mma kernel runs on ``device`` (CUDA sm_80+, ``kopts.cuda``, the extension builds)."""
    return EXT.ready(torch.device(device) if device is not None else None, kopts) is not None


class PackedMma2x8:
    """1..4 2x8 projections sharing an input, packed once for the tensor-core kernel.

    parts: (codes int8 [N, G, 2], codebooks fp16 [2, 256, 1, 8], scales [N, 1, 1, 1], bias [N] or None), all with
    the same G, 8 G % 64 == 0. Outputs, scales and bias are the parts' rows concatenated."""

    def __init__(self, parts, tiles_per_block: int | None = None):
        if not 1 <= len(parts) <= 4:
            raise ValueError(f"parts: 1 to 4 projections per launch, got {len(parts)}")
        G = parts[0][0].shape[1]
        for codes, cb, sc, b in parts:
            if tuple(cb.shape) != (2, 256, 1, 8) or codes.dtype != torch.int8 or codes.dim() != 3 \
                    or tuple(codes.shape[1:]) != (G, 2):
                raise ValueError(f"parts: need 2x8 codes int8 [N, {G}, 2] with codebooks [2, 256, 1, 8]")
            if tuple(sc.shape) != (codes.shape[0], 1, 1, 1) or (b is not None and tuple(b.shape) != (codes.shape[0],)):
                raise ValueError(f"parts: scales [N, 1, 1, 1] and bias [N] for N = {codes.shape[0]}")
        if G % 8:
            raise ValueError(f"parts: in_features {8 * G} is not a multiple of 64")
        self.G = G
        self.rows = [int(c.shape[0]) for c, _, _, _ in parts]
        dev = parts[0][0].device
        self.codes = [pack_2x8_mma(c) for c, _, _, _ in parts]
        tiles = [-(-n // MMA_TILE_ROWS) for n in self.rows]
        self.meta = torch.tensor([[n, t] for n, t in zip(self.rows, tiles)], dtype=torch.int64)
        self.codebooks = torch.stack([cb.reshape(2, 256, 8) for _, cb, _, _ in parts]).to(torch.float16).contiguous()
        self.scales = torch.cat([sc.reshape(-1) for _, _, sc, _ in parts]).to(torch.float16).contiguous()
        self.bias = None
        if any(b is not None for _, _, _, b in parts):
            self.bias = torch.cat([b.reshape(-1) if b is not None else torch.zeros(n, device=dev)
                                   for n, (_, _, _, b) in zip(self.rows, parts)]).to(torch.float16).contiguous()
        if tiles_per_block is None:  # blocks: about 4 waves of 3 per SM, at least one tile each
            sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
            tiles_per_block = max(1, sum(tiles) // (4 * 3 * sms))
        if tiles_per_block < 1:
            raise ValueError(f"tiles_per_block: must be at least 1, got {tiles_per_block}")
        self.tiles_per_block = int(tiles_per_block)

    def canonical_codes(self, i: int) -> torch.Tensor:
        """Part i's codes int8 [N, G, 2] (a copy)."""
        return unpack_2x8_mma(self.codes[i], self.rows[i], self.G)

    def gemv(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None, *,
             kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
        """out [T, sum N] = x [T, 8 G] @ W.T (+ bias) (+ residual), fp16; launches of up to 16 rows."""
        n = sum(self.rows)
        T = self._rows_of(x)
        if out.numel() != T * n or (residual is not None and residual.numel() != T * n):
            raise ValueError(f"out/residual: expected {T} x {n} outputs, got {tuple(out.shape)}"
                             f"{'' if residual is None else ' / ' + str(tuple(residual.shape))}")
        if out.dtype != torch.float16 or out.device != x.device or (residual is not None and (
                residual.dtype != torch.float16 or residual.device != x.device)):
            raise ValueError(f"out/residual: PackedMma2x8 takes fp16 tensors on {x.device}")
        ext = self._ext(x, kopts)
        x2 = rows_ready(x.reshape(T, -1))
        res = rows_ready(residual.reshape(T, -1)) if residual is not None else None
        y = out.view(T, n) if out.is_contiguous() and out.data_ptr() % 16 == 0 else \
            torch.empty(T, n, dtype=out.dtype, device=out.device)
        b = self.bias if self.bias is not None else y
        for t0 in range(0, T, MAX_ROWS):
            t1 = min(T, t0 + MAX_ROWS)
            ys = y[t0:t1]
            ext.aqlm_mma_2x8(x2[t0:t1], self.codes, self.codebooks, self.scales, b,
                             res[t0:t1] if res is not None else ys, ys, self.meta, int(self.bias is not None),
                             int(res is not None), self.tiles_per_block, int(kopts.pdl_cuda), 0)
        if y.data_ptr() != out.data_ptr():
            out.copy_(y.view(out.shape))
        return out

    def fuses_gate_up(self) -> bool:
        """True if ``gemv_planes`` takes these parts (a gate/up pair: two parts of equal rows)."""
        return len(self.rows) == 2 and self.rows[0] == self.rows[1]

    def gemv_planes(self, x: torch.Tensor, out: torch.Tensor, *, kopts: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
        """out [P, T, N] (contiguous): plane q = x [T, 8 G] @ W_q.T (+ bias_q), parts of equal rows N; the same bits
        as ``gemv``'s columns of part q."""
        if len(set(self.rows)) != 1:
            raise ValueError(f"gemv_planes: needs parts of equal rows, got {self.rows}")
        T = self._rows_of(x)
        P, N = len(self.rows), self.rows[0]
        if tuple(out.shape) != (P, T, N) or not out.is_contiguous() or out.dtype != torch.float16:
            raise ValueError(f"out: expected contiguous fp16 [{P}, {T}, {N}], got {out.dtype} {tuple(out.shape)}")
        ext = self._ext(x, kopts)
        x2 = rows_ready(x.reshape(T, -1))
        b = self.bias if self.bias is not None else out
        for t0 in range(0, T, MAX_ROWS):  # more than 16 rows: each launch's planes, then copied into out
            t1 = min(T, t0 + MAX_ROWS)
            ys = out if T <= MAX_ROWS else torch.empty(P, t1 - t0, N, dtype=out.dtype, device=out.device)
            ext.aqlm_mma_2x8(x2[t0:t1], self.codes, self.codebooks, self.scales, b, ys, ys, self.meta,
                             int(self.bias is not None), 0, self.tiles_per_block, int(kopts.pdl_cuda), 1)
            if ys is not out:
                out[:, t0:t1].copy_(ys)
        return out

    def _rows_of(self, x: torch.Tensor) -> int:
        if x.numel() == 0 or x.shape[-1] != 8 * self.G or x.numel() % (8 * self.G):
            raise ValueError(f"x: expected [rows, {8 * self.G}], got {tuple(x.shape)}")
        if x.dtype != torch.float16 or x.device != self.codes[0].device:
            raise ValueError(f"x: PackedMma2x8 takes fp16 on {self.codes[0].device}, got {x.dtype} on {x.device}")
        return x.numel() // (8 * self.G)

    def _ext(self, x, kopts):
        ext = EXT.ready(x.device, kopts)
        if ext is None:
            raise RuntimeError(f"PackedMma2x8: the CUDA kernel is unavailable ({EXT.error() or 'kopts or device'})")
        return ext

    def nbytes(self) -> int:
        return sum(c.numel() for c in self.codes) + self.codebooks.numel() * 2 + self.scales.numel() * 2
