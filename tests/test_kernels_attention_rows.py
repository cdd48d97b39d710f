"""attention_rows (M new tokens of one sequence: speculative verify) against M successive single-token decode calls,
BITWISE (outputs and both caches), and against float64; the launch it makes; its torch fallback; bad arguments.

Under the interpreter tl.dot is a numpy matmul (made row-invariant by the row_invariant_dot fixture: a BLAS need
not give a row the same bits in tiles of different heights), so these tests pin the chunking, masks, the union
loop's no-op blocks, the KV append and the workspace indexing; test_kernels_attention_rows_gpu.py pins the compiled bits.
"""
from __future__ import annotations

import random
import zlib

import pytest
import torch

from kernels_conftest import (DEVICE, attention as at, fused as fu, rel_err, rows_inputs, rows_reference,
                              successive_decode)
from kernels_conftest import row_invariant_dot  # noqa: F401  (a fixture: pytest finds it in this module)
from trapetum.kernels import attn_configs as ac

NAN = float("nan")
S4 = at.AttnConfig(splits=4, chunk=16, block_n=16, stages=2, merge_chunks=64, merge_d=16)  # clen 16 up to L = 64
S2 = at.AttnConfig(splits=2, chunk=16, block_n=16, merge_chunks=2)  # merges in several steps
F16 = at.AttnConfig(chunk=16, block_n=16, merge_chunks=2)  # fixed chunks, one tile each
F32L = at.AttnConfig(chunk=32, block_n=16, stages=2, merge_chunks=16, merge_d=16)  # fixed chunks, inner loop

# name, Hq, Hkv, D, rot, T_max, base pos, M, config, window, softcap, fused, pos as a tensor
CASES = [
    ("mha-m16-p4-chunk-length-change", 2, 2, 32, 32, 100, 56, 16, S4, None, None, True, True),  # L 57..72: 16 -> 32
    ("mha-m16-p8-base1016", 2, 2, 16, 16, 1040, 1016, 16, ac.SPLIT8_CONFIG, None, None, True, True),  # 128 -> 192
    ("g2-m8-p4-window-partial-rotary-unfused", 4, 2, 32, 16, 100, 60, 8, S4, 20, None, False, True),
    ("g4-m4-fixed-bn-crossing-softcap-int-pos", 8, 2, 16, 16, 80, 62, 4, F16, None, 30.0, True, False),
    ("g8-m3-fixed-loop-window", 8, 1, 16, 8, 100, 45, 3, F32L, 7, None, True, True),  # TPP 2: two row blocks
    ("g3-m16-p2-five-tokens-per-program", 6, 2, 16, 16, 90, 30, 16, S2, None, None, True, True),
    ("g20-m2-one-token-per-program", 20, 1, 16, 16, 60, 40, 2, None, None, None, True, True),  # G > 16
    ("g20-m3-unfused-window", 20, 1, 16, 16, 60, 30, 3, S4, 9, 30.0, False, False),
    ("mha-m1-is-the-decode-launch", 2, 2, 16, 16, 60, 33, 1, S4, None, None, True, True),
    ("g1-m2-pos0-window1", 3, 3, 16, 16, 40, 0, 2, None, 1, None, True, False),
    ("g2-m16-fixed-window-across-chunks-unfused", 4, 2, 16, 8, 100, 40, 16, F16, 23, None, False, True),
    ("g4-m8-p4-window-span-adaptive", 4, 1, 16, 16, 140, 100, 8, S4, 70, None, True, True),
    ("g7-m3-chooser-tile-of-two-tokens", 7, 1, 16, 16, 90, 70, 3, None, None, None, True, True),
]


def bits_equal(a, b):
    """Bitwise equality (NaN included) of fp16 tensors."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _poison(kc, vc, pos, m, window):
    """NaN in every slot no call may read before writing it: the rows' slots, everything past them, and (window)
    everything before the first row's window."""
    for c in (kc, vc):
        c[:, pos:] = NAN
        if window is not None and pos + 1 - window > 0:
            c[:, :pos + 1 - window] = NAN


