"""Split-KV decode attention vs float64 and vs the same-dtype torch computation; the fused RoPE + KV append +
attention kernel (decode_attention_fused) vs float64 and vs rope_kv_append + decode_attention. The experimental
variants (kernels/experimental: the sequential kernel, the inline merge) are checked beside the production path
(_attend / _attend_fused pick one). Configs: test_kernels_attention_configs.py; rows: test_kernels_attention_rows*."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kernels_conftest import DEVICE, ON_GPU, attention as at, fused as fu, rel_err, requires_cuda
from shapes import ATTN_HEADS
from trapetum.kernels import attn_configs as ac
from trapetum.kernels.experimental import attention_inline as inline
from trapetum.kernels.experimental import attention_seq as seq
from trapetum.settings import KernelOptions

N_RANDOM = 45
PDL_OFF = KernelOptions(pdl="off")


def _workspace(hq, d, tmax, hkv=None, config=None):
    """A workspace both paths take: the inline merge's (m, l, o, counters); the merge kernel path uses its m, l, o."""
    return inline.inline_workspace(hq, d, tmax, DEVICE, hkv=hkv, config=config)


def _ws3(ws):
    return None if ws is None else at.AttnWorkspace(*ws[:3])


def _attend(q, kc, vc, length, *, inline_merge=False, split=True, workspace=None, **kw):
    """decode_attention (split + merge kernel), the inline merge (inline_merge) or the sequential kernel (not
    split)."""
    if not split:
        return seq.decode_attention_seq(q, kc, vc, length, **kw)
    if inline_merge:
        return inline.decode_attention_inline(q, kc, vc, length, workspace=workspace, **kw)
    return at.decode_attention(q, kc, vc, length, workspace=_ws3(workspace), **kw)


