"""Projections in the engine's form: one object per weight format, all with the same two calls.

    gemv(x [K], out [N], residual=None)   decode: one row, fused residual add
    matmul(x [T, K], mm=F.linear) -> [T, N]   prefill: dequantize, then mm(x, W, bias) (tensor cores;
                                          the precise prefill passes its fp32-output GEMM)

Several projections that read the same input (q, k, v; gate, up) are concatenated along
their rows once at load time; per-row codebooks make that a plain concatenation. This is the
one place that dispatches on the weight format; the engine's step never asks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import codebook_gemv as cg
from ..kernels.additive_gemv import supported as additive_supported
from ..kernels.dense_gemv import dense_gemv, dense_gemv_gate_up
from ..kernels.dequant import dequantize
from ..kernels.fused import act_mul


def codebook_parts(mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(codes, codebook, bits) of a per-row scalar codebook projection, else None."""
    codes, codebook, bits = (getattr(mod, a, None) for a in ("codes", "codebook", "bits"))
    if isinstance(codes, torch.Tensor) and isinstance(codebook, torch.Tensor) and bits in (2, 4, 8):
        return codes, codebook, int(bits)
    return None


def _bias(mods: list[nn.Module], device) -> torch.Tensor | None:
    if all(getattr(m, "bias", None) is None for m in mods):
        return None
    parts = [m.bias.data if getattr(m, "bias", None) is not None else torch.zeros(m.out_features, device=device)
             for m in mods]
    return torch.cat([p.to(device=device, dtype=torch.float16) for p in parts])


def release_codes(mod: nn.Module) -> int:
    """Free a quantized module's ``codes`` (the engine holds them in its own layout): the buffer
    becomes an empty tensor. Returns the bytes freed."""
    t = getattr(mod, "codes", None)
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    n = t.numel() * t.element_size()
    empty = torch.empty(0, dtype=t.dtype, device=t.device)
    if "codes" in mod._buffers:
        mod._buffers["codes"] = empty
    else:
        mod.codes = empty
    return n


class DenseProj:
    kind = "fp16"
    sources: list = []  # modules whose codes this projection copied (see ``release_codes``): none

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.w = weight.to(torch.float16).contiguous()  # [N, K]
        self.bias = bias
        self.out_features, self.in_features = self.w.shape

    def gemv(self, x, out, residual=None):
        dense_gemv(x, self.w, residual, out=out)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def matmul(self, x, mm=F.linear):
        return mm(x, self.w, self.bias)

    def nbytes(self) -> int:
        return self.w.numel() * 2


class CodebookProj:
    """Per-row scalar codebook projection. With GEMV variant 11 (``cg.use_tiled``) the codes are
    kept in the kernel's tiled layout (``cg.tile_codes``, made here once); prefill untiles them."""
    kind = "codebook"

    def __init__(self, codes: torch.Tensor, codebook: torch.Tensor, bits: int, in_features: int,
                 bias: torch.Tensor | None):
        self.out_features = codes.shape[0]
        self.tiled = bits in (4, 8) and codes.shape[1] % 64 == 0 and cg.use_tiled(codes.device)
        self.codes = cg.tile_codes(codes) if self.tiled else codes.contiguous()
        self._untiled = None  # canonical copy, made only if the kernel is switched off (kernel_codes)
        self.sources: list[nn.Module] = []  # set by make_proj when the codes were copied (tiled)
        self.codebook = codebook.to(torch.float16).contiguous()
        self.bits = bits
        self.in_features = in_features
        self.bias = bias

    def gemv(self, x, out, residual=None):
        codes, tiled = self.kernel_codes(x.device)
        cg.codebook_gemv(x, codes, self.codebook, self.bits, residual, out=out, tiled=tiled)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def kernel_codes(self, device) -> tuple[torch.Tensor, bool]:
        """(codes, tiled) for the GEMV now: the tiled codes, or, while the CUDA kernel is switched off
        (TRAPETUM_TC=0), canonical codes untiled once and kept (the fallbacks read those)."""
        if not self.tiled or cg.mma_available(device):
            return self.codes, self.tiled
        if self._untiled is None:
            self._untiled = self.canonical_codes()
        return self._untiled, False

    def canonical_codes(self) -> torch.Tensor:
        return cg.untile_codes(self.codes, self.out_features) if self.tiled else self.codes

    def dense(self) -> torch.Tensor:
        return dequantize(self.canonical_codes(), self.codebook, self.bits, self.in_features)

    def matmul(self, x, mm=F.linear):
        return mm(x, self.dense(), self.bias)

    def nbytes(self) -> int:
        return self.codes.numel() + self.codebook.numel() * 2