def _check_rows(name, hq, hkv, d, rot, tmax, pos, m, cfg, window, softcap, fused, as_tensor):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q, k, v, kc, vc, cos, sin = rows_inputs(m, hq, hkv, d, rot, tmax, gen)
    kw = dict(scale=d ** -0.5, window=window, softcap=softcap)
    ref = rows_reference(q, k, v, kc, vc, pos, cos, sin, **kw)
    _poison(kc, vc, pos, m, window)
    y_seq, kc_seq, vc_seq = successive_decode(q, k, v, kc, vc, pos, cos, sin, as_tensor=as_tensor, config=cfg, **kw)
    ws = at.attention_workspace(hq, d, tmax, DEVICE, hkv=hkv, config=cfg, rows=m)
    for buf in ws:
        buf.fill_(NAN)
    out = torch.full((m, hq, d), NAN, dtype=torch.float16, device=DEVICE)
    q0 = q.clone()
    p = torch.tensor([pos], dtype=torch.int32, device=DEVICE) if as_tensor else pos
    y = at.attention_rows(q, k, v, kc, vc, p, cos, sin, out=out, workspace=ws, config=cfg, fused=fused, **kw)
    assert y is out and torch.isfinite(y).all(), name
    assert torch.equal(y, y_seq), (name, (y.float() - y_seq.float()).abs().max())
    assert bits_equal(kc, kc_seq) and bits_equal(vc, vc_seq), name
    if fused:  # q rotated in registers only
        assert torch.equal(q, q0)
    else:  # rope_kv_append rotated it in place
        assert rel_err(q, fu.rope_reference(q0.cpu(), torch.arange(pos, pos + m), cos.cpu(), sin.cpu())) < 1e-3
    assert rel_err(y, ref) < 2e-3, (name, rel_err(y, ref))


@pytest.mark.usefixtures("row_invariant_dot")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rows_match_successive_calls(case):
    """Each row's output and the caches are exactly M successive decode_attention_fused calls (the fused=False
    cases: the unfused path gives the fused decode's bits); outputs, workspace and every slot no call may read
    first are NaN before the call."""
    _check_rows(*case)


