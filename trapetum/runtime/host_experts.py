"""An MoE layer's routed experts in host RAM, run by the host GEMV kernels (kernels/host_gemv.py) on their stored
codes in place (a ``.cbk`` is mmapped: no copy, no dense weight); the router, the top-k and the shared experts stay
on the GPU (runtime/placement.py decides; runtime/engine_ops.py ``experts`` calls ``HostExperts.run``).

    HostExperts.build(ckpt, names, act, source)   one layer's experts from their stored records: 4- or 8-bit
                                                   per-row codebooks (gate, up, down without biases); any other
                                                   scheme is refused in one line (UnsupportedError)
    run(h [M, D], weights fp32 [M, k], idx int64 [M, k], staging) -> [M, D] in h's dtype on h's device

One pass: the normed rows h, the weights and the expert ids are packed on the device into one fp32 row each
([M, D + 2k]; ids < 2**24 are exact in fp32) and copied to a pinned host buffer (one device->host copy per MoE
layer), the stream synchronized; on the host, the (row, slot) pairs are grouped by expert and each chosen expert
runs once over its rows: a = act(gate) * up in one call (kernels/host_ops.py FusedGemv: both GEMVs and the
activation in C, the codes referenced in place; gate and up of different bit widths: two GEMVs and the activation
in float64), rounded to fp16 (as the GPU's fused gate/up epilogue stores it), the down GEMV; slot j's output times
its weight, the k slots summed in slot order in fp32; the sum is copied back from a pinned buffer (one host->device copy) and rounded to h's dtype.
Up to 16 rows an expert's rows take the batch-invariant GEMV, so row r's result does not depend on the other rows
of the pass (VERIFY rows equal decode steps bitwise); more rows (a prompt) take the dequantized-block matmul.
Only the chosen experts' codes are read: k x (gate + up + down) bytes per row. This work cannot be inside a CUDA
graph: an engine with host experts runs its steps eagerly (runtime/engine.py says why).
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..kernels import host_gemv as hg
from ..kernels.host_ops import FusedGemv
from ..schemes.codebook import CODEBOOK, host_tables
from ..schemes.record import QuantRecord

STAGING_ROWS = 16  # rows of the pinned staging buffers (decode, verify); more rows (prefill) stage per call


class HostStaging:
    """The engine's pinned host buffers shared by its host-expert layers: ``inp`` fp32 [16, D + 2k] (rows, weights,
    ids), ``out`` fp32 [16, D] (the weighted sums)."""

    def __init__(self, d: int, k: int, device: torch.device):
        pin = device.type == "cuda"
        self.d, self.k, self.device = d, k, device
        self.inp = torch.empty(STAGING_ROWS, d + 2 * k, dtype=torch.float32, pin_memory=pin)
        self.out = torch.empty(STAGING_ROWS, d, dtype=torch.float32, pin_memory=pin)


def _record(ckpt, name: str, source: str) -> QuantRecord:
    w = ckpt.tensors[name + ".weight"]
    label = getattr(w, "scheme", "dense") if not isinstance(w, torch.Tensor) else f"dense {w.dtype}"
    bits = w.params.get("bits") if isinstance(w, QuantRecord) and isinstance(w.params, dict) else None
    if not (isinstance(w, QuantRecord) and w.scheme == "codebook" and bits in hg.HOST_BITS):
        what = f"{label} {bits}-bit" if bits is not None else label
        raise UnsupportedError(f"{source}: routed experts in host RAM need 4- or 8-bit codebook experts; "
                               f"{name} is {what}")
    CODEBOOK.check(w, name)
    if w.bias is not None:
        raise UnsupportedError(f"{source}: routed experts in host RAM take no biases; {name} has one")
    return w


class HostExperts:
    """One layer's routed experts in host RAM (module docstring). ``on_host`` marks it for the engine."""
    on_host = True

    def __init__(self, experts: list[tuple[hg.HostGemv, hg.HostGemv, hg.HostGemv]], act: str, d: int, f: int):
        self.experts, self.act, self.d, self.f = experts, act, d, f
        # act(gate) * up in one call where gate and up share a bit width (else None: two GEMVs, act in torch)
        self.gate_up = [FusedGemv([(g.codes, g.tables, None), (u.codes, u.tables, None)], g.bits, d, act)
                        if g.bits == u.bits else None for g, u, _ in experts]

    def __len__(self) -> int:
        return len(self.experts)

    @classmethod
    def build(cls, ckpt, names: list[dict], act: str, source: str) -> "HostExperts":
        """``names``: one {gate, up, down} dict of canonical names (no ``.weight``) per expert (schema.moe_names)."""
        if not hg.available():
            raise UnsupportedError(f"{source}: routed experts in host RAM need the host kernels ({hg.error()})")
        if act not in ("silu", "gelu_tanh"):
            raise UnsupportedError(f"{source}: routed experts in host RAM: activation {act!r} is not supported")
        out, d, f = [], None, None
        for ex in names:
            g, u, dn = (_record(ckpt, ex[r], source) for r in ("gate", "up", "down"))
            gemvs = []
            for rec in (g, u, dn):
                codes = rec.tensors["codes"].to("cpu")
                tabs = host_tables(rec)  # either storage, as the host GEMV reads it
                if isinstance(tabs, hg.SharedTables):
                    tabs = hg.SharedTables(tabs.shared.cpu().contiguous(), tabs.scale.cpu().contiguous(),
                                           tabs.group_rows)
                else:
                    tabs = tabs.to(device="cpu", dtype=torch.float16).contiguous()
                if codes.stride(-1) != 1:
                    codes = codes.contiguous()
                gemvs.append(hg.HostGemv(codes, tabs, rec.params["bits"], rec.shape[1]))
            if not (g.shape == u.shape and dn.shape[1] == g.shape[0] and dn.shape[0] == g.shape[1]):
                raise UnsupportedError(f"{source}: expert {ex['gate']}: gate {g.shape}, up {u.shape}, down "
                                       f"{dn.shape} do not chain")
            d, f = g.shape[1], g.shape[0]
            out.append(tuple(gemvs))
        return cls(out, act, d, f)

    def nbytes(self) -> int:
        return sum(p.nbytes for ex in self.experts for p in ex)

    def expert_bytes(self) -> int:
        """Bytes one expert's gate, up and down codes and codebooks take (what a chosen slot reads)."""
        return sum(p.nbytes for p in self.experts[0])

    def _act(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        g = g.double()
        a = g * torch.sigmoid(g) if self.act == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
        return (a * u.double()).to(torch.float16).to(torch.float32)

    def compute(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, out: torch.Tensor,
                threads: int | None = None) -> torch.Tensor:
        """The host side: x fp32 [M, D], weights fp32 [M, k], idx int64 [M, k] on the CPU -> ``out`` fp32 [M, D]."""
        M, k = idx.shape
        flat = idx.reshape(-1)
        wflat = weights.reshape(-1, 1)
        order = torch.sort(flat, stable=True)[1]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        buf = torch.empty(M * k, self.d, dtype=torch.float32)
        s = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            sel = order[s:s + n]
            s += n
            gate, up, down = self.experts[e]
            xe = x.index_select(0, sel // k)
            if n <= hg.GEMV_ROWS:
                gu = self.gate_up[e]
                if gu is not None:
                    a = gu(xe, threads=threads).to(torch.float16).to(torch.float32)
                else:
                    a = self._act(gate(xe, threads), up(xe, threads))
                y = down(a, threads)
            else:
                y = down.matmul(self._act(gate.matmul(xe), up.matmul(xe)))
            buf[sel] = y * wflat[sel]
        buf = buf.view(M, k, self.d)
        out.copy_(buf[:, 0])
        for j in range(1, k):
            out.add_(buf[:, j])
        return out

    def run(self, h: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, staging: HostStaging | None,
            threads: int | None = None) -> torch.Tensor:
        """The device rows through the host experts (module docstring)."""
        M, k = idx.shape
        D = self.d
        packed = torch.cat([h.float(), weights.float(), idx.float()], dim=1)  # [M, D + 2k] on the device
        on_gpu = h.device.type == "cuda"
        if staging is not None and M <= STAGING_ROWS and staging.k == k and staging.d == D:
            inp, out = staging.inp[:M], staging.out[:M]
        else:
            inp = torch.empty(M, D + 2 * k, dtype=torch.float32, pin_memory=on_gpu)
            out = torch.empty(M, D, dtype=torch.float32, pin_memory=on_gpu)
        inp.copy_(packed, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.current_stream(h.device).synchronize()
        self.compute(inp[:, :D], inp[:, D:D + k], inp[:, D + k:].long(), out, threads)
        y = out.to(h.device, non_blocking=on_gpu)
        return y.to(h.dtype)
