"""Split-KV decode attention vs float64 and vs the same-dtype torch computation; the fused RoPE + KV append +
attention kernel (decode_attention_fused) vs float64 and vs rope_kv_append + decode_attention."""
from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from kernels_conftest import DEVICE, ON_GPU, attention as at, fused as fu, rel_err, requires_cuda
from shapes import ATTN_HEADS

N_RANDOM = 45


def _case(seed):
    r = random.Random(1000 + seed)
    hkv = r.choice([1, 2, 3, 4])
    g = r.choice([1, 1, 2, 4, 7])
    d = r.choice([64, 128, 256, 80, 96]) if ON_GPU else r.choice([64, 128, 256, 80, 16])
    tmax = r.choice([1, 3, 53, 97, 257, 1025, 4096]) if ON_GPU else r.choice([1, 3, 53, 64, 65, 97, 130])
    length = r.randint(1, tmax) if r.random() < 0.7 else tmax
    window = r.choice([None, None, 1, 16, 64, 100])
    softcap = r.choice([None, None, 30.0, 50.0])
    return hkv * g, hkv, d, tmax, length, window, softcap, r.random() < 0.5


def _inputs(hq, hkv, d, tmax, gen, amp=1.0):
    q = (torch.randn(hq, d, generator=gen) * amp).half().to(DEVICE)
    k = torch.randn(hkv, tmax, d, generator=gen).half().to(DEVICE)
    v = torch.randn(hkv, tmax, d, generator=gen).half().to(DEVICE)
    return q, k, v


@pytest.mark.parametrize("seed", range(N_RANDOM))
def test_attention_random_shapes(seed):
    hq, hkv, d, tmax, length, window, softcap, as_tensor = _case(seed)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _inputs(hq, hkv, d, tmax, gen, amp=2.0)
    scale = d ** -0.5
    kw = dict(scale=scale, window=window, softcap=softcap)
    ref = at.decode_attention_reference(q.cpu(), k.cpu(), v.cpu(), length, **kw)
    ref32 = at.decode_attention_torch(q.cpu(), k.cpu(), v.cpu(), length, dtype=torch.float32, **kw)
    t16 = at.decode_attention_torch(q.cpu(), k.cpu(), v.cpu(), length, dtype=torch.float16, **kw)
    err16 = rel_err(t16, ref32)
    ln = torch.tensor([length], dtype=torch.int32, device=DEVICE) if as_tensor else length
    outs = {}
    for split in (True, False):
        y = at.decode_attention(q, k, v, ln, split=split, **kw)
        outs[split] = y
        assert rel_err(y, ref) < 2e-3, (split, rel_err(y, ref))
        # issue 4: at most 2x the error of the same-dtype torch computation against fp32
        assert rel_err(y, ref32) <= 2 * err16 + 1e-4, (split, rel_err(y, ref32), err16)
    assert rel_err(outs[True], outs[False]) < 2e-3


def test_attention_bad_shapes_raise():
    gen = torch.Generator().manual_seed(0)
    q, k, v = _inputs(4, 2, 64, 16, gen)
    with pytest.raises(ValueError, match="q"):
        at.decode_attention(q[:3], k, v, 5, scale=0.1)
    with pytest.raises(ValueError, match="v_cache"):
        at.decode_attention(q, k, v[:, :8], 5, scale=0.1)
    with pytest.raises(ValueError, match="k_cache"):
        at.decode_attention(q, k[..., :32], v, 5, scale=0.1)
    with pytest.raises(ValueError, match="length"):
        at.decode_attention(q, k, v, 17, scale=0.1)
    with pytest.raises(ValueError, match="length"):
        at.decode_attention(q, k, v, 0, scale=0.1)
    with pytest.raises(ValueError, match="scale"):
        at.decode_attention(q, k, v, 5, scale=-1.0)
    with pytest.raises(ValueError, match="window"):
        at.decode_attention(q, k, v, 5, scale=0.1, window=0)
    with pytest.raises(ValueError, match="q"):
        at.decode_attention(q.float(), k, v, 5, scale=0.1)


# ----------------------------------------------------------------------------- GPU, full size
@requires_cuda
@pytest.mark.parametrize("model", list(ATTN_HEADS))
@pytest.mark.parametrize("length", [1, 63, 64, 65, 1024, 4095, 4096])
def test_attention_real_heads_gpu(model, length):
    hq, hkv, d = ATTN_HEADS[model]
    gen = torch.Generator().manual_seed(length)
    q, k, v = _inputs(hq, hkv, d, 4096, gen, amp=2.0)
    ref = at.decode_attention_reference(q, k, v, length, scale=d ** -0.5)
    ln = torch.tensor([length], dtype=torch.int32, device="cuda")
    y = at.decode_attention(q, k, v, ln, scale=d ** -0.5)
    assert rel_err(y, ref) < 2e-3
    for _ in range(10):  # bitwise reproducible
        assert torch.equal(at.decode_attention(q, k, v, ln, scale=d ** -0.5), y)


@requires_cuda
def test_attention_cuda_graph_length_tensor_gpu():
    hq, hkv, d = ATTN_HEADS["llama-3-8b"]
    gen = torch.Generator().manual_seed(0)
    q, k, v = _inputs(hq, hkv, d, 2048, gen)
    ln = torch.tensor([100], dtype=torch.int32, device="cuda")
    ws = at.attention_workspace(hq, d, 2048, "cuda")
    out = torch.empty(hq, d, dtype=torch.float16, device="cuda")
    at.decode_attention(q, k, v, ln, scale=d ** -0.5, out=out, workspace=ws)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        at.decode_attention(q, k, v, ln, scale=d ** -0.5, out=out, workspace=ws)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        at.decode_attention(q, k, v, ln, scale=d ** -0.5, out=out, workspace=ws)
    for length in (1, 100, 1000, 2048):
        ln.fill_(length)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, at.decode_attention(q, k, v, length, scale=d ** -0.5)), length