def _random_case(seed):
    r = random.Random(7000 + seed)
    bn = r.choice([16, 32])
    cfg = r.choice([None, at.AttnConfig(chunk=bn, block_n=bn, merge_chunks=r.choice([2, 16])),
                    at.AttnConfig(chunk=2 * bn, block_n=bn, stages=2, merge_chunks=16),
                    at.AttnConfig(splits=r.choice([2, 4, 8]), chunk=bn, block_n=bn, stages=r.choice([1, 2]),
                                  merge_chunks=r.choice([2, 64]), merge_d=r.choice([0, 16]))])
    hkv = r.choice([1, 2])
    g = r.choice([1, 2, 3, 4, 5, 8])
    d = r.choice([16, 32])
    m = r.choice([2, 3, 4, 5, 8, 16])
    tmax = r.choice([40, 97, 130])
    pos = r.randint(0, tmax - m)
    window = r.choice([None, None, 1, 5, bn, 40])
    return (f"random{seed}", hkv * g, hkv, d, r.choice([d, d // 2]), tmax, pos, m, cfg, window,
            r.choice([None, 30.0]), r.random() < 0.7, r.random() < 0.5)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.usefixtures("row_invariant_dot")
def test_rows_random(seed):
    _check_rows(*_random_case(seed))


class _Spy:
    """Records the grid and the MULTI / TPP constexprs of each launch of a Triton kernel."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((grid, kw["MULTI"], kw.get("TPP")))
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.mark.parametrize("m,g,grid_rows", [(1, 1, None), (1, 4, None), (16, 1, 1), (16, 4, 4), (5, 3, 1), (3, 20, 3)])
def test_rows_launches(monkeypatch, m, g, grid_rows):
    """M = 1 is the decode launch (MULTI off, grid (Hkv, chunks), merge grid (Hq, slices)); M > 1 puts 16 // G tokens
    in a program (one when G > 16): grid (ceil(M / TPP), Hkv, chunks), merge grid (M * Hq, slices)."""
    split, merge = _Spy(at._attn_split_kernel), _Spy(at._attn_merge_kernel)
    monkeypatch.setattr(at, "_attn_split_kernel", split)
    monkeypatch.setattr(at, "_attn_merge_kernel", merge)
    hkv, d, tmax = 2, 16, 50
    q, k, v, kc, vc, cos, sin = rows_inputs(m, hkv * g, hkv, d, d, tmax, torch.Generator().manual_seed(m))
    at.attention_rows(q, k, v, kc, vc, 10, cos, sin, scale=0.25, config=F16)
    nch = -(-tmax // 16)
    if grid_rows is None:
        assert split.calls == [((hkv, nch), False, 1)] and merge.calls == [((hkv * g, 1), False, None)]
    else:
        assert split.calls == [((grid_rows, hkv, nch), True, max(1, 16 // g))]
        assert merge.calls == [((m * hkv * g, 1), True, None)]


def test_rows_workspace_reuse_and_reproducible():
    """One workspace for 16 rows (the engine's) serves every M; repeated calls give the same bits."""
    hq, hkv, d, tmax = 4, 2, 16, 80
    ws = at.attention_workspace(hq, d, tmax, DEVICE, config=S4, rows=16)
    gen = torch.Generator().manual_seed(4)
    for m in (1, 3, 16):
        q, k, v, kc, vc, cos, sin = rows_inputs(m, hq, hkv, d, d, tmax, gen)
        pos = torch.tensor([50], dtype=torch.int32, device=DEVICE)
        y = at.attention_rows(q, k, v, kc, vc, pos, cos, sin, scale=0.25, workspace=ws, config=S4).clone()
        assert torch.equal(at.attention_rows(q, k, v, kc, vc, pos, cos, sin, scale=0.25, workspace=ws, config=S4), y)


def test_rows_torch_fallback(monkeypatch):
    """Without Triton (TRITON_INTERPRET=0 on the CPU) the rows go one at a time through the torch path: exactly the
    successive torch decode calls, and close to the Triton path."""
    gen = torch.Generator().manual_seed(8)
    hq, hkv, d, tmax, pos, m = 4, 2, 16, 60, 20, 5
    q, k, v, kc, vc, cos, sin = rows_inputs(m, hq, hkv, d, 8, tmax, gen)
    kw = dict(scale=0.25, window=9)
    y_tr = at.attention_rows(q, k, v, kc.clone(), vc.clone(), pos, cos, sin, **kw)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for fused in (True, False):
        kc2, vc2, q2 = kc.clone(), vc.clone(), q.clone()
        y = at.attention_rows(q2, k, v, kc2, vc2, pos, cos, sin, fused=fused, **kw)
        y_seq, kc_seq, vc_seq = successive_decode(q, k, v, kc, vc, pos, cos, sin, as_tensor=False, **kw)
        assert torch.equal(y, y_seq) and torch.equal(kc2, kc_seq) and torch.equal(vc2, vc_seq)
        assert torch.equal(q2, q) == fused
        assert rel_err(y, y_tr) < 1e-3
        assert rel_err(y, rows_reference(q, k, v, kc, vc, pos, cos, sin, **kw)) < 2e-3


def test_rows_bad_arguments_raise():
    gen = torch.Generator().manual_seed(0)
    q, k, v, kc, vc, cos, sin = rows_inputs(4, 4, 2, 16, 16, 20, gen)
    kw = dict(scale=0.25)
    with pytest.raises(ValueError, match="q"):
        at.attention_rows(q[0], k[0], v[0], kc, vc, 0, cos, sin, **kw)  # one token: decode_attention_fused
    with pytest.raises(ValueError, match="pos"):
        at.attention_rows(q, k, v, kc, vc, 17, cos, sin, **kw)  # 17 + 4 rows > 20 slots
    with pytest.raises(ValueError, match="k"):
        at.attention_rows(q, k[:3], v[:3], kc, vc, 0, cos, sin, **kw)
    with pytest.raises(ValueError, match="out"):
        at.attention_rows(q, k, v, kc, vc, 0, cos, sin, out=torch.empty(3, 4, 16, dtype=torch.float16), **kw)
    with pytest.raises(ValueError, match="fused"):
        at.attention_rows(q, k, v, kc, vc, 0, cos, sin, fused="no", **kw)
    with pytest.raises(ValueError, match="window"):
        at.attention_rows(q, k, v, kc, vc, 0, cos, sin, window=0, **kw)
    with pytest.raises(ValueError, match="workspace"):  # sized for 2 rows, called with 4
        at.attention_rows(q, k, v, kc, vc, 0, cos, sin, workspace=at.attention_workspace(4, 16, 20, DEVICE, rows=2),
                          **kw)
