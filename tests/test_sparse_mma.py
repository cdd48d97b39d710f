"""The tensor-core sparse GEMV of 4-bit codebooks (kernels/sparse_mma.py, cuda/sparse_mma.cu; sparse_kernel "mma")
through ``sparse_gemv.sparse_project``. On the CPU: its tile-major layout against a NumPy reference, the fallback
of that layout, the shape-only splits, the kernel's lane / fragment algebra emulated in float64 (table words, PRMT
offsets, B masks, the mma.m16n8k16 fragment layouts of the PTX ISA), and the dispatch to its launcher. On CUDA
(a GPU present: the extension must build, else the tests fail): the kernel against float64 over 240 random
shapes and sparsities 0-90 % (test_sparse_cuda's cases: N off 128, K odd, 1..16 rows, all-zero x, dense rows,
residual and gate/up epilogues), run to run and row by row bitwise, K ranges forced, the codes of dropped inputs
unread, counters left zero, a CUDA-graph replay, and the engine's VERIFY contract under sparse_kernel "mma"."""
import random

import numpy as np
import pytest
import torch

from test_sparse_cuda import (case, check, dispatch_reaches_the_launcher_for, engine_wiring_for, falls_back_off_the_gpu,
                              graph_replay_for, skips_the_codes_of_dropped_inputs_for)
from trapetum.kernels import sparse_cuda as sc
from trapetum.kernels import sparse_gemv as sg
from trapetum.kernels import sparse_mma as sm
from trapetum.kernels.pack import pack_codes
from trapetum.settings import DEFAULT_KERNELS

GPU = torch.cuda.is_available()
need_gpu = pytest.mark.skipif(not GPU, reason="needs CUDA")
SIZES = [1, 3, 16, 53, 97, 127, 128, 129, 255, 256, 257, 300, 513]