class AdditiveProj:
    """Additive (AQLM 2x8 / 1x16) projections sharing an input. 2x8 on the CUDA kernel: all parts
    in one launch (``Packed2x8``: each part keeps its codebooks; codes in the kernel's layout,
    TRAPETUM_AQLM_LAYOUT); otherwise one deterministic GEMV per part into its slice of ``out``.
    Prefill dequantizes per call. The GEMVs' scratch (2x8 partial sums or lookup tables) is one
    static workspace shared by every additive projection on the device (allocated here, never during
    a CUDA-graph replay; the decode step runs the GEMVs one after another on one stream)."""
    kind = "additive"

    def __init__(self, mods: list[nn.Module], device):
        from ..kernels import additive_gemv as ag

        self.ag = ag
        self.parts = [(m.codes.to(device), m.codebooks.to(device=device, dtype=torch.float16),
                       m.scales.to(device=device, dtype=torch.float16),
                       None if m.bias is None else m.bias.to(device=device, dtype=torch.float16)) for m in mods]
        self.in_features = mods[0].in_features
        self.out_features = sum(m.out_features for m in mods)
        self.bounds = [0]
        for m in mods:
            self.bounds.append(self.bounds[-1] + m.out_features)
        self.packed = None
        self.sources: list[nn.Module] = []  # modules whose codes only the packed copy serves now
        if all(tuple(cb.shape) == (2, 256, 1, 8) for _, cb, _, _ in self.parts) and self.in_features % 64 == 0 \
                and len(mods) <= 4 and torch.device(device).type == "cuda" and ag.cuda_available(torch.device(device)) \
                and ag._load_ext() is not None:
            self.packed = ag.Packed2x8(self.parts)
            if self.packed.layout != "rows":  # the engine reads the packed copy; prefill unpacks it
                self.parts = [(None,) + p[1:] for p in self.parts]
                self.sources = list(mods)
        # the per-part path's needs too: it runs while the CUDA kernels are switched off (TRAPETUM_TC=0)
        need = max([ag.workspace_need(m.codes, m.codebooks) for m in mods] +
                   [self.packed.need if self.packed is not None else 0])
        self.ws = ag.shared_workspace(device, need)
        self._unpacked: dict[int, torch.Tensor] = {}  # canonical codes for the fallback, made on demand

    def gemv(self, x, out, residual=None):
        if self.packed is not None and self.ag.cuda_available(x.device):
            return self.packed.gemv(x, out, residual, workspace=self.ws)
        for i, ((_, cb, sc, b), lo, hi) in enumerate(zip(self.parts, self.bounds, self.bounds[1:])):
            self.ag.additive_gemv(x.view(1, -1), self._codes(i, keep=True), cb, sc, b,
                                  None if residual is None else residual[lo:hi], out=out[lo:hi], workspace=self.ws)
        return out

    def fuses_gate_up(self, device) -> bool:
        """True if ``gemv_gate_up`` runs here (a packed 2x8 gate/up pair on the CUDA kernel)."""
        return self.packed is not None and self.packed.fuses_gate_up() and self.ag.cuda_available(device)

    def gemv_gate_up(self, x, out, act: str):
        """out [F] = act(gate(x)) * up(x) in one GEMV launch pair (the activation in its reduction)."""
        return self.packed.gemv_gate_up(x, out, act, workspace=self.ws)

    def _codes(self, i: int, keep: bool = False) -> torch.Tensor:
        """Part i's canonical codes (unpacked from the packed copy when that is all there is; kept when
        ``keep``, i.e. for the kill-switch path that runs every step)."""
        if self.parts[i][0] is not None:
            return self.parts[i][0]
        if i in self._unpacked:
            return self._unpacked[i]
        codes = self.packed.canonical_codes(i)
        if keep:
            self._unpacked[i] = codes
        return codes

    def matmul(self, x):
        from ..quant.additive import dequantize_aqlm

        return torch.cat([F.linear(x, dequantize_aqlm(self._codes(i), cb, sc, torch.float16), b)
                          for i, (_, cb, sc, b) in enumerate(self.parts)], -1)

    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes()
        return sum(t.numel() * t.element_size() for p in self.parts for t in p[:3])


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _alias(mods: list[nn.Module], fused: torch.Tensor, attr: str) -> None:
    """Point each module's ``attr`` at its rows of ``fused`` so the reference decoder and the engine
    share one copy of the weights (only where dtype and device already agree)."""
    lo = 0
    for m in mods:
        t = getattr(m, attr)
        hi = lo + t.shape[0]
        if t.dtype == fused.dtype and t.device == fused.device and t.data_ptr() != fused[lo:hi].data_ptr():
            if isinstance(t, nn.Parameter):
                t.data = fused[lo:hi]
            elif attr in m._buffers:
                m._buffers[attr] = fused[lo:hi]
        lo = hi


