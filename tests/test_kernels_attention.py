"""Split-KV decode attention vs float64 and vs the same-dtype torch computation."""
from __future__ import annotations

import random

import pytest
import torch

from kernels_conftest import DEVICE, ON_GPU, attention as at, rel_err, requires_cuda
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
        for t_max in (1, 63, 64, 1000, 4096, 32768, 131072):
            cfg = at.choose_config(d, g, t_max)
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
        m, l, o = at.attention_workspace(hq, d, tmax, "cpu")
        bd = max(16, 1 << (d - 1).bit_length())
        chunk = min(at.choose_config(d, g, tmax).chunk for g in range(1, hq + 1) if hq % g == 0)
        nch = -(-tmax // chunk)
        assert m.shape == l.shape == (hq, nch) and o.shape == (hq, nch, bd)
        assert m.dtype == l.dtype == o.dtype == torch.float32
        for hkv in (hkv for hkv in range(1, hq + 1) if hq % hkv == 0):
            need = -(-tmax // at.choose_config(d, hq // hkv, tmax).chunk)
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
