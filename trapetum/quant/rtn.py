"""RTN (round-to-nearest) integer quantization with groups: the usual 4-bit baseline (the quantizer; the stored
scheme and its module are schemes/rtn.py).

Evaluation only (``scripts/quality.py`` compares it with our codebooks in the same harness).
Per output row and group of ``group`` consecutive input columns, asymmetric min-max:

    scale = (max - min) / (2**bits - 1)       fp16
    zero  = round(-min / scale)               integer in [0, 2**bits - 1]
    q     = clamp(round(w / scale) + zero, 0, 2**bits - 1)
    w_hat = (q - zero) * scale

This is the int4 group-128 RTN of the GPTQ/AWQ papers' baselines. Storage: ``bits`` per weight
plus one fp16 scale and one ``bits``-bit zero point per group, i.e. 4 + 20/128 = 4.156 bits per
weight at int4 g128.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..schemes.rtn import RTNLinear

__all__ = ["rtn_quantize", "rtn_linear"]


def rtn_quantize(W: torch.Tensor, bits: int = 4, group: int = 128):
    """W [out, in] -> (q uint8 [out, in], scale fp16 [out, G], zero uint8 [out, G]); G = ceil(in/group)."""
    out_f, in_f = W.shape
    G = (in_f + group - 1) // group
    pad = G * group - in_f
    Wf = W.float()
    if pad:  # pad with the row's first column value: it changes no group's min/max range much
        Wf = F.pad(Wf, (0, pad), value=0.0)
    g = Wf.view(out_f, G, group)
    if pad:
        valid = torch.arange(G * group, device=W.device).view(G, group) < in_f
        lo = torch.where(valid, g, torch.full_like(g, float("inf"))).amin(-1)
        hi = torch.where(valid, g, torch.full_like(g, float("-inf"))).amax(-1)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)  # the range always holds 0, as in GPTQ's quantizer
    qmax = (1 << bits) - 1
    scale = ((hi - lo) / qmax).clamp_min(1e-8).to(torch.float16).float().clamp_min(1e-8)
    zero = torch.round(-lo / scale).clamp(0, qmax)
    q = torch.clamp(torch.round(g / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, qmax)
    q = q.view(out_f, G * group)[:, :in_f]
    return q.to(torch.uint8), scale.to(torch.float16), zero.to(torch.uint8)


def rtn_linear(W: torch.Tensor, bits: int = 4, group: int = 128, bias=None) -> RTNLinear:
    """The RTN projection of a dense weight W [out, in] (the scheme's module, schemes/rtn.py)."""
    q, s, z = rtn_quantize(W, bits, group)
    return RTNLinear(q, s, z, bits, group, None if bias is None else bias.detach().float())