def make_proj(mods: list[nn.Module], device) -> DenseProj | CodebookProj | AdditiveProj:
    """Concatenate projections sharing an input into one engine projection (no copy for a single one)."""
    bias = _bias(mods, device)
    if all(type(m).__name__ == "AdditiveLinear" and additive_supported(m.codes, m.codebooks) for m in mods):
        return AdditiveProj(mods, device)
    parts = [codebook_parts(m) for m in mods]
    if all(p is not None for p in parts) and len({p[2] for p in parts}) == 1:
        codes = _cat([p[0].to(device) for p in parts])
        cb = _cat([p[1].to(device) for p in parts])
        if len(mods) > 1:
            _alias(mods, codes, "codes")
            _alias(mods, cb, "codebook")
        proj = CodebookProj(codes, cb, parts[0][2], mods[0].in_features, bias)
        if proj.tiled:
            proj.sources = list(mods)
        return proj
    w = _cat([m.dequantize().to(device=device, dtype=torch.float16) for m in mods])
    if len(mods) > 1 and all(isinstance(getattr(m, "weight", None), nn.Parameter) for m in mods):
        _alias(mods, w, "weight")
    return DenseProj(w, bias)


class GateUp:
    """act(gate(x)) * up(x): one fused GEMV on an interleaved codebook layout, or one dense GEMV
    over [gate; up] followed by the activation kernel. ``fuse=False`` keeps them separate."""

    def __init__(self, gate: nn.Module, up: nn.Module, act: str, device, fuse: bool = True):
        self.act = act
        self.f = gate.out_features
        pg, pu = codebook_parts(gate), codebook_parts(up)
        self.interleaved = None
        self.separate = None
        self.joint = None
        if fuse and pg is not None and pu is not None and pg[2] == pu[2] and gate.bias is None and up.bias is None:
            codes, cb, f = cg.interleave_gate_up(pg[0].to(device), pg[1].to(device), pu[0].to(device), pu[1].to(device))
            self.interleaved = CodebookProj(codes, cb, pg[2], gate.in_features, None)
            self.interleaved.sources = [gate, up]  # interleaving copied their codes
        elif fuse:
            self.joint = make_proj([gate, up], device)
        else:
            self.separate = (make_proj([gate], device), make_proj([up], device))

    def forget_sources(self) -> None:
        for p in (self.interleaved, self.joint, *(self.separate or ())):
            if p is not None:
                p.sources = []

    @property
    def sources(self) -> list[nn.Module]:
        if self.interleaved is not None:
            return self.interleaved.sources
        if self.separate is not None:
            return self.separate[0].sources + self.separate[1].sources
        return self.joint.sources

    def gemv(self, x, out, scratch):
        """out [F]; scratch [2F] fp16 workspace."""
        if self.interleaved is not None:
            p = self.interleaved
            codes, tiled = p.kernel_codes(x.device)
            return cg.codebook_gemv_gate_up(x, codes, p.codebook, p.bits, self.f, self.act, out=out, tiled=tiled)
        if isinstance(self.joint, DenseProj) and self.joint.bias is None:
            return dense_gemv_gate_up(x, self.joint.w, self.f, self.act, out=out, scratch=scratch)
        if isinstance(self.joint, AdditiveProj) and self.joint.fuses_gate_up(x.device):
            return self.joint.gemv_gate_up(x, out, self.act)
        g, u = scratch[: self.f], scratch[self.f: 2 * self.f]
        if self.separate is not None:
            self.separate[0].gemv(x, g)
            self.separate[1].gemv(x, u)
        else:
            self.joint.gemv(x, scratch[: 2 * self.f])
        return act_mul(g, u, self.act, out=out)

    def matmul(self, x, mm=F.linear):
        """Prefill: [T, K] -> [T, F] (activation applied)."""
        T = x.shape[0]
        kw = {} if mm is F.linear else {"mm": mm}  # (AdditiveProj.matmul takes no mm; precise refuses it)
        if self.interleaved is not None:
            y = self.interleaved.matmul(x, **kw).view(T, -1, 2, 8)
            g = y[:, :, 0].reshape(T, -1)[:, : self.f]
            u = y[:, :, 1].reshape(T, -1)[:, : self.f]
        elif self.separate is not None:
            g, u = self.separate[0].matmul(x, **kw), self.separate[1].matmul(x, **kw)
        else:
            y = self.joint.matmul(x, **kw)
            g, u = y[:, : self.f], y[:, self.f:]
        if g.dtype == torch.float32:  # precise prefill's fp32 GEMM outputs (runtime/precise.py)
            from .precise import act_mul_fp32
            return act_mul_fp32(g, u, self.act)
        return act_mul(g.contiguous(), u.contiguous(), self.act)

    def nbytes(self) -> int:
        if self.interleaved is not None:
            return self.interleaved.nbytes()
        if self.separate is not None:
            return sum(p.nbytes() for p in self.separate)
        return self.joint.nbytes()
