"""Attention configs (kernels/attn_configs.py): the static resource rule, the chooser, names, the candidates against
float64, and workspace sizing."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kernels_conftest import DEVICE, attention as at, rel_err
from trapetum.kernels import attn_configs as ac
from trapetum.kernels.experimental import attention_inline as inline
from trapetum.kernels.experimental import attention_seq as seq

HEAD_DIMS = (64, 80, 96, 128, 160, 192, 256)
SMEM_LIMIT = 227 * 1024  # sm_90 (H100/H200) shared memory per block


def _inputs(hq, hkv, d, tmax, gen, amp=1.0):
    q = (torch.randn(hq, d, generator=gen) * amp).half().to(DEVICE)
    k = torch.randn(hkv, tmax, d, generator=gen).half().to(DEVICE)
    v = torch.randn(hkv, tmax, d, generator=gen).half().to(DEVICE)
    return q, k, v


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
        assert ac.smem_estimate(bn, d, st, loop, g) >= kib << 10, (bn, d, st, loop, g)
    assert ac.SMEM_BUDGET <= SMEM_LIMIT


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_chooser_stays_inside_resources(d):
    bd = max(16, 1 << (d - 1).bit_length())
    for g in (1, 2, 3, 4, 7, 8, 16, 64):
        for t_max, hkv in itertools.product((1, 63, 64, 1000, 4096, 32768, 131072), (None, 1, 8, 32, 64)):
            cfg = at.choose_config(d, g, t_max, hkv)
            assert at.config_fits(cfg, d, g), (d, g, t_max, cfg)
            loop = cfg.chunk > cfg.block_n
            assert ac.smem_estimate(cfg.block_n, d, cfg.stages, loop, g) <= ac.SMEM_BUDGET
            if bd > 128:  # 128-position tiles only at BLOCK_D <= 128 (or with 8 warps: no spills)
                assert cfg.block_n <= 64 or cfg.warps >= 8, cfg
            assert cfg.chunk % cfg.block_n == 0
    # the sequential kernel (fixed 64-position steps, 3 stages) too, up to G = 16 (at G = 64 and
    # D = 256 it measured 224 KiB: inside the 227 KiB limit, outside the model's budget)
    for g in (1, 2, 4, 8, 16):
        assert ac.smem_estimate(seq.CHUNK, d, seq.SEQ_STAGES, True, g) <= ac.SMEM_BUDGET


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


@pytest.mark.parametrize("cfg", ac.CANDIDATE_CONFIGS, ids=lambda c: c.name)
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
        y = at.decode_attention(q, k, v, ln, config=cfg, **kw)
        ref = at.decode_attention_reference(q.cpu(), k.cpu(), v.cpu(), length, **kw)
        assert rel_err(y, ref) < 2e-3, (cfg.name, hq, hkv, d, rel_err(y, ref))


def test_workspace_sizing():
    """attention_workspace sizes for the config decode_attention uses; without a group size (the
    engine's call) for the smallest chunk the chooser picks for any group size of Hq heads; `rows` rows of
    Hq heads each; the inline merge's workspace adds zeroed counters."""
    for hq, d, tmax in ((32, 128, 4096), (8, 256, 4096), (9, 64, 1000), (14, 80, 65)):
        m, l, o = at.attention_workspace(hq, d, tmax, "cpu")
        bd = max(16, 1 << (d - 1).bit_length())
        nch = max(ac.n_chunks(at.choose_config(d, g, tmax, hq // g), tmax) for g in range(1, hq + 1) if hq % g == 0)
        assert m.shape == l.shape == (hq, nch) and o.shape == (hq, nch, bd)
        assert m.dtype == l.dtype == o.dtype == torch.float32
        counters = inline.inline_workspace(hq, d, tmax, "cpu").counters
        assert counters.dtype == torch.int32 and counters.shape == (hq,) and not counters.any()
        for hkv in (hkv for hkv in range(1, hq + 1) if hq % hkv == 0):
            need = ac.n_chunks(at.choose_config(d, hq // hkv, tmax, hkv), tmax)
            assert at.attention_workspace(hq, d, tmax, "cpu", hkv=hkv)[0].shape[1] == need <= nch
        cfg = at.AttnConfig(chunk=256, block_n=64, stages=2)
        assert at.attention_workspace(hq, d, tmax, "cpu", config=cfg)[2].shape == (hq, -(-tmax // 256), bd)
        named = next(c for c in ac.CANDIDATE_CONFIGS if c.chunk == 256 and not c.splits)
        assert at.attention_workspace(hq, d, tmax, "cpu", config=named.name)[2].shape == (hq, -(-tmax // 256), bd)
        assert at.attention_workspace(hq, d, tmax, "cpu", rows=16).o.shape == (16 * hq, nch, bd)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="rows"):
            at.attention_workspace(4, 64, 100, "cpu", rows=bad)


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
    at.decode_attention(q, k, v, ln, scale=d ** -0.5, out=out, workspace=ws)
    ref = at.decode_attention_reference(q.cpu(), k.cpu(), v.cpu(), length, scale=d ** -0.5)
    assert rel_err(out, ref) < 2e-3
    small = at.attention_workspace(hq, d, tmax, DEVICE, config=at.AttnConfig(chunk=512, block_n=64))
    with pytest.raises(ValueError, match="workspace"):
        at.decode_attention(q, k, v, ln, scale=d ** -0.5, out=out, workspace=small,
                            config=at.AttnConfig(chunk=64, block_n=64))


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
    assert len({c.name for c in ac.CANDIDATE_CONFIGS}) == len(ac.CANDIDATE_CONFIGS)


def test_split_workspace_sizing(monkeypatch):
    """A split config's workspace holds min(P, ceil(T_max / chunk)) chunks per head; the engine's call (no config,
    no group size) covers a split config returned by the chooser, and a too small workspace raises."""
    cfg = at.AttnConfig(splits=8, chunk=16, block_n=16, stages=2, merge_chunks=64, merge_d=16)
    for tmax, nch in ((1, 1), (40, 3), (128, 8), (4096, 8)):
        ws = at.attention_workspace(4, 64, tmax, "cpu", config=cfg)
        assert ws.m.shape == (4, nch) and ws.o.shape == (4, nch, 64), tmax
    fake = lambda d, g, t_max, hkv=None: cfg if g == 2 else ac.LEGACY_CONFIG  # noqa: E731
    monkeypatch.setattr(at, "choose_config", fake)  # attention_workspace's
    monkeypatch.setattr(ac, "choose_config", fake)  # the launches' (resolve_config)
    assert at.attention_workspace(4, 64, 4096, "cpu").m.shape[1] == 64  # LEGACY (g = 1, 4): 4096 / 64
    assert at.attention_workspace(4, 64, 100, "cpu").m.shape[1] == 7  # the split config (g = 2): 100 / 16
    gen = torch.Generator().manual_seed(2)
    q, k, v = _inputs(4, 2, 64, 100, gen, amp=2.0)
    ws = at.attention_workspace(4, 64, 100, DEVICE)
    ln = torch.tensor([77], dtype=torch.int32, device=DEVICE)
    y = at.decode_attention(q, k, v, ln, scale=0.125, workspace=ws)  # the chooser's split config
    assert rel_err(y, at.decode_attention_reference(q.cpu(), k.cpu(), v.cpu(), 77, scale=0.125)) < 2e-3
    small = at.attention_workspace(4, 64, 100, DEVICE, config=dataclasses.replace(cfg, splits=4))
    with pytest.raises(ValueError, match="workspace"):
        at.decode_attention(q, k, v, ln, scale=0.125, workspace=small, config=cfg)


def test_named_config():
    """A launch takes a candidate by name (the engine passes Options.attn_config) as the same config object; an
    unknown name or one that breaks the rule for the launch's head dim raises ValueError naming the argument; the
    default: 8 length-adaptive splits with >= 32 kv heads (MHA 32x128), fixed 64-position chunks otherwise."""
    split = next(c for c in ac.CANDIDATE_CONFIGS if c.splits == 8 and c.block_n == 64)
    assert at.named_config(split.name) == split
    gen = torch.Generator().manual_seed(3)
    q, k, v = _inputs(4, 2, 64, 100, gen, amp=2.0)
    ln = torch.tensor([90], dtype=torch.int32, device=DEVICE)
    y = at.decode_attention(q, k, v, ln, scale=0.125, config=split.name)
    ref = at.decode_attention_reference(q.cpu(), k.cpu(), v.cpu(), 90, scale=0.125)
    assert rel_err(y, ref) < 2e-3
    assert torch.equal(y, at.decode_attention(q, k, v, ln, scale=0.125, config=split))
    assert torch.equal(at.decode_attention(q, k, v, ln, scale=0.125, config=""),
                       at.decode_attention(q, k, v, ln, scale=0.125))  # '' (Options' default): the chooser
    big = next(c for c in ac.CANDIDATE_CONFIGS if c.splits == 8 and c.block_n == 128)
    assert not at.config_fits(big, 256, 1)
    q256, k256, v256 = _inputs(2, 2, 256, 100, gen)
    with pytest.raises(ValueError, match="config: .* breaks the resource rule"):
        at.decode_attention(q256, k256, v256, 50, scale=0.1, config=big.name)
    assert at.choose_config(128, 1, 4224, 32) == ac.SPLIT8_CONFIG
    assert at.choose_config(128, 4, 4224, 8).splits == 0 and at.choose_config(128, 1, 4224).splits == 0
    with pytest.raises(ValueError, match="attn_config: unknown config 'c7-nonsense'"):
        at.named_config("c7-nonsense")
    with pytest.raises(ValueError, match="unknown config"):
        at.decode_attention(q, k, v, ln, scale=0.125, config="c7-nonsense")
    with pytest.raises(ValueError, match="config"):
        at.decode_attention(q, k, v, ln, scale=0.125, config=3)