def numpy_tile_codes(idx: np.ndarray) -> np.ndarray:
    """The layout by its definition, element by element: ct[tt, k, b] = idx[128 tt + 2b, k] | idx[.. + 1, k] << 4."""
    N, K = idx.shape
    T = -(-N // 128)
    ct = np.zeros((T, K, 64), dtype=np.uint8)
    for n in range(N):
        ct[n // 128, :, (n % 128) // 2] |= (idx[n] << (4 * (n % 2))).astype(np.uint8)
    return ct


def test_tile_major_layout_against_numpy():
    r = random.Random(0)
    for _ in range(16):
        N, K = r.choice(SIZES + [r.randint(1, 700)]), r.choice(SIZES + [r.randint(1, 300)])
        idx = torch.randint(0, 16, (N, K), generator=torch.Generator().manual_seed(N * 1000 + K))
        codes = pack_codes(idx, 4)
        ct = sm.tile_codes(codes, K)
        assert ct.dtype == torch.uint8 and tuple(ct.shape) == (-(-N // 128), K, 64) and sm.is_layout(ct)
        assert np.array_equal(ct.numpy(), numpy_tile_codes(idx.numpy())), (N, K)
        assert torch.equal(sm.to_input_major(ct, N), sg.input_major_codes(codes, 4, K))
        assert not sc.is_layout(ct) and not sm.is_layout(sg.input_major_codes(codes, 4, K))


def test_tile_major_codes_fall_back_off_the_gpu():
    """Without the kernel (the torch backend here) tile-major codes give the input-major path's bits."""
    falls_back_off_the_gpu(sm.tile_codes, "tile-major")


def test_splits_follow_the_shape():
    assert sm.splits(4096, 4096) == 12 and sm.splits(4096, 11008) == 4 and sm.splits(4096, 12288) == 4
    assert sm.splits(11008, 4096) == 12 and sm.splits(4096, 22016) == 2 and sm.splits(100, 4096) == 1
    for K, N in [(4096, 4096), (11008, 4096), (28672, 8192), (50000, 300000), (1, 1)]:
        assert -(-K // sm.splits(K, N)) <= sm.MAX_KS


def test_fragment_algebra_emulated():
    """The kernel's step 3 in float64, lane by lane as the .cu comment has it: table word e * 64 + 32 h + l =
    (cb[4l + 2h][e & 15], cb[4l + 2h + 1][e >> 4]); lane l = 4g + c loads halfword 2l of each kept input's piece,
    A registers from bytes 0 / 1 (+ 128: h = 1); B = (x, x) & mask (c == g >> 1: low half for even g, high for
    odd); D = A B with the PTX fragment layouts; lane l's accumulators are rows 4l .. 4l + 3."""
    g_ = torch.Generator().manual_seed(3)
    K = 9  # odd: the last entry alone (in1 zero)
    idx = torch.randint(0, 16, (128, K), generator=g_)
    cb = torch.randn(128, 16, generator=g_, dtype=torch.float64)
    x = torch.randn(K, generator=g_, dtype=torch.float64)
    ct = sm.tile_codes(pack_codes(idx, 4), K)[0]
    tab = torch.zeros(256 * 64, 2, dtype=torch.float64)
    for e in range(256):
        for col in range(64):
            r0 = 4 * (col & 31) + 2 * (col >> 5)
            tab[e * 64 + col] = torch.stack([cb[r0, e & 15], cb[r0 + 1, e >> 4]])
    acc = torch.zeros(32, 4, dtype=torch.float64)
    for p in range((K + 1) // 2):
        k0, k1 = 2 * p, 2 * p + 1
        A = torch.zeros(16, 16, dtype=torch.float64)
        B = torch.zeros(16, 8, dtype=torch.float64)
        for lane in range(32):
            g, c = lane >> 2, lane & 3
            w0 = ct[k0, 2 * lane: 2 * lane + 2].long()
            A[g, 2 * c: 2 * c + 2] = tab[w0[0] * 64 + lane]
            A[g + 8, 2 * c: 2 * c + 2] = tab[w0[1] * 64 + 32 + lane]
            if k1 < K:
                w1 = ct[k1, 2 * lane: 2 * lane + 2].long()
                A[g, 2 * c + 8: 2 * c + 10] = tab[w1[0] * 64 + lane]
                A[g + 8, 2 * c + 8: 2 * c + 10] = tab[w1[1] * 64 + 32 + lane]
            mask = torch.tensor([g % 2 == 0, g % 2 == 1], dtype=torch.float64) * (c == g >> 1)
            B[2 * c: 2 * c + 2, g] = x[k0] * mask
            B[2 * c + 8: 2 * c + 10, g] = (x[k1] if k1 < K else 0.0) * mask
        D = A @ B
        for lane in range(32):
            g, c = lane >> 2, lane & 3
            acc[lane] += torch.stack([D[g, 2 * c], D[g, 2 * c + 1], D[g + 8, 2 * c], D[g + 8, 2 * c + 1]])
    ref = torch.gather(cb, 1, idx.long()) @ x
    assert torch.allclose(acc.reshape(-1), ref, rtol=0, atol=1e-12)


def test_dispatch_reaches_the_mma_launcher(monkeypatch):
    dispatch_reaches_the_launcher_for("mma", monkeypatch)


def _built():
    ext = sm.EXT.ready(torch.device("cuda"), DEFAULT_KERNELS)
    assert ext is not None, f"the sparse_mma extension did not build: {sm.EXT.error()}"


@need_gpu
def test_mma_extension_builds():
    _built()


@need_gpu
@pytest.mark.parametrize("chunk", range(4))
def test_mma_sparse_against_float64(chunk):
    _built()
    for seed in range(chunk * 60, chunk * 60 + 60):
        check(seed, rows=seed % 3 == 0, kernel="mma")
    assert int(sc._COUNTERS[torch.device("cuda", torch.cuda.current_device())].abs().sum()) == 0


@need_gpu
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_mma_sparse_forced_splits(splits):
    _built()
    for seed in range(500, 530):
        if -(-case(seed)[0].shape[1] // splits) <= sm.MAX_KS:
            check(seed, splits=splits, rows=seed % 2 == 0, kernel="mma")
    assert all(int(c.abs().sum()) == 0 for c in sc._COUNTERS.values())


@need_gpu
def test_mma_sparse_skips_the_codes_of_dropped_inputs():
    _built()
    skips_the_codes_of_dropped_inputs_for("mma")


@need_gpu
def test_mma_sparse_graph_replay():
    _built()
    graph_replay_for("mma")


@need_gpu
def test_engine_mma_sparse_kernel_keeps_the_verify_contract():
    """Under sparse_kernel "mma" the engine's 4-bit projections hold tile-major codes; VERIFY rows are bitwise
    the decode steps."""
    _built()
    from test_sparse_engine import TINY, decode, engine
    from trapetum.eval.random_model import random_checkpoint
    from trapetum.eval.verify_exact import check as verify_check
    eng = engine(random_checkpoint("llama2-7b", "cb4", device="cuda", overrides=TINY), kernel="mma")
    assert all(sm.is_layout(p.ct) for L in eng.model.layers
               for p in (L.attention.qkv, L.attention.o, L.mlp.gate_up.proj, L.mlp.down))
    toks = [7, 11, 23]
    steps = decode(eng, toks, 0)
    assert torch.equal(eng.verify(torch.tensor(toks), 0)[:3], steps)
    res = verify_check(eng, rows=(1, 3, 16), bases=(6,))
    assert all(r["ok"] for r in res), [r for r in res if not r["ok"]]


@pytest.mark.skipif(GPU, reason="CPU only: on CUDA the real kernel's engine test runs")
@pytest.mark.usefixtures("torch_fallbacks")
def test_engine_wiring_with_a_stand_in_launcher(monkeypatch):
    engine_wiring_for("mma", monkeypatch)


def test_mma_cluster_option_removed():
    """sparse_kernel "mma-cluster" (session 15, 1.6-1.7x slower than "mma" on the H200) is gone: a config naming it
    fails loudly instead of falling back to another kernel."""
    from trapetum.errors import ConfigError
    from trapetum.settings import Options
    with pytest.raises(ConfigError, match="sparse_kernel"):
        Options().replace(kernels={"sparse_kernel": "mma-cluster"})


def test_cli_flag_reaches_the_options():
    """``generate`` / ``chat --sparse-kernel mma`` -> Options.kernels.sparse_kernel; with --aqlm-kernel both hold."""
    import argparse

    from trapetum.commands._common import add_kernel_options, options_of
    p = argparse.ArgumentParser()
    add_kernel_options(p)
    assert options_of(p.parse_args([])) is None
    assert options_of(p.parse_args(["--sparse-kernel", "mma"])).kernels.sparse_kernel == "mma"
    both = options_of(p.parse_args(["--sparse-kernel", "mma", "--aqlm-kernel", "mma"])).kernels
    assert both.sparse_kernel == "mma" and both.aqlm_kernel == "mma"
    with pytest.raises(SystemExit):
        p.parse_args(["--sparse-kernel", "mma-cluster"])
