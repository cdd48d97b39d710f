"""attention_rows compiled on the GPU at real shapes: each row's output and the caches BITWISE equal to M successive
single-token decode calls of the same mode (the batch-invariance contract: tl.dot rows independent of their tile
neighbours, the same reduction trees), fused and unfused, PDL on = off, and a CUDA graph captured at one base
replayed at others."""
from __future__ import annotations

import pytest
import torch

from kernels_conftest import attention as at, rel_err, requires_cuda, rows_inputs, rows_reference, successive_decode
from shapes import ATTN_HEADS
from trapetum.kernels import attn_configs as ac
from trapetum.settings import KernelOptions

pytestmark = requires_cuda
HEADS = dict(ATTN_HEADS, **{"mqa-32/1x128": (32, 1, 128)})  # G = 32 > 16: one token per program
T_MAX = 4096
PDL_OFF = KernelOptions(pdl="off")


def _check(hq, hkv, d, rot, base, m, seed, config=None, **kw):
    """Rows (fused with PDL on and off, unfused) against successive decode calls of the same mode, bitwise; the
    two modes against each other and against float64 within tolerance (the unfused kill switch rotates q in its
    own kernel, whose fp32 rounding of RoPE can differ from the fused kernel's by an fp16 ulp)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, kc, vc, cos, sin = rows_inputs(m, hq, hkv, d, rot, T_MAX, gen, theta=500000.0)
    kw = dict(scale=d ** -0.5, **kw)
    ws = at.attention_workspace(hq, d, T_MAX, "cuda", rows=16)  # the engine's: no group size, 16 rows
    pos = torch.tensor([base], dtype=torch.int32, device="cuda")
    ys = {}
    for fused, kopts in ((True, KernelOptions()), (True, PDL_OFF), (False, KernelOptions())):
        y_seq, kc_seq, vc_seq = successive_decode(q.clone(), k, v, kc, vc, base, cos, sin, config=config,
                                                  workspace=ws, fused=fused, kopts=kopts, **kw)
        kc2, vc2 = kc.clone(), vc.clone()
        y = at.attention_rows(q.clone(), k, v, kc2, vc2, pos, cos, sin, workspace=ws, config=config, fused=fused,
                              kopts=kopts, **kw)
        torch.cuda.synchronize()
        diff = (y.float() - y_seq.float()).abs().max().item()
        assert torch.equal(y, y_seq), (base, m, fused, kopts.pdl, diff)
        assert torch.equal(kc2, kc_seq) and torch.equal(vc2, vc_seq), (base, m, fused)
        ys[fused, kopts.pdl] = y
    assert torch.equal(ys[True, "all"], ys[True, "off"])  # PDL changes when kernels start, not what they compute
    assert rel_err(ys[False, "all"], ys[True, "all"]) < 2e-3
    assert rel_err(ys[True, "all"], rows_reference(q, k, v, kc, vc, base, cos, sin, **kw)) < 2e-3


@pytest.mark.parametrize("m", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("base", [6, 56, 1016])
@pytest.mark.parametrize("model", list(HEADS))
def test_rows_bitwise_real_heads_gpu(model, base, m):
    """The default config (Llama-2-7B's 32 kv heads: 8 length-adaptive splits; at base 1016 with 16 rows the chunk
    length changes from 128 to 192 inside the call), lengths crossing 64-position blocks at 56 + M."""
    hq, hkv, d = HEADS[model]
    if model == "llama-2-7b":
        assert at.choose_config(d, 1, T_MAX, hkv) == ac.SPLIT8_CONFIG
    _check(hq, hkv, d, d, base, m, seed=base * 17 + m)


@pytest.mark.parametrize("cfg", [c for c in ac.CANDIDATE_CONFIGS if c.splits or c.chunk > c.block_n][:6] +
                         [ac.FIXED64_CONFIG], ids=lambda c: c.name)
@pytest.mark.parametrize("model", ["llama-2-7b", "llama-3-8b"])
def test_rows_candidate_configs_gpu(model, cfg):
    """Inner-loop and adaptive candidates at bases where the chunking changes within 16 rows (512 + 8: a 512-position
    span; 2040: adaptive chunks grow at 2048 with 8 splits) and a window starting inside a block."""
    hq, hkv, d = ATTN_HEADS[model]
    if not at.config_fits(cfg, d, hq // hkv):
        pytest.skip("breaks the resource rule")
    for base, window in ((504, None), (2040, None), (3000, 1000)):
        _check(hq, hkv, d, d, base, 16, seed=base, config=cfg, window=window)


@pytest.mark.parametrize("model", ["gemma-2-2b", "qwen2.5-0.5b", "llama-3-8b"])
def test_rows_window_softcap_partial_rotary_gpu(model):
    hq, hkv, d = ATTN_HEADS[model]
    for base, m in ((90, 16), (1000, 5), (4080, 16)):
        _check(hq, hkv, d, d // 2, base, m, seed=base + m, window=100, softcap=50.0)


@pytest.mark.parametrize("m", [4, 16])
@pytest.mark.parametrize("model", ["llama-2-7b", "llama-3-8b"])
def test_rows_cuda_graph_gpu(model, m):
    """Captured once at base 100 (the verify step's use), replayed at other bases: each replay gives the bits of M
    eager successive decode calls from the caches as they were, and writes the same cache rows."""
    hq, hkv, d = ATTN_HEADS[model]
    gen = torch.Generator().manual_seed(m)
    q, k, v, kc, vc, cos, sin = rows_inputs(m, hq, hkv, d, d, T_MAX, gen, theta=500000.0)
    ws = at.attention_workspace(hq, d, T_MAX, "cuda", rows=16)
    out = torch.empty(m, hq, d, dtype=torch.float16, device="cuda")
    pos = torch.tensor([100], dtype=torch.int32, device="cuda")
    kw = dict(scale=d ** -0.5)

    def call():
        at.attention_rows(q, k, v, kc, vc, pos, cos, sin, out=out, workspace=ws, **kw)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for base in (6, 56, 100, 1016, 2047, T_MAX - m):
        kc0, vc0 = kc.clone(), vc.clone()
        pos.fill_(base)
        graph.replay()
        torch.cuda.synchronize()
        y_seq, kc_seq, vc_seq = successive_decode(q, k, v, kc0, vc0, base, cos, sin, workspace=ws, **kw)
        assert torch.equal(out, y_seq), base
        assert torch.equal(kc, kc_seq) and torch.equal(vc, vc_seq), base
