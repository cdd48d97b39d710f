"""Additive codebooks (scheme "aqlm", the Hugging Face AQLM layout kept byte for byte): 2x8 and 1x16.

Stored (``QuantRecord("aqlm", (out, in), {num_codebooks, nbits, in_group_size, out_group_size}, {...})``):
    codes      int8 (nbits 8) / int16 (nbits 16)  [out / og, in / ig, M]   index = code mod 2**nbits
    codebooks  fp16 [M, 2**nbits, og, ig]
    scales     fp16 [out / og, 1, 1, 1]
    W[o-group, i-group] = scales[o-group] * sum_m codebooks[m, codes[o-group, i-group, m]]
Reference: ``AdditiveLinear`` (dequantize, then matmul). Engine: ``AdditiveProjection`` (kernels/additive_gemv.py):
2x8 parts sharing an input packed for one CUDA launch (``Packed2x8``; gate/up with the activation in the
reduction), otherwise one deterministic GEMV per part into its columns. With ``KernelOptions.aqlm_kernel ==
"mma"`` the 2x8 parts run the tensor-core kernel instead (``PackedMma2x8``, kernels/additive_mma.py: other bits,
the same kernel for decode and verify; gate/up as one launch into two planes plus the activation kernel). Prefill dequantizes per call. The
GEMVs' scratch is one static workspace per device, sized for 16 rows (allocated at build, never during a
graph replay). The precise prefill does not support this scheme (its fp16 dequantization is not exact).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FormatError, UnsupportedError
from ..kernels import additive_gemv as ag
from ..kernels import additive_mma as am
from ..kernels.additive_layout import dequantize_aqlm
from ..kernels.fused import act_mul
from ..settings import DEFAULT_KERNELS
from .base import GateUp, Part, Projection, Scheme, SeparateGateUp, fp16_linear
from .record import QuantRecord

MAX_ROWS = 16  # activation rows of a verify pass: the workspace is sized for them


class AdditiveLinear(nn.Module):
    """y = x W^T + b with W from additive codebooks (see the module docstring for the layout)."""

    def __init__(self, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None):
        super().__init__()
        M, K, og, ig = codebooks.shape
        self.num_codebooks, self.nbits = int(M), int(K).bit_length() - 1
        self.out_group_size, self.in_group_size = int(og), int(ig)
        self.out_features = int(codes.shape[0]) * self.out_group_size
        self.in_features = int(codes.shape[1]) * self.in_group_size
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("codebooks", codebooks.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("bias", None if bias is None else bias.contiguous())

    @property
    def params(self) -> dict[str, int]:
        return {"num_codebooks": self.num_codebooks, "nbits": self.nbits,
                "in_group_size": self.in_group_size, "out_group_size": self.out_group_size}

    def to_record(self) -> QuantRecord:
        return QuantRecord("aqlm", (self.out_features, self.in_features), self.params,
                           {"codes": self.codes.cpu(), "codebooks": self.codebooks.cpu(), "scales": self.scales.cpu()},
                           None if self.bias is None else self.bias.cpu())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact weight this module multiplies by, [out, in]."""
        return dequantize_aqlm(self.codes, self.codebooks, self.scales, dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), b)

    def storage_bytes(self) -> int:
        ts = [self.codes, self.codebooks, self.scales] + ([] if self.bias is None else [self.bias])
        return sum(t.numel() * t.element_size() for t in ts)

    def bits_per_weight(self) -> float:
        n = sum(t.numel() * t.element_size() * 8 for t in (self.codes, self.codebooks, self.scales))
        return n / (self.out_features * self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.num_codebooks}x{self.nbits}, groups={self.out_group_size}x{self.in_group_size}, "
                f"bias={self.bias is not None}")


def _fail(name: str, msg: str) -> None:
    raise FormatError(f"quantized tensor {name}: {msg}")


