"""The mma GEMV with blocks over two 16-row weight tiles sharing each x piece (``KernelOptions.grouped_gemv_tiles``
= 2, cuda/codebook_gemv_tiles.cuh, cb_gemv_mma_tiles_kernel; tiled codes, 3..256 rows). CPU: the option's checks and
the bench kinds that select it. GPU: random awkward shapes (odd tile counts: a block's second tile past N) against
float64, and every row bitwise equal to today's kernels (tiles = 1) and to its one-row call, at 4 and 8 bits, with
and without residual, and through the gate/up epilogues (SiLU, GELU-tanh; fragment-order output)."""
from __future__ import annotations

import random

import pytest
import torch

from trapetum.errors import ConfigError
from trapetum.settings import GROUPED_GEMV_TILES, KernelOptions

from kernels_conftest import TOL, codebook_gemv as cg, rel_err, requires_cuda

ROWS = (3, 4, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 63, 64)
TILES_N = (1, 3, 16, 17, 48, 53, 97, 257, 1025, 1040)  # tiles 1, 1, 1, 2, 3, 4, 7, 17, 65, 65: odd counts included
ONE = {g: KernelOptions(grouped_gemv_groups=g) for g in (1, 2)}
TWO = {g: KernelOptions(grouped_gemv_groups=g, grouped_gemv_tiles=2) for g in (1, 2)}


def test_grouped_gemv_tiles_option():
    """1 (default: today's kernels) or 2; 2 with 4 groups a block, or any other value, is a ConfigError."""
    assert KernelOptions().grouped_gemv_tiles == 1 and set(GROUPED_GEMV_TILES) == {1, 2}
    for g in (1, 2):
        assert KernelOptions(grouped_gemv_groups=g, grouped_gemv_tiles=2).grouped_gemv_tiles == 2
    for bad in (0, 3, 4, "2"):
        with pytest.raises(ConfigError, match="grouped_gemv_tiles"):
            KernelOptions(grouped_gemv_tiles=bad)
    with pytest.raises(ConfigError, match="grouped_gemv_tiles"):
        KernelOptions(grouped_gemv_groups=4, grouped_gemv_tiles=2)


def test_bench_kinds_select_tiles():
    """bench_kernels --only rows: the -t2 kinds run two tiles a block, the others today's kernels."""
    from trapetum.eval.bench_kernels import ROW_KINDS, _kind_blocks
    k = KernelOptions()
    assert _kind_blocks("cb4-t2", k) == (2, 2) and _kind_blocks("cb4-g1t2", k) == (1, 2)
    assert _kind_blocks("cb4-g2", k) == (2, 1) and _kind_blocks("cb4", k) == (2, 1)
    assert _kind_blocks("cb4-frag", k) == (2, 1) and {"cb4-t2", "gu4-t2", "cb8-t2"} <= set(ROW_KINDS)


def _gpu_weights(n, k, bits, gen):
    codes = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, device="cuda", generator=gen)
    return codes, torch.randn(n, 1 << bits, device="cuda", generator=gen).half()