def _attend_fused(q, k, v, kc, vc, pos, cos, sin, *, inline_merge=False, workspace=None, **kw):
    """decode_attention_fused (split + merge kernel) or its inline-merge variant."""
    if inline_merge:
        return inline.decode_attention_fused_inline(q, k, v, kc, vc, pos, cos, sin, workspace=workspace, **kw)
    return at.decode_attention_fused(q, k, v, kc, vc, pos, cos, sin, workspace=_ws3(workspace), **kw)


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
        y = _attend(q, k, v, ln, split=split, **kw)
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
        y = at.decode_attention(q, k, v, length, config=cfg, **kw).double()
        ref = at.decode_attention_reference(q, k, v, length, **kw)
        assert rel_err(y, ref) < 2e-3, (length, rel_err(y, ref))


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
    ws = _workspace(hq, d, tmax, config=cfg)
    assert ws.m.shape[1] == min(cfg.splits, -(-tmax // cfg.chunk))
    n = _n_split_chunks(cfg, length, window)
    assert 1 <= n <= ws.m.shape[1]
    outs = []
    for inline_merge in (False, True, False):
        for buf in ws[:3]:
            buf.fill_(float("nan"))
        outs.append(_attend(q, k, v, ln, config=cfg, workspace=ws, inline_merge=inline_merge, **kw))
        assert not ws.counters.any()
        assert ws.m[:, n:].isnan().all() and not ws.m[:, :n].isnan().any(), (cfg.name, length, window, n)
    y = outs[0]
    assert rel_err(y, ref) < 2e-3, (cfg.name, length, window, rel_err(y, ref))
    assert rel_err(y, ref32) <= 2 * err16 + 1e-4, (cfg.name, rel_err(y, ref32), err16)
    assert torch.equal(outs[2], y)  # bitwise reproducible
    _assert_same_as_unfused(outs[1], y)  # inline merge: same chunk steps, same order


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
    ws = _workspace(hq, d, 4096)
    for cfg in (c for c in ac.CANDIDATE_CONFIGS if c.splits and at.config_fits(c, d, hq // hkv)):
        for length in (1, 63, 64, 65, 255, 256, 257, 1000, 1024, 4095, 4096):
            ln = torch.tensor([length], dtype=torch.int32, device="cuda")
            for window in (None, 1000):
                kw = dict(scale=d ** -0.5, window=window)
                ref = at.decode_attention_reference(q, k, v, length, **kw)
                y = _attend(q, k, v, ln, config=cfg, workspace=ws, **kw)
                assert rel_err(y, ref) < 2e-3, (cfg.name, length, window, rel_err(y, ref))
                assert torch.equal(_attend(q, k, v, ln, config=cfg, workspace=ws, **kw), y)
                fref = _fused_reference(qn, kn, vn, kc, vc, length - 1, cos, sin, **kw)
                y_unf, kc_unf, vc_unf = _unfused(qn, kn, vn, kc, vc, length - 1, cos, sin, config=cfg, **kw)
                for inline_merge in (False, True):
                    kc2, vc2 = kc.clone(), vc.clone()
                    fkw = dict(kw, config=cfg, workspace=ws, inline_merge=inline_merge)
                    yf = _attend_fused(qn, kn, vn, kc2, vc2, ln - 1, cos, sin, **fkw)
                    assert torch.equal(kc2, kc_unf) and torch.equal(vc2, vc_unf)
                    assert rel_err(yf, fref) < 2e-3 and rel_err(yf, y_unf) < 1e-3, (cfg.name, length, window)
                    assert torch.equal(_attend_fused(qn, kn, vn, kc2, vc2, ln - 1, cos, sin, **fkw), yf)
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
        for cfg in ac.CANDIDATE_CONFIGS:
            if at.config_fits(cfg, d, hq // hkv):
                y = at.decode_attention(q, k, v, ln, scale=d ** -0.5, window=window, config=cfg)
                assert rel_err(y, ref) < 2e-3, (cfg.name, window)
                assert torch.equal(at.decode_attention(q, k, v, ln, scale=d ** -0.5, window=window, config=cfg), y)


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
    return at.decode_attention(qr, kc2, vc2, pos + 1, **kw), kc2, vc2


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
    ws = _workspace(q.shape[0], q.shape[1], kc.shape[1], hkv=kc.shape[0], config=kw.get("config"))
    y = _attend_fused(q, k, v, kc, vc, p, cos, sin, workspace=ws, **kw)
    assert not ws.counters.any()
    assert torch.equal(_attend_fused(q, k, v, kc, vc, p, cos, sin, workspace=ws, **kw), y)
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
    for c in ac.CANDIDATE_CONFIGS + (at.AttnConfig(chunk=64, block_n=64, merge_chunks=2),):
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
    monkeypatch.setattr(inline, "MERGE_REGS", 4)  # 4 * 32 * 4 warps / 16 chunks per step = 32 columns of 128
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
    ws = _workspace(8, 64, 150)
    if inline_merge:
        qr = q.clone()
        fu.rope_kv_append(qr, k, v, kc, vc, pos, cos, sin)
        y = _attend(qr, kc, vc, pos + 1, workspace=ws, inline_merge=True, **kw)
    else:
        y = _attend_fused(q, k, v, kc, vc, pos, cos, sin, workspace=ws, inline_merge=False, **kw)
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
    ws = _workspace(4, 64, 16)
    with pytest.raises(ValueError, match="workspace"):
        at.decode_attention_fused(q, k, v, kc, vc, 3, cos, sin, workspace=ws[:2], **kw)
    with pytest.raises(ValueError, match="workspace"):
        at.decode_attention_fused(q, k, v, kc, vc, 3, cos, sin, workspace=ws, **kw)  # 4 fields: the inline one's
    with pytest.raises(ValueError, match="counters"):
        inline.decode_attention_fused_inline(q, k, v, kc, vc, 3, cos, sin,
                                             workspace=ws._replace(counters=ws.counters[:1]), **kw)


# ----------------------------------------------------------------------------- fused, GPU, full size
@requires_cuda
@pytest.mark.parametrize("inline_merge", [False, True])
@pytest.mark.parametrize("model", list(ATTN_HEADS))
@pytest.mark.parametrize("length", [1, 63, 64, 65, 128, 1024, 4095, 4096])
def test_fused_attention_real_heads_gpu(model, length, inline_merge):
    hq, hkv, d = ATTN_HEADS[model]
    gen = torch.Generator().manual_seed(length)
    q, k, v, kc, vc, cos, sin = _fused_inputs(hq, hkv, d, d, 4096, gen)
    pos = length - 1
    kw = dict(scale=d ** -0.5)
    fkw = dict(kw, inline_merge=inline_merge)
    ref = _fused_reference(q, k, v, kc, vc, pos, cos, sin, **kw)
    y_unf, kc_unf, vc_unf = _unfused(q, k, v, kc, vc, pos, cos, sin, **kw)
    p = torch.tensor([pos], dtype=torch.int32, device="cuda")
    ws = _workspace(hq, d, 4096)
    y = _attend_fused(q, k, v, kc, vc, p, cos, sin, workspace=ws, **fkw)
    assert torch.equal(kc, kc_unf) and torch.equal(vc, vc_unf)
    assert rel_err(y, ref) < 2e-3 and rel_err(y, y_unf) < 1e-3
    for _ in range(10):  # bitwise reproducible whichever program arrives last
        assert torch.equal(_attend_fused(q, k, v, kc, vc, p, cos, sin, workspace=ws, **fkw), y)
    assert not ws.counters.any()
    # programmatic dependent launch changes nothing
    assert torch.equal(_attend_fused(q, k, v, kc, vc, p, cos, sin, workspace=ws, kopts=PDL_OFF, **fkw), y)
    if not inline_merge:  # the q rotation in registers has rope_kv_append's FMAs: the unfused path's bits
        assert torch.equal(y, y_unf)


SPLIT_CANDIDATES = [c for c in ac.CANDIDATE_CONFIGS if c.splits]


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
    ws = _workspace(hq, d, 2048)  # the engine's: large enough for the split configs too
    out = torch.empty(hq, d, dtype=torch.float16, device="cuda")
    kw = dict(scale=d ** -0.5, window=window, config=cfg)

    def call():
        _attend_fused(q, k, v, kc, vc, pos, cos, sin, out=out, workspace=ws, inline_merge=inline_merge, **kw)

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
        assert torch.equal(replayed, _attend_fused(q, k, v, kc, vc, p, cos, sin, inline_merge=inline_merge,
                                                               **kw)), p
        ref = _fused_reference(q, k, v, kc, vc, p, cos, sin, scale=d ** -0.5, window=window)  # slot p: roped k
        assert rel_err(replayed, ref) < 2e-3, p
