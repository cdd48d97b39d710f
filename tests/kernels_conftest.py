"""Shared setup for tests/test_kernels_*.py (imported by them; not a pytest conftest).

On a machine without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1) at small
shapes; with CUDA the same tests run at full size. Triton reads TRITON_INTERPRET when a kernel is
decorated: tests/conftest.py sets it before any test module imports a kernel.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py should have switched the interpreter on"

import trapetum.kernels.attention as attention  # noqa: E402
import trapetum.kernels.codebook_gemv as codebook_gemv  # noqa: E402,F401  (the tests import it from here)
import trapetum.kernels.fused as fused  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
requires_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in float64; NaN never passes."""
    y = y.double().cpu()
    ref = ref.double().cpu()
    if not torch.isfinite(y).all():
        return float("inf")
    d = (y - ref).norm().item()
    n = ref.norm().item()
    return d / n if n > 0 else d


@pytest.fixture
def row_invariant_dot(monkeypatch):
    """Under the interpreter tl.dot is numpy's matmul, and a BLAS may give a row different bits in a tile of M rows
    than in a tile of one (OpenBLAS's Haswell sgemm does, on AVX2-only machines; its SkylakeX kernel does not).
    Tests that compare tiles of different heights bitwise take this fixture: each output row of a dot is then its
    own matmul of one shape, so a row's bits depend on that row and the other operand only. No-op on a GPU."""
    if ON_GPU:
        return
    from triton.runtime import interpreter
    plain = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = [plain(self, interpreter.TensorHandle(np.ascontiguousarray(a.data[..., i:i + 1, :]), a.dtype), b,
                      interpreter.TensorHandle(np.ascontiguousarray(d.data[..., i:i + 1, :]), d.dtype),
                      input_precision, max_num_imprecise_acc)
                for i in range(a.data.shape[-2])]
        return interpreter.TensorHandle(np.concatenate([r.data for r in rows], axis=-2), rows[0].dtype)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


# Relative-norm tolerances per output dtype (fp16 rounding of the output alone is ~2.9e-4).
TOL = {torch.float16: 1e-3, torch.float32: 1e-5}


# ----------------------------------------------------------------------------- attention rows (verify)
def rows_inputs(m, hq, hkv, d, rot, tmax, gen, theta=10000.0):
    """Un-roped q [M, Hq, D], k, v [M, Hkv, D] as views of one qkv GEMV output [M, (Hq + 2 Hkv) D] (as the engine
    passes them), random caches [Hkv, T_max, D], RoPE tables of rot dims."""
    qkv = (torch.randn(m, hq + 2 * hkv, d, generator=gen) * 2).half().to(DEVICE)
    kc = torch.randn(hkv, tmax, d, generator=gen).half().to(DEVICE)
    vc = torch.randn(hkv, tmax, d, generator=gen).half().to(DEVICE)
    cos, sin = fused.rope_tables(tmax, rot, theta=theta, device=DEVICE)
    return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], kc, vc, cos, sin


def rows_reference(q, k, v, kc, vc, pos, cos, sin, **kw):
    """float64 [M, Hq, D]: RoPE of row r's q and k at pos + r, the rows' k and v in the cache, row r attending
    over pos + r + 1 positions."""
    m = q.shape[0]
    p = torch.arange(pos, pos + m)
    qr = fused.rope_reference(q.cpu(), p, cos.cpu(), sin.cpu())
    kc64, vc64 = kc.cpu().double(), vc.cpu().double()
    kc64[:, pos:pos + m] = fused.rope_reference(k.cpu(), p, cos.cpu(), sin.cpu()).transpose(0, 1)
    vc64[:, pos:pos + m] = v.cpu().double().transpose(0, 1)
    return torch.stack([attention.decode_attention_reference(qr[r], kc64, vc64, pos + r + 1, **kw) for r in range(m)])


def successive_decode(q, k, v, kc, vc, pos, cos, sin, *, as_tensor=True, **kw):
    """M single-token decode_attention_fused calls at pos, pos + 1, ... on copies of the caches: (out [M, Hq, D],
    k cache, v cache)."""
    kc, vc = kc.clone(), vc.clone()
    outs = []
    for r in range(q.shape[0]):
        p = torch.tensor([pos + r], dtype=torch.int32, device=DEVICE) if as_tensor else pos + r
        outs.append(attention.decode_attention_fused(q[r], k[r], v[r], kc, vc, p, cos, sin, **kw))
    return torch.stack(outs), kc, vc