class AdditiveProjection(Projection):
    """Engine form of additive parts sharing an input (module docstring)."""
    kind = "additive"

    def __init__(self, mods: list[AdditiveLinear], device, kopts=DEFAULT_KERNELS):
        dev = torch.device(device)
        self.kopts = kopts
        self.parts = [(m.codes.to(dev), m.codebooks.to(device=dev, dtype=torch.float16),
                       m.scales.to(device=dev, dtype=torch.float16),
                       None if m.bias is None else m.bias.to(device=dev, dtype=torch.float16)) for m in mods]
        self.in_features = mods[0].in_features
        self.out_features = sum(m.out_features for m in mods)
        self.bounds = [0]
        for m in mods:
            self.bounds.append(self.bounds[-1] + m.out_features)
        self.packed = self.mma = None
        is_2x8 = all(tuple(cb.shape) == (2, 256, 1, 8) for _, cb, _, _ in self.parts) and self.in_features % 64 == 0 \
            and len(mods) <= 4
        if is_2x8 and kopts.aqlm_kernel == "mma" and am.mma_available(dev, kopts):
            self.mma = am.PackedMma2x8(self.parts)
            self.parts = [(None,) + p[1:] for p in self.parts]  # the packed copy is the engine's
        elif is_2x8 and ag.cuda_available(dev, kopts):
            self.packed = ag.Packed2x8(self.parts, layout=kopts.aqlm_layout)
            if self.packed.layout != "rows":  # the packed copy is the engine's; prefill unpacks it
                self.parts = [(None,) + p[1:] for p in self.parts]
        need = 0 if self.mma is not None else max(
            [ag.workspace_need(m.codes, m.codebooks, rows=MAX_ROWS) for m in mods] +
            [self.packed.need_for(MAX_ROWS) if self.packed is not None else 0])
        self.ws = ag.shared_workspace(dev, need)

    def _codes(self, i: int) -> torch.Tensor:
        if self.parts[i][0] is not None:
            return self.parts[i][0]
        return (self.mma if self.mma is not None else self.packed).canonical_codes(i)

    def gemv(self, x, out, residual=None):
        if self.mma is not None:
            return self.mma.gemv(x, out, residual, kopts=self.kopts)
        if self.packed is not None:
            return self.packed.gemv(x, out, residual, workspace=self.ws, kopts=self.kopts)
        for i, ((_, cb, sc, b), lo, hi) in enumerate(zip(self.parts, self.bounds, self.bounds[1:])):
            res = None if residual is None else residual[:, lo:hi]
            if len(self.parts) == 1:
                ag.additive_gemv(x, self._codes(i), cb, sc, b, res, out=out, workspace=self.ws, kopts=self.kopts)
            else:
                y = ag.additive_gemv(x, self._codes(i), cb, sc, b, None if res is None else res.contiguous(),
                                     workspace=self.ws, kopts=self.kopts)
                out[:, lo:hi].copy_(y)
        return out

    def weight16(self):
        return torch.cat([dequantize_aqlm(self._codes(i), cb, sc, torch.float16) for i, (_, cb, sc, _) in
                          enumerate(self.parts)])

    def matmul(self, x, linear=None):
        if linear is not None and linear is not fp16_linear:
            raise UnsupportedError("precise prefill: additive (AQLM) projections are not supported")
        return torch.cat([F.linear(x, dequantize_aqlm(self._codes(i), cb, sc, torch.float16), b)
                          for i, (_, cb, sc, b) in enumerate(self.parts)], -1)

    def nbytes(self):
        if self.mma is not None:
            return self.mma.nbytes()
        if self.packed is not None:
            return self.packed.nbytes()
        return sum(t.numel() * t.element_size() for p in self.parts for t in p[:3] if t is not None)


class PackedGateUp(GateUp):
    """act(gate) * up of a packed 2x8 gate/up pair: the activation in the launch's reduction kernel."""
    kind = "additive"

    def __init__(self, proj: AdditiveProjection, act: str):
        self.proj, self.act = proj, act
        self.f = proj.out_features // 2

    def gemv(self, x, out):
        return self.proj.packed.gemv_gate_up(x, out, self.act, workspace=self.proj.ws, kopts=self.proj.kopts)

    def halves(self, x, linear):
        y = self.proj.matmul(x, linear)
        return y[:, : self.f], y[:, self.f:]

    def nbytes(self):
        return self.proj.nbytes()


class MmaGateUp(GateUp):
    """act(gate) * up of a 2x8 gate/up pair on the tensor-core kernel: one launch writing gate and up as two
    contiguous planes, then the activation kernel (the mma kernel has no fused epilogue)."""
    kind = "additive"

    def __init__(self, proj: AdditiveProjection, act: str):
        self.proj, self.act = proj, act
        self.f = proj.out_features // 2

    def gemv(self, x, out):
        planes = torch.empty(2, x.shape[0], self.f, dtype=out.dtype, device=out.device)
        self.proj.mma.gemv_planes(x, planes, kopts=self.proj.kopts)
        return act_mul(planes[0], planes[1], self.act, out=out)

    def halves(self, x, linear):
        y = self.proj.matmul(x, linear)
        return y[:, : self.f], y[:, self.f:]

    def nbytes(self):
        return self.proj.nbytes()