@pytest.mark.parametrize("window", [None, 100])
def test_attention_merge_in_several_steps(window):
    """The merge kernel walks the chunks merge_chunks at a time: with 2 per step a 7-chunk cache takes
    4 steps (and a window starts mid-step); the result must match the float64 reference."""
    cfg = at.AttnConfig(chunk=64, block_n=64, merge_chunks=2)
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d, tmax = 4, 2, 64, 7 * cfg.chunk
    q, k, v = _inputs(hq, hkv, d, tmax, gen, amp=2.0)
    for length in (tmax, tmax - 30, 3 * cfg.chunk + 1):
        kw = dict(scale=d ** -0.5, window=window)
        y = at.decode_attention(q, k, v, length, split=True, config=cfg, **kw).double()
        ref = at.decode_attention_reference(q, k, v, length, **kw)
        assert rel_err(y, ref) < 2e-3, (length, rel_err(y, ref))


# ----------------------------------------------------------------------------- configs
HEAD_DIMS = (64, 80, 96, 128, 160, 192, 256)
SMEM_LIMIT = 227 * 1024  # sm_90 (H100/H200) shared memory per block


def test_smem_model_never_below_measured():
    """The rule's model against shared memory Triton 3.6 allocated for sm_90 (ahead-of-time compile
    with the launch specialization): (block_n, D, stages, inner loop, G) -> bytes. (128, 256, 3, True)
    is the sequential kernel at 128-position chunks that exceeded shared memory on the H200."""
    measured = {(64, 128, 1, False, 1): 20, (128, 128, 1, False, 4): 36, (64, 256, 1, False, 2): 40,
                (128, 256, 1, False, 1): 72, (64, 128, 2, True, 1): 38, (64, 128, 3, True, 4): 70,
                (64, 256, 2, True, 2): 74, (64, 256, 3, True, 7): 138, (32, 128, 3, True, 1): 37,
                (128, 256, 2, True, 2): 140, (128, 256, 3, True, 2): 268, (128, 128, 1, False, 64): 80,
                (64, 256, 1, False, 64): 96, (64, 256, 3, True, 64): 224}
    for (bn, d, st, loop, g), kib in measured.items():
        assert at.smem_estimate(bn, d, st, loop, g) >= kib << 10, (bn, d, st, loop, g)
    assert at.SMEM_BUDGET <= SMEM_LIMIT


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_chooser_stays_inside_resources(d):
    bd = max(16, 1 << (d - 1).bit_length())
    for g in (1, 2, 3, 4, 7, 8, 16, 64):
        for t_max, hkv in itertools.product((1, 63, 64, 1000, 4096, 32768, 131072), (None, 1, 8, 32, 64)):
            cfg = at.choose_config(d, g, t_max, hkv)
            assert at.config_fits(cfg, d, g), (d, g, t_max, cfg)
            loop = cfg.chunk > cfg.block_n
            assert at.smem_estimate(cfg.block_n, d, cfg.stages, loop, g) <= at.SMEM_BUDGET
            if bd > 128:  # 128-position tiles only at BLOCK_D <= 128 (or with 8 warps: no spills)
                assert cfg.block_n <= 64 or cfg.warps >= 8, cfg
            assert cfg.chunk % cfg.block_n == 0
    # the sequential kernel (fixed 64-position steps, 3 stages) too, up to G = 16 (at G = 64 and
    # D = 256 it measured 224 KiB: inside the 227 KiB limit, outside the model's budget)
    for g in (1, 2, 4, 8, 16):
        assert at.smem_estimate(at.CHUNK, d, at.SEQ_STAGES, True, g) <= at.SMEM_BUDGET


def test_rule_rejects_known_bad_configs():
    assert not at.config_fits(at.AttnConfig(chunk=128, block_n=128, warps=4), 256)  # ptxas spilled
    assert at.config_fits(at.AttnConfig(chunk=128, block_n=128, warps=8), 256)
    assert not at.config_fits(at.AttnConfig(chunk=256, block_n=128, stages=3), 256)  # 268 KiB
    assert not at.config_fits(at.AttnConfig(chunk=96, block_n=32), 128)  # chunk not a power of 2
    assert not at.config_fits(at.AttnConfig(chunk=32, block_n=64), 128)  # chunk < block_n
    assert not at.config_fits(at.AttnConfig(merge_d=8), 128)
    gen = torch.Generator().manual_seed(0)
    q, k, v = _inputs(4, 2, 256, 16, gen)
    with pytest.raises(ValueError, match="config"):
        at.decode_attention(q, k, v, 5, scale=0.1, config=at.AttnConfig(chunk=128, block_n=128))