@requires_cuda
@pytest.mark.parametrize("seed", range(48))
def test_tiles_random_shapes_gpu(seed):
    """Random shapes (N with odd tile counts, K one chunk .. many, M in 3..64 incl. 17, 33, 63): float64
    agreement, every row equal to tiles = 1 (both group counts) and sampled rows to their one-row calls."""
    r = random.Random(seed)
    bits = r.choice([4, 4, 8])
    k = (512 // bits) * r.choice([1, 2, 3, 9, r.randint(1, 90)])
    n = r.choice(TILES_N + (r.randint(1, 3000),))
    m = r.choice(ROWS + (r.randint(3, 64),))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    codes, cb = _gpu_weights(n, k, bits, gen)
    x = torch.randn(m, k, device="cuda", generator=gen).half()
    res = torch.randn(m, n, device="cuda", generator=gen).half() if seed % 2 else None
    kc = cg.tile_codes(codes)
    ref = cg.codebook_gemv_reference(x, codes, cb, bits, res)
    for g in (1, 2):
        y1 = cg.codebook_gemv(x, kc, cb, bits, res, tiled=True, kopts=ONE[g])
        y2 = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
        cg.codebook_gemv(x, kc, cb, bits, res, out=y2, tiled=True, kopts=TWO[g])
        assert rel_err(y2, ref) < TOL[torch.float16], (g, bits, m, k, n)
        assert torch.equal(y2, y1), (g, bits, m, k, n)
    for i in sorted({0, m - 1, r.randrange(m)}):
        one = cg.codebook_gemv(x[i:i + 1], kc, cb, bits, None if res is None else res[i:i + 1], tiled=True)
        assert torch.equal(y2[i:i + 1], one), (i, bits, m, k, n)


@requires_cuda
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("f", [1, 53, 97, 256, 257])
def test_tiles_gate_up_gpu(f, act, bits):
    """Gate/up epilogues (EPI 1, 2) at awkward F (ceil(F / 8) tiles, odd counts included): float64 agreement and
    the bits of tiles = 1 on every row; M <= 16 also with the output in fragment order (the down GEMV's input)."""
    gen = torch.Generator(device="cuda").manual_seed(f + bits)
    k = 3 * (512 // bits)
    gc, gb = _gpu_weights(f, k, bits, gen)
    uc, ub = _gpu_weights(f, k, bits, gen)
    codes, cb, ff = cg.interleave_gate_up(gc, gb, uc, ub)
    kc = cg.tile_codes(codes)
    for m in (3, 8, 9, 16, 17, 33, 63, 64):
        x = torch.randn(m, k, device="cuda", generator=gen).half()
        ref = cg.codebook_gemv_gate_up_reference(x, codes, cb, bits, ff, act)
        for g in (1, 2):
            y1 = cg.codebook_gemv_gate_up(x, kc, cb, bits, ff, act, tiled=True, kopts=ONE[g])
            y2 = cg.codebook_gemv_gate_up(x, kc, cb, bits, ff, act, tiled=True, kopts=TWO[g])
            assert rel_err(y2, ref) < TOL[torch.float16], (f, m, g)
            assert torch.equal(y2, y1), (f, m, g)
        if m <= 16 and ff % (32 * 4) == 0:
            f1 = cg.codebook_gemv_gate_up(x, kc, cb, bits, ff, act, tiled=True, out_frag_bits=4, kopts=ONE[1])
            f2 = cg.codebook_gemv_gate_up(x, kc, cb, bits, ff, act, tiled=True, out_frag_bits=4, kopts=TWO[1])
            assert torch.equal(f2.data, f1.data), (f, m)


REAL = [("plain", 4096, 4096, 4), ("plain", 11008, 4096, 4), ("gate_up", 4096, 11008, 4), ("plain", 4096, 4096, 8)]


@requires_cuda
@pytest.mark.parametrize("gpb", [1, 2], ids=lambda g: f"groups{g}")
@pytest.mark.parametrize("case", REAL, ids=lambda c: "-".join(map(str, c)))
def test_tiles_real_shapes_bitwise_single_rows_gpu(case, gpb):
    """At the 7B shapes: each row of a 3..64-row two-tile call has the bits of its one-row call (with and without
    residual; gate/up SiLU), x handed over in fragment order (M <= 16) changes nothing, and huge values in other
    rows leave rows 0..15 alone."""
    from trapetum.kernels.codebook_layout import Fragments, to_fragments
    kind, k, n, bits = case
    gen = torch.Generator(device="cuda").manual_seed(k + 7 * n + bits)
    rows = 2 * n if kind == "gate_up" else n
    codes, cb = _gpu_weights(rows, k, bits, gen)
    f = None
    if kind == "gate_up":
        codes, cb, f = cg.interleave_gate_up(codes[:n], cb[:n], codes[n:], cb[n:])
    kc = cg.tile_codes(codes)
    mx = 64
    x = torch.randn(mx, k, device="cuda", generator=gen).half()
    res = torch.randn(mx, n, device="cuda", generator=gen).half() if kind == "plain" else None
    ko = TWO[gpb]

    def call(xm, rm, kopts=ko):
        if kind == "plain":
            return cg.codebook_gemv(xm, kc, cb, bits, rm, tiled=True, kopts=kopts)
        return cg.codebook_gemv_gate_up(xm, kc, cb, bits, f, "silu", tiled=True, kopts=kopts)
    for r in ((None, res) if res is not None else (None,)):
        singles = torch.cat([call(x[i:i + 1], None if r is None else r[i:i + 1]) for i in range(mx)])
        for m in ROWS:
            y = call(x[:m], None if r is None else r[:m])
            assert torch.equal(y, singles[:m]), (case, m)
            if m <= 16 and r is None:
                assert torch.equal(call(Fragments(to_fragments(x[:m], bits), bits), None), y), (case, m)
    x2 = x.clone()
    x2[16:] = 6e4 * torch.sign(torch.randn(mx - 16, k, device="cuda", generator=gen)).half()
    assert torch.equal(call(x2, None)[:16], call(x, None)[:16])


@requires_cuda
@pytest.mark.parametrize("m,gpb,bits", [(3, 1, 4), (16, 2, 4), (17, 1, 8), (64, 2, 4), (64, 2, 8)])
def test_tiles_option_runs_the_two_tile_kernel_gpu(m, gpb, bits):
    """grouped_gemv_tiles = 2 launches cb_gemv_mma_tiles_kernel (3..256 rows; the bitwise tests above would also
    pass if the option were ignored), tiles = 1 does not; 1 and 2 rows keep the in-place kernel."""
    from torch.profiler import ProfilerActivity, profile
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("192 KB of shared memory a block: sm_90 (elsewhere tiles = 2 runs today's kernels)")
    gen = torch.Generator(device="cuda").manual_seed(m)
    codes, cb = _gpu_weights(97, 512, bits, gen)
    kc = cg.tile_codes(codes)

    def names(rows, kopts):
        x = torch.randn(rows, 512, device="cuda", generator=gen).half()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            cg.codebook_gemv(x, kc, cb, bits, tiled=True, kopts=kopts)
            torch.cuda.synchronize()
        return " ".join(e.key for e in prof.key_averages())
    assert "cb_gemv_mma_tiles_kernel" in names(m, TWO[gpb])
    assert "cb_gemv_mma_tiles_kernel" not in names(m, ONE[gpb])
    assert "cb_gemv_mma_tiles_kernel" not in names(2, TWO[gpb])