class AqlmScheme(Scheme):
    name = "aqlm"

    def check(self, record: QuantRecord, name: str) -> None:
        self.module(record, name)

    def module(self, record: QuantRecord, name: str = "?") -> AdditiveLinear:
        """QuantRecord of scheme "aqlm" -> AdditiveLinear; FormatError on any inconsistency."""
        p = record.params if isinstance(record.params, dict) else {}
        vals = {}
        for k in ("num_codebooks", "nbits", "in_group_size", "out_group_size"):
            v = p.get(k)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= 64:
                _fail(name, f"aqlm parameter {k} must be a small positive integer, got {v!r}")
            vals[k] = v
        M, nb, ig, og = vals["num_codebooks"], vals["nbits"], vals["in_group_size"], vals["out_group_size"]
        if nb > 16:
            _fail(name, f"aqlm nbits must be at most 16, got {nb}")
        shape = record.shape
        if not (isinstance(shape, (tuple, list)) and len(shape) == 2 and all(isinstance(s, int) and s > 0 for s in shape)):
            _fail(name, f"logical shape must be two positive integers, got {shape!r}")
        out_f, in_f = shape
        if out_f % og or in_f % ig:
            _fail(name, f"shape {out_f}x{in_f} is not a multiple of the groups {og}x{ig}")
        t = record.tensors
        if set(t) != {"codes", "codebooks", "scales"}:
            _fail(name, f"aqlm scheme needs tensors codes, codebooks, scales; got {sorted(t)}")
        codes, cb, sc = t["codes"], t["codebooks"], t["scales"]
        want_dt = torch.int8 if nb <= 8 else torch.int16
        if not isinstance(codes, torch.Tensor) or codes.dtype != want_dt:
            _fail(name, f"codes must be {want_dt} for {nb}-bit codebooks, got {getattr(codes, 'dtype', None)}")
        if tuple(codes.shape) != (out_f // og, in_f // ig, M):
            _fail(name, f"codes shape {tuple(codes.shape)} != {(out_f // og, in_f // ig, M)}")
        if not isinstance(cb, torch.Tensor) or not cb.is_floating_point() or tuple(cb.shape) != (M, 1 << nb, og, ig):
            _fail(name, f"codebooks must be floating point of shape {(M, 1 << nb, og, ig)}, got "
                        f"{getattr(cb, 'dtype', None)} {tuple(getattr(cb, 'shape', ()))}")
        if not isinstance(sc, torch.Tensor) or not sc.is_floating_point() or tuple(sc.shape) != (out_f // og, 1, 1, 1):
            _fail(name, f"scales must be floating point of shape {(out_f // og, 1, 1, 1)}, got "
                        f"{getattr(sc, 'dtype', None)} {tuple(getattr(sc, 'shape', ()))}")
        if not bool(torch.isfinite(cb).all()) or not bool(torch.isfinite(sc).all()):
            _fail(name, "codebooks or scales hold non-finite values")
        b = record.bias
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (out_f,) or not b.is_floating_point()):
            _fail(name, f"bias must be floating point of shape [{out_f}]")
        return AdditiveLinear(codes, cb, sc, b)

    def reference(self, weight, bias, name, dtype, device):
        mod = self.module(weight, name)
        if mod.bias is not None and dtype is not None:
            mod.bias = mod.bias.to(dtype)
        return mod.to(device) if device is not None else mod

    def can_concat(self, parts: list[Part]) -> bool:
        mods = [self.module(p.weight, p.name) for p in parts]
        return all(ag.supported(m.codes, m.codebooks) for m in mods)

    def projection(self, parts: list[Part], device, kopts=DEFAULT_KERNELS, precise=False):
        if precise:
            raise UnsupportedError("precise prefill: additive (AQLM) projections are not supported yet; "
                                   "use the default prefill")
        return AdditiveProjection([self.module(p.weight, p.name) for p in parts], device, kopts)

    def gate_up(self, gate, up, act, device, kopts=DEFAULT_KERNELS, precise=False):
        proj = self.projection([gate, up], device, kopts, precise)
        if proj.packed is not None and proj.packed.fuses_gate_up():
            return PackedGateUp(proj, act)
        if proj.mma is not None and proj.mma.fuses_gate_up():
            return MmaGateUp(proj, act)
        return SeparateGateUp(act, proj)

    def dequantize(self, weight, dtype=torch.float32):
        return self.module(weight).dequantize(dtype)


AQLM = AqlmScheme()