@pytest.mark.parametrize("cfg", at.CANDIDATE_CONFIGS, ids=lambda c: c.name)
def test_candidate_configs_match_reference(cfg):
    """Every config the sweep may time, at small shapes: GQA with a window that starts inside a chunk
    and inside a block (tensor length), MHA at D = 80 with softcap (int length)."""
    gen = torch.Generator().manual_seed(11)
    tmax = 600
    cases = ((3, 1, 64, tmax - 37, 100, None, True), (1, 1, 80, tmax, None, 30.0, False))
    for hq, hkv, d, length, window, softcap, as_tensor in cases:
        assert at.config_fits(cfg, d, hq // hkv)
        q, k, v = _inputs(hq, hkv, d, tmax, gen, amp=2.0)
        kw = dict(scale=d ** -0.5, window=window, softcap=softcap)
        ln = torch.tensor([length], dtype=torch.int32, device=DEVICE) if as_tensor else length
        y = at.decode_attention(q, k, v, ln, split=True, config=cfg, **kw)
        ref = at.decode_attention_reference(q.cpu(), k.cpu(), v.cpu(), length, **kw)
        assert rel_err(y, ref) < 2e-3, (cfg.name, hq, hkv, d, rel_err(y, ref))


def test_workspace_sizing():
    """attention_workspace sizes for the config decode_attention uses; without a group size (the
    engine's call) for the smallest chunk the chooser picks for any group size of Hq heads."""
    for hq, d, tmax in ((32, 128, 4096), (8, 256, 4096), (9, 64, 1000), (14, 80, 65)):
        m, l, o, counters = at.attention_workspace(hq, d, tmax, "cpu")
        bd = max(16, 1 << (d - 1).bit_length())
        nch = max(at._n_chunks(at.choose_config(d, g, tmax, hq // g), tmax) for g in range(1, hq + 1) if hq % g == 0)
        assert m.shape == l.shape == (hq, nch) and o.shape == (hq, nch, bd)
        assert m.dtype == l.dtype == o.dtype == torch.float32
        assert counters.dtype == torch.int32 and counters.shape == (hq,) and not counters.any()
        for hkv in (hkv for hkv in range(1, hq + 1) if hq % hkv == 0):
            need = at._n_chunks(at.choose_config(d, hq // hkv, tmax, hkv), tmax)
            assert at.attention_workspace(hq, d, tmax, "cpu", hkv=hkv)[0].shape[1] == need <= nch
        cfg = at.AttnConfig(chunk=256, block_n=64, stages=2)
        assert at.attention_workspace(hq, d, tmax, "cpu", config=cfg)[2].shape == (hq, -(-tmax // 256), bd)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1)])
def test_engine_style_workspace(hq, hkv):
    """The engine allocates the workspace once without a group size and passes it with a tensor length;
    a workspace too small for the config raises instead of writing out of bounds."""
    gen = torch.Generator().manual_seed(3)
    d, tmax, length = 64, 300, 257
    q, k, v = _inputs(hq, hkv, d, tmax, gen, amp=2.0)
    ws = at.attention_workspace(hq, d, tmax, DEVICE)
    out = torch.empty(hq, d, dtype=torch.float16, device=DEVICE)
    ln = torch.tensor([length], dtype=torch.int32, device=DEVICE)
    at.decode_attention(q, k, v, ln, scale=d ** -0.5, out=out, workspace=ws, split=True)
    ref = at.decode_attention_reference(q.cpu(), k.cpu(), v.cpu(), length, scale=d ** -0.5)
    assert rel_err(out, ref) < 2e-3
    small = at.attention_workspace(hq, d, tmax, DEVICE, config=at.AttnConfig(chunk=512, block_n=64))
    with pytest.raises(ValueError, match="workspace"):
        at.decode_attention(q, k, v, ln, scale=d ** -0.5, out=out, workspace=small, split=True,
                            config=at.AttnConfig(chunk=64, block_n=64))


# ----------------------------------------------------------------------------- adaptive chunks (splits)
N_SPLITS = 30


def _n_split_chunks(cfg, length, window):
    """The split programs that hold visible positions (AttnConfig.splits: the span from the window start rounded
    down to block_n, cut into chunks of max(chunk, ceil(span / P) rounded up to block_n))."""
    lo = max(length - window, 0) if window is not None else 0
    span = length - lo // cfg.block_n * cfg.block_n
    clen = max(cfg.chunk, -(-(-(-span // cfg.splits)) // cfg.block_n) * cfg.block_n)
    return -(-span // clen)


def _split_case(seed):
    """Small shapes for the interpreter. Lengths: 1; up to P * chunk (the chunks stay `chunk` long, some programs
    idle); past it (the chunks grow: the adaptive case); exact multiples of P blocks (every chunk full); windows that
    start inside and on a block."""
    r = random.Random(5000 + seed)
    bn = r.choice([16, 32])
    cfg = at.AttnConfig(splits=r.choice([1, 2, 4, 8, 16, 64]), chunk=bn * r.choice([1, 1, 2, 4]), block_n=bn,
                        stages=r.choice([1, 2, 3]), merge_chunks=r.choice([2, 16, 64]), merge_d=r.choice([0, 16, 32]))
    hkv = r.choice([1, 2, 3])
    g = r.choice([1, 2, 4, 7])
    d = r.choice([16, 64, 80]) if not ON_GPU else r.choice([64, 128, 256, 80])
    pc, pb = cfg.splits * cfg.chunk, cfg.splits * bn
    regime = r.choice(["one", "short", "adaptive", "adaptive", "exact"])
    if regime in ("adaptive", "exact") and pc > 256:  # keep the cache small for the interpreter
        cfg = dataclasses.replace(cfg, splits=max(1, 256 // cfg.chunk))
        pc, pb = cfg.splits * cfg.chunk, cfg.splits * bn
    if regime == "one":
        tmax, length = r.choice([1, 40, 97]), 1
    elif regime == "short":
        tmax = r.choice([40, 97, 130, 257])
        length = r.randint(1, min(tmax, pc))
    elif regime == "adaptive":
        length = r.randint(pc + 1, 2 * pc + 50)
        tmax = length + r.choice([0, 0, 13])
    else:
        length = pb * r.randint(max(1, -(-pc // pb)), max(1, -(-pc // pb)) + 2)
        tmax = length + r.choice([0, 7])
    window = r.choice([None, None, 1, bn, 3 * bn - 5, pc + 17])  # the last: a window span past P * chunk
    softcap = r.choice([None, None, 30.0])
    return hkv * g, hkv, d, tmax, length, window, softcap, r.random() < 0.5, cfg


@pytest.mark.parametrize("seed", range(N_SPLITS))
def test_split_configs_random(seed):
    """Split configs vs float64 and the same-dtype torch bound, merge kernel and inline merge (same bits under the
    interpreter), two calls bitwise equal. The workspace is filled with NaN first: the programs past the last
    chunk must not write it and the merge must read only the chunks that were written (else NaN)."""
    hq, hkv, d, tmax, length, window, softcap, as_tensor, cfg = _split_case(seed)
    assert at.config_fits(cfg, d, hq // hkv), cfg
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _inputs(hq, hkv, d, tmax, gen, amp=2.0)
    kw = dict(scale=d ** -0.5, window=window, softcap=softcap)
    ref = at.decode_attention_reference(q.cpu(), k.cpu(), v.cpu(), length, **kw)
    ref32 = at.decode_attention_torch(q.cpu(), k.cpu(), v.cpu(), length, dtype=torch.float32, **kw)
    err16 = rel_err(at.decode_attention_torch(q.cpu(), k.cpu(), v.cpu(), length, dtype=torch.float16, **kw), ref32)
    ln = torch.tensor([length], dtype=torch.int32, device=DEVICE) if as_tensor else length
    ws = at.attention_workspace(hq, d, tmax, DEVICE, config=cfg)
    assert ws.m.shape[1] == min(cfg.splits, -(-tmax // cfg.chunk))
    n = _n_split_chunks(cfg, length, window)
    assert 1 <= n <= ws.m.shape[1]
    outs = []
    for inline_merge in (False, True, False):
        for buf in ws[:3]:
            buf.fill_(float("nan"))
        outs.append(at.decode_attention(q, k, v, ln, split=True, config=cfg, workspace=ws, inline_merge=inline_merge,
                                        **kw))
        assert not ws.counters.any()
        assert ws.m[:, n:].isnan().all() and not ws.m[:, :n].isnan().any(), (cfg.name, length, window, n)
    y = outs[0]
    assert rel_err(y, ref) < 2e-3, (cfg.name, length, window, rel_err(y, ref))
    assert rel_err(y, ref32) <= 2 * err16 + 1e-4, (cfg.name, rel_err(y, ref32), err16)
    assert torch.equal(outs[2], y)  # bitwise reproducible
    _assert_same_as_unfused(outs[1], y)  # inline merge: same chunk steps, same order


def test_split_config_rule_and_names():
    """config_fits takes splits of 1..64 (powers of two) and applies the inner loop's shared memory to them even
    when chunk == block_n (their chunks grow with the length); the name shows P."""
    cfg = at.AttnConfig(splits=8, chunk=64, block_n=64, stages=3, merge_chunks=64, merge_d=32)
    assert cfg.name == "p8c64b64s3-w4-m64w4d32"
    assert at.AttnConfig(splits=8, chunk=128, block_n=128, warps=8, stages=2, merge_chunks=64,
                         merge_d=32).name == "p8c128b128s2-w8-m64w4d32"
    assert at.AttnConfig(chunk=64, block_n=64, stages=3).name == "c64-w4-m16w4dall"  # no split: unchanged
    for p in (1, 2, 4, 8, 16, 32, 64):
        assert at.config_fits(dataclasses.replace(cfg, splits=p), 128)
    for p in (-1, 3, 12, 128):
        assert not at.config_fits(dataclasses.replace(cfg, splits=p), 128)
    # 3 stages of 64x256 tiles for 64 query heads: over the budget with the loop, inside it as one tile
    assert not at.config_fits(cfg, 256, 64)
    assert at.config_fits(dataclasses.replace(cfg, splits=0), 256, 64)
    assert len({c.name for c in at.CANDIDATE_CONFIGS}) == len(at.CANDIDATE_CONFIGS)


def test_split_workspace_sizing(monkeypatch):
    """A split config's workspace holds min(P, ceil(T_max / chunk)) chunks per head; the engine's call (no config,
    no group size) covers a split config returned by the chooser, and a too small workspace raises."""
    cfg = at.AttnConfig(splits=8, chunk=16, block_n=16, stages=2, merge_chunks=64, merge_d=16)
    for tmax, nch in ((1, 1), (40, 3), (128, 8), (4096, 8)):
        ws = at.attention_workspace(4, 64, tmax, "cpu", config=cfg)
        assert ws.m.shape == (4, nch) and ws.o.shape == (4, nch, 64), tmax
    monkeypatch.setattr(at, "choose_config", lambda d, g, t_max, hkv=None, strict=True: cfg if g == 2 else at.LEGACY_CONFIG)
    assert at.attention_workspace(4, 64, 4096, "cpu").m.shape[1] == 64  # LEGACY (g = 1, 4): 4096 / 64
    assert at.attention_workspace(4, 64, 100, "cpu").m.shape[1] == 7  # the split config (g = 2): 100 / 16
    gen = torch.Generator().manual_seed(2)
    q, k, v = _inputs(4, 2, 64, 100, gen, amp=2.0)
    ws = at.attention_workspace(4, 64, 100, DEVICE)
    ln = torch.tensor([77], dtype=torch.int32, device=DEVICE)
    y = at.decode_attention(q, k, v, ln, scale=0.125, workspace=ws, split=True)  # the chooser's split config
    assert rel_err(y, at.decode_attention_reference(q.cpu(), k.cpu(), v.cpu(), 77, scale=0.125)) < 2e-3
    small = at.attention_workspace(4, 64, 100, DEVICE, config=dataclasses.replace(cfg, splits=4))
    with pytest.raises(ValueError, match="workspace"):
        at.decode_attention(q, k, v, ln, scale=0.125, workspace=small, split=True, config=cfg)


@requires_cuda
@pytest.mark.parametrize("model", list(ATTN_HEADS))
def test_split_configs_real_heads_gpu(model):
    """The split candidates at full size over lengths from 1 to the whole cache (below, at and past P * chunk),
    with and without a window: decode_attention (tensor length) and the fused path (merge kernel and inline merge)
    against float64, each bitwise reproducible; the caches get rope_kv_append's bits."""
    hq, hkv, d = ATTN_HEADS[model]
    gen = torch.Generator().manual_seed(9)
    q, k, v = _inputs(hq, hkv, d, 4096, gen, amp=2.0)
    qn, kn, vn, kc, vc, cos, sin = _fused_inputs(hq, hkv, d, d, 4096, gen)
    ws = at.attention_workspace(hq, d, 4096, "cuda")
    for cfg in (c for c in at.CANDIDATE_CONFIGS if c.splits and at.config_fits(c, d, hq // hkv)):
        for length in (1, 63, 64, 65, 255, 256, 257, 1000, 1024, 4095, 4096):
            ln = torch.tensor([length], dtype=torch.int32, device="cuda")
            for window in (None, 1000):
                kw = dict(scale=d ** -0.5, window=window)
                ref = at.decode_attention_reference(q, k, v, length, **kw)
                y = at.decode_attention(q, k, v, ln, config=cfg, split=True, workspace=ws, **kw)
                assert rel_err(y, ref) < 2e-3, (cfg.name, length, window, rel_err(y, ref))
                assert torch.equal(at.decode_attention(q, k, v, ln, config=cfg, split=True, workspace=ws, **kw), y)
                fref = _fused_reference(qn, kn, vn, kc, vc, length - 1, cos, sin, **kw)
                y_unf, kc_unf, vc_unf = _unfused(qn, kn, vn, kc, vc, length - 1, cos, sin, config=cfg, **kw)
                for inline_merge in (False, True):
                    kc2, vc2 = kc.clone(), vc.clone()
                    fkw = dict(kw, config=cfg, workspace=ws, inline_merge=inline_merge)
                    yf = at.decode_attention_fused(qn, kn, vn, kc2, vc2, ln - 1, cos, sin, **fkw)
                    assert torch.equal(kc2, kc_unf) and torch.equal(vc2, vc_unf)
                    assert rel_err(yf, fref) < 2e-3 and rel_err(yf, y_unf) < 1e-3, (cfg.name, length, window)
                    assert torch.equal(at.decode_attention_fused(qn, kn, vn, kc2, vc2, ln - 1, cos, sin, **fkw), yf)
                    assert not ws.counters.any()


@requires_cuda
@pytest.mark.parametrize("model", ["llama-2-7b", "llama-3-8b", "gemma-2-2b", "qwen2.5-0.5b"])
def test_candidate_configs_real_heads_gpu(model):
    hq, hkv, d = ATTN_HEADS[model]
    gen = torch.Generator().manual_seed(5)
    q, k, v = _inputs(hq, hkv, d, 4096, gen, amp=2.0)
    ln = torch.tensor([4000], dtype=torch.int32, device="cuda")
    for window in (None, 1000):
        ref = at.decode_attention_reference(q, k, v, 4000, scale=d ** -0.5, window=window)
        for cfg in at.CANDIDATE_CONFIGS:
            if at.config_fits(cfg, d, hq // hkv):
                y = at.decode_attention(q, k, v, ln, scale=d ** -0.5, window=window, config=cfg, split=True)
                assert rel_err(y, ref) < 2e-3, (cfg.name, window)
                assert torch.equal(at.decode_attention(q, k, v, ln, scale=d ** -0.5, window=window, config=cfg,
                                                       split=True), y)


# ----------------------------------------------------------------------------- fused RoPE + append + attention
N_FUSED = 40


def _fused_case(seed):
    r = random.Random(3000 + seed)
    hkv = r.choice([1, 2, 3, 4])
    g = r.choice([1, 1, 2, 4, 7])
    d = r.choice([64, 128, 256, 80, 96]) if ON_GPU else r.choice([64, 128, 256, 80, 16])
    rot = r.choice([d, d, d // 2])
    tmax = r.choice([1, 64, 65, 128, 257, 1025, 4096]) if ON_GPU else r.choice([1, 3, 64, 65, 97, 128, 130])
    # new positions on and next to the chunk boundaries (lengths 64, 65, 128, 129), the first and the last
    pos = min(tmax - 1, r.choice([0, 63, 64, 127, 128, tmax - 1, r.randrange(tmax)]))
    window = r.choice([None, None, 1, 16, 64, 100])
    softcap = r.choice([None, None, 30.0])
    return hkv * g, hkv, d, rot, tmax, pos, window, softcap, r.random() < 0.5


def _fused_inputs(hq, hkv, d, rot, tmax, gen):
    """Un-roped q, k, v as views of one qkv vector (as the engine passes them), random caches (the slot of
    the new position holds stale values), RoPE tables."""
    qkv = (torch.randn(hq + 2 * hkv, d, generator=gen) * 2).half().to(DEVICE)
    kc = torch.randn(hkv, tmax, d, generator=gen).half().to(DEVICE)
    vc = torch.randn(hkv, tmax, d, generator=gen).half().to(DEVICE)
    cos, sin = fu.rope_tables(tmax, rot, theta=float(torch.randint(1000, 1000000, (1,), generator=gen)),
                              device=DEVICE)
    return qkv[:hq], qkv[hq:hq + hkv], qkv[hq + hkv:], kc, vc, cos, sin


def _fused_reference(q, k, v, kc, vc, pos, cos, sin, **kw):
    """float64: RoPE of q and k at pos, k and v appended, attention over pos + 1 positions."""
    p = torch.tensor([pos])
    qr = fu.rope_reference(q.cpu()[None], p, cos.cpu(), sin.cpu())[0]
    kc64, vc64 = kc.cpu().double(), vc.cpu().double()
    kc64[:, pos] = fu.rope_reference(k.cpu()[None], p, cos.cpu(), sin.cpu())[0]
    vc64[:, pos] = v.cpu().double()
    return at.decode_attention_reference(qr, kc64, vc64, pos + 1, **kw)


def _unfused(q, k, v, kc, vc, pos, cos, sin, **kw):
    """rope_kv_append + decode_attention (merge kernel) on copies: (output, k cache, v cache)."""
    qr, kc2, vc2 = q.clone(), kc.clone(), vc.clone()
    fu.rope_kv_append(qr, k, v, kc2, vc2, pos, cos, sin)
    return at.decode_attention(qr, kc2, vc2, pos + 1, split=True, **kw), kc2, vc2


def _assert_same_as_unfused(y, y_unfused):
    # Under the interpreter both paths do the same fp32 operations in the same order (the inline merge runs
    # the merge kernel's code over the same chunk steps), so the bits agree; compiled, the inline merge's
    # column tiling may give tl.sum another reduction tree.
    if ON_GPU:
        assert rel_err(y, y_unfused) < 1e-3
    else:
        assert torch.equal(y, y_unfused)


def _run_fused(q, k, v, kc, vc, pos, cos, sin, as_tensor, **kw):
    """decode_attention_fused twice (the second call must give the same bits); the counters must be back to 0.
    The inline merge unless kw says otherwise (the merge kernel path is also in the engine's and switch tests)."""
    kw.setdefault("inline_merge", True)
    p = torch.tensor([pos], dtype=torch.int32, device=DEVICE) if as_tensor else pos
    ws = at.attention_workspace(q.shape[0], q.shape[1], kc.shape[1], DEVICE, hkv=kc.shape[0], config=kw.get("config"))
    y = at.decode_attention_fused(q, k, v, kc, vc, p, cos, sin, workspace=ws, **kw)
    assert not ws.counters.any()
    assert torch.equal(at.decode_attention_fused(q, k, v, kc, vc, p, cos, sin, workspace=ws, **kw), y)
    assert not ws.counters.any()
    return y


@pytest.mark.parametrize("seed", range(N_FUSED))
def test_fused_attention_random_shapes(seed):
    hq, hkv, d, rot, tmax, pos, window, softcap, as_tensor = _fused_case(seed)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, kc, vc, cos, sin = _fused_inputs(hq, hkv, d, rot, tmax, gen)
    kw = dict(scale=d ** -0.5, window=window, softcap=softcap)
    ref = _fused_reference(q, k, v, kc, vc, pos, cos, sin, **kw)
    y_unf, kc_unf, vc_unf = _unfused(q, k, v, kc, vc, pos, cos, sin, **kw)
    q0 = q.clone()
    y = _run_fused(q, k, v, kc, vc, pos, cos, sin, as_tensor, **kw)
    # the caches hold exactly what rope_kv_append writes (and nothing else moved); q is rotated in registers only
    assert torch.equal(kc.cpu(), kc_unf.cpu()) and torch.equal(vc.cpu(), vc_unf.cpu())
    assert torch.equal(q, q0)
    assert rel_err(y, ref) < 2e-3, rel_err(y, ref)
    _assert_same_as_unfused(y, y_unf)


@pytest.mark.parametrize("window", [None, 1, 64, 65])
@pytest.mark.parametrize("pos", [0, 62, 63, 64, 65, 126, 127, 128, 191])
def test_fused_attention_chunk_boundaries(pos, window):
    """New positions at the ends of 64-position chunks (lengths 63..65, 127..129, 192), windows that start on,
    before and after a chunk boundary; GQA 6/2 x 64, caches of 192 positions (3 chunks)."""
    gen = torch.Generator().manual_seed(pos)
    q, k, v, kc, vc, cos, sin = _fused_inputs(6, 2, 64, 64, 192, gen)
    kw = dict(scale=0.125, window=window)
    ref = _fused_reference(q, k, v, kc, vc, pos, cos, sin, **kw)
    y_unf, kc_unf, _ = _unfused(q, k, v, kc, vc, pos, cos, sin, **kw)
    y = _run_fused(q, k, v, kc, vc, pos, cos, sin, True, **kw)
    assert torch.equal(kc.cpu(), kc_unf.cpu())
    assert rel_err(y, ref) < 2e-3
    _assert_same_as_unfused(y, y_unf)


def _split_configs():
    """The candidate configs, one per distinct split kernel (merge_d and merge_warps only shape the merge
    kernel), plus a merge of 2 chunks per step (a 7-chunk cache takes 4 steps)."""
    seen = {}
    for c in at.CANDIDATE_CONFIGS + (at.AttnConfig(chunk=64, block_n=64, merge_chunks=2),):
        seen.setdefault((c.splits, c.chunk, c.block_n, c.warps, c.stages, c.merge_chunks), c)
    return list(seen.values())


@pytest.mark.parametrize("cfg", _split_configs(), ids=lambda c: c.name)
def test_fused_attention_configs(cfg):
    """Every split kernel the sweep may time, fused: GQA with a window starting inside a chunk and a block (tensor
    pos), MHA at D = 80 with softcap and partial rotary (int pos); inner-loop chunks, multi-step merges."""
    gen = torch.Generator().manual_seed(13)
    tmax = 7 * 64
    for hq, hkv, d, rot, pos, window, softcap, as_tensor in ((3, 1, 64, 64, tmax - 37, 100, None, True),
                                                              (2, 2, 80, 40, tmax - 1, None, 30.0, False)):
        q, k, v, kc, vc, cos, sin = _fused_inputs(hq, hkv, d, rot, tmax, gen)
        kw = dict(scale=d ** -0.5, window=window, softcap=softcap, config=cfg)
        ref = _fused_reference(q, k, v, kc, vc, pos, cos, sin, scale=d ** -0.5, window=window, softcap=softcap)
        y_unf, _, _ = _unfused(q, k, v, kc, vc, pos, cos, sin, **kw)
        y = _run_fused(q, k, v, kc, vc, pos, cos, sin, as_tensor, **kw)
        assert rel_err(y, ref) < 2e-3, (cfg.name, d, rel_err(y, ref))
        _assert_same_as_unfused(y, y_unf)


N_FUSED_SPLITS = 14


def _check_fused_split(q, k, v, kc, vc, pos, cos, sin, as_tensor, cfg, **kw):
    """decode_attention_fused with a split config, merge kernel and inline merge, against float64 and against
    rope_kv_append + decode_attention (same config): the caches get exactly rope_kv_append's bits, q is untouched,
    two calls agree bitwise and the inline merge's counters end at zero (_run_fused)."""
    ref = _fused_reference(q, k, v, kc, vc, pos, cos, sin, **kw)
    y_unf, kc_unf, vc_unf = _unfused(q, k, v, kc, vc, pos, cos, sin, config=cfg, **kw)
    q0 = q.clone()
    for inline_merge in (False, True):
        kc2, vc2 = kc.clone(), vc.clone()
        y = _run_fused(q, k, v, kc2, vc2, pos, cos, sin, as_tensor, config=cfg, inline_merge=inline_merge, **kw)
        assert torch.equal(kc2.cpu(), kc_unf.cpu()) and torch.equal(vc2.cpu(), vc_unf.cpu()), (cfg.name, pos)
        assert torch.equal(q, q0)
        assert rel_err(y, ref) < 2e-3, (cfg.name, pos, inline_merge, rel_err(y, ref))
        _assert_same_as_unfused(y, y_unf)


@pytest.mark.parametrize("seed", range(N_FUSED_SPLITS))
def test_fused_split_configs_random(seed):
    """The fused path with split configs over the cases of test_split_configs_random (the new token at
    length - 1), full and partial rotary."""
    hq, hkv, d, tmax, length, window, softcap, as_tensor, cfg = _split_case(100 + seed)
    rot = random.Random(seed).choice([d, d // 2])
    gen = torch.Generator().manual_seed(seed)
    q, k, v, kc, vc, cos, sin = _fused_inputs(hq, hkv, d, rot, tmax, gen)
    _check_fused_split(q, k, v, kc, vc, length - 1, cos, sin, as_tensor, cfg, scale=d ** -0.5, window=window,
                       softcap=softcap)


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("pos", [0, 63, 64, 95, 192])
def test_fused_split_chunk_boundaries(pos, window):
    """4 splits of 16-position blocks: lengths 1 and 64 keep 16-position chunks (64: all 4 full), 65 puts the new
    position first in a 32-position chunk, 96 last in one, 193 first in a 64-position chunk; a window whose span
    is cut into adaptive chunks too. GQA 6/2 x 64, cache of 200 positions."""
    cfg = at.AttnConfig(splits=4, chunk=16, block_n=16, stages=2, merge_chunks=64, merge_d=16)
    gen = torch.Generator().manual_seed(pos)
    q, k, v, kc, vc, cos, sin = _fused_inputs(6, 2, 64, 64, 200, gen)
    _check_fused_split(q, k, v, kc, vc, pos, cos, sin, True, cfg, scale=0.125, window=window)


def test_inline_merge_in_column_slices(monkeypatch):
    """With a small register budget the last program merges each head in several column slices
    (BLOCK_DM < BLOCK_D): same result as the merge kernel."""
    monkeypatch.setattr(at, "MERGE_REGS", 4)  # 4 * 32 * 4 warps / 16 chunks per step = 32 columns of 128
    gen = torch.Generator().manual_seed(21)
    q, k, v, kc, vc, cos, sin = _fused_inputs(4, 2, 128, 128, 200, gen)
    y_unf, _, _ = _unfused(q, k, v, kc, vc, 150, cos, sin, scale=0.1)
    y = _run_fused(q, k, v, kc, vc, 150, cos, sin, True, scale=0.1)
    assert rel_err(y, _fused_reference(q, k, v, kc, vc, 150, cos, sin, scale=0.1)) < 2e-3
    _assert_same_as_unfused(y, y_unf)


@pytest.mark.parametrize("inline_merge", [True, False])
def test_rope_and_inline_merge_switch_independently(inline_merge):
    """The split kernel's two switches one at a time: RoPE + append with the merge kernel (fused,
    inline_merge=False), and the inline merge over an already roped q (decode_attention, inline_merge=True)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, kc, vc, cos, sin = _fused_inputs(8, 2, 64, 64, 150, gen)
    pos = torch.tensor([140], device=DEVICE)
    kw = dict(scale=0.125, window=100)
    y_unf, kc_unf, _ = _unfused(q, k, v, kc, vc, 140, cos, sin, **kw)
    ws = at.attention_workspace(8, 64, 150, DEVICE)
    if inline_merge:
        qr = q.clone()
        fu.rope_kv_append(qr, k, v, kc, vc, pos, cos, sin)
        y = at.decode_attention(qr, kc, vc, pos + 1, workspace=ws, inline_merge=True, **kw)
    else:
        y = at.decode_attention_fused(q, k, v, kc, vc, pos, cos, sin, workspace=ws, inline_merge=False, **kw)
    assert torch.equal(kc.cpu(), kc_unf.cpu()) and not ws.counters.any()
    _assert_same_as_unfused(y, y_unf)


def test_fused_attention_bad_arguments_raise():
    gen = torch.Generator().manual_seed(0)
    q, k, v, kc, vc, cos, sin = _fused_inputs(4, 2, 64, 64, 16, gen)
    kw = dict(scale=0.1)
    with pytest.raises(ValueError, match="pos"):
        at.decode_attention_fused(q, k, v, kc, vc, 16, cos, sin, **kw)
    with pytest.raises(ValueError, match="q"):
        at.decode_attention_fused(q[None].expand(2, -1, -1), k[None].expand(2, -1, -1), v[None].expand(2, -1, -1),
                                  kc, vc, 0, cos, sin, **kw)
    with pytest.raises(ValueError, match="k_cache"):
        at.decode_attention_fused(q, k, v, kc[:1], vc, 3, cos, sin, **kw)
    with pytest.raises(ValueError, match="cos"):
        at.decode_attention_fused(q, k, v, kc, vc, 3, cos.double(), sin, **kw)
    with pytest.raises(ValueError, match="window"):
        at.decode_attention_fused(q, k, v, kc, vc, 3, cos, sin, window=0, **kw)
    ws = at.attention_workspace(4, 64, 16, DEVICE)
    with pytest.raises(ValueError, match="workspace"):
        at.decode_attention_fused(q, k, v, kc, vc, 3, cos, sin, workspace=ws[:3], **kw)
    with pytest.raises(ValueError, match="counters"):
        at.decode_attention_fused(q, k, v, kc, vc, 3, cos, sin, workspace=ws._replace(counters=ws.counters[:1]),
                                  inline_merge=True, **kw)  # the counters are the inline merge's


# ----------------------------------------------------------------------------- fused, GPU, full size
@requires_cuda
@pytest.mark.parametrize("inline_merge", [False, True])
@pytest.mark.parametrize("model", list(ATTN_HEADS))
@pytest.mark.parametrize("length", [1, 63, 64, 65, 128, 1024, 4095, 4096])
def test_fused_attention_real_heads_gpu(model, length, inline_merge, monkeypatch):
    hq, hkv, d = ATTN_HEADS[model]
    gen = torch.Generator().manual_seed(length)
    q, k, v, kc, vc, cos, sin = _fused_inputs(hq, hkv, d, d, 4096, gen)
    pos = length - 1
    kw = dict(scale=d ** -0.5)
    fkw = dict(kw, inline_merge=inline_merge)
    ref = _fused_reference(q, k, v, kc, vc, pos, cos, sin, **kw)
    y_unf, kc_unf, vc_unf = _unfused(q, k, v, kc, vc, pos, cos, sin, **kw)
    p = torch.tensor([pos], dtype=torch.int32, device="cuda")
    ws = at.attention_workspace(hq, d, 4096, "cuda")
    y = at.decode_attention_fused(q, k, v, kc, vc, p, cos, sin, workspace=ws, **fkw)
    assert torch.equal(kc, kc_unf) and torch.equal(vc, vc_unf)
    assert rel_err(y, ref) < 2e-3 and rel_err(y, y_unf) < 1e-3
    for _ in range(10):  # bitwise reproducible whichever program arrives last
        assert torch.equal(at.decode_attention_fused(q, k, v, kc, vc, p, cos, sin, workspace=ws, **fkw), y)
    assert not ws.counters.any()
    monkeypatch.setenv("TRAPETUM_PDL", "0")  # programmatic dependent launch changes nothing
    assert torch.equal(at.decode_attention_fused(q, k, v, kc, vc, p, cos, sin, workspace=ws, **fkw), y)


SPLIT_CANDIDATES = [c for c in at.CANDIDATE_CONFIGS if c.splits]


@requires_cuda
@pytest.mark.parametrize("cfg", [None] + SPLIT_CANDIDATES, ids=lambda c: c.name if c else "chosen")
@pytest.mark.parametrize("inline_merge", [False, True])
@pytest.mark.parametrize("window", [None, 1000])
def test_fused_attention_cuda_graph_gpu(window, inline_merge, cfg):
    """Captured once, replayed with new positions (the engine's use): each replay gives the bits of an eager
    call at that position, and leaves the counters at zero. With a split config the chunk length follows each
    replay's position (64 positions up to 64 * P, longer past it) inside the one captured launch."""
    hq, hkv, d = ATTN_HEADS["llama-3-8b"]
    gen = torch.Generator().manual_seed(1)
    q, k, v, kc, vc, cos, sin = _fused_inputs(hq, hkv, d, d, 2048, gen)
    pos = torch.tensor([100], dtype=torch.int32, device="cuda")
    ws = at.attention_workspace(hq, d, 2048, "cuda")  # the engine's: large enough for the split configs too
    out = torch.empty(hq, d, dtype=torch.float16, device="cuda")
    kw = dict(scale=d ** -0.5, window=window, config=cfg)

    def call():
        at.decode_attention_fused(q, k, v, kc, vc, pos, cos, sin, out=out, workspace=ws, inline_merge=inline_merge, **kw)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for p in (0, 63, 64, 100, 511, 512, 1000, 2047):
        pos.fill_(p)
        graph.replay()
        torch.cuda.synchronize()
        assert not ws.counters.any(), p
        replayed = out.clone()
        assert torch.equal(replayed, at.decode_attention_fused(q, k, v, kc, vc, p, cos, sin, inline_merge=inline_merge,
                                                               **kw)), p
        ref = _fused_reference(q, k, v, kc, vc, p, cos, sin, scale=d ** -0.5, window=window)  # slot p: roped k
        assert rel_err(replayed, ref) < 2e-3, p


def test_named_config_from_the_environment(monkeypatch):
    """TRAPETUM_ATTN_CONFIG names a candidate for launches without a config (read at each call); an unknown
    name or one that breaks the rule for the launch's head dim is an error naming the variable; workspace
    sizing (strict=False) falls back to the default where the named config does not fit."""
    split = next(c for c in at.CANDIDATE_CONFIGS if c.splits == 8 and c.block_n == 64)
    monkeypatch.setenv("TRAPETUM_ATTN_CONFIG", split.name)
    assert at.choose_config(128, 1, 4096) == split
    gen = torch.Generator().manual_seed(3)
    q, k, v = _inputs(4, 2, 64, 100, gen, amp=2.0)
    ln = torch.tensor([90], dtype=torch.int32, device=DEVICE)
    y = at.decode_attention(q, k, v, ln, scale=0.125, split=True)
    ref = at.decode_attention_reference(q.cpu(), k.cpu(), v.cpu(), 90, scale=0.125)
    assert rel_err(y, ref) < 2e-3
    assert torch.equal(y, at.decode_attention(q, k, v, ln, scale=0.125, config=split))
    big = next(c for c in at.CANDIDATE_CONFIGS if c.splits == 8 and c.block_n == 128)
    monkeypatch.setenv("TRAPETUM_ATTN_CONFIG", big.name)
    assert not at.config_fits(big, 256, 1)
    with pytest.raises(ValueError, match="TRAPETUM_ATTN_CONFIG.*does not fit"):
        at.choose_config(256, 1, 4096)
    assert at.choose_config(256, 1, 4096, strict=False) == at._default_config(256, 1, 4096)
    monkeypatch.delenv("TRAPETUM_ATTN_CONFIG")
    # the default: 8 length-adaptive splits with >= 32 kv heads (MHA 32x128), fixed 64-position chunks otherwise
    assert at.choose_config(128, 1, 4224, 32) == at.SPLIT8_CONFIG
    assert at.choose_config(128, 4, 4224, 8).splits == 0 and at.choose_config(128, 1, 4224).splits == 0
    monkeypatch.setenv("TRAPETUM_ATTN_CONFIG", "c7-nonsense")
    with pytest.raises(ValueError, match="TRAPETUM_ATTN_CONFIG: unknown config 'c7-nonsense'"):
        at.choose_config(128, 1, 4096)
