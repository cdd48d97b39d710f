"""The tensor-core sparse GEMV of 4-bit codebooks (kernels/sparse_mma.py, cuda/sparse_mma.cu; sparse_kernel "mma",
the default) through ``sparse_gemv.sparse_project``. On the CPU: its tile-major layout against a NumPy reference,
the fallback of that layout, the shape-only splits, the kernel's lane / fragment algebra emulated in float64 (table
words, PRMT offsets, B masks, the mma.m16n8k16 fragment layouts of the PTX ISA), the dispatch to its launcher and
the engine's wiring (a stand-in launcher, the extension faked ready), and the kernel choices. On CUDA (a GPU
present: the extension must build, else the tests fail): the kernel against float64 over 240 random shapes and
sparsities 0-90 % (``case``: N off 128 and 256, K odd, 1..16 rows, all-zero x, dense rows, residual and gate/up
epilogues), run to run and row by row bitwise, K ranges forced, the codes of dropped inputs unread, counters left
zero, a CUDA-graph replay, and the engine's VERIFY contract under sparse_kernel "mma" (the engine tests of
test_sparse_engine.py run it too: "mma" is the default kernel where the extension builds)."""
import random

import numpy as np
import pytest
import torch

from trapetum.kernels import sparse_gemv as sg
from trapetum.kernels import sparse_mma as sm
from trapetum.kernels import sparse_split as ss
from trapetum.kernels.codebook_gemv import _act_ref
from trapetum.kernels.codebook_layout import interleave_gate_up
from trapetum.kernels.pack import pack_codes
from trapetum.settings import DEFAULT_KERNELS

GPU = torch.cuda.is_available()
need_gpu = pytest.mark.skipif(not GPU, reason="needs CUDA")
SIZES = [1, 3, 16, 53, 97, 127, 128, 129, 255, 256, 257, 300, 513]
CASE_SIZES = [1, 3, 16, 53, 97, 255, 256, 257, 300, 513]  # ``case``'s shapes (the 240 GPU cases' seeds assume them)


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
        assert not sm.is_layout(sg.input_major_codes(codes, 4, K))


def falls_back_off_the_gpu(to_layout, name: str) -> None:
    """Without the kernel (the torch backend here) codes in the CUDA layout (``to_layout(codes, K)``) give the
    input-major path's bits, and a layout of the wrong shape is refused naming it."""
    g = torch.Generator().manual_seed(1)
    N, K, M = 300, 77, 3
    codes = pack_codes(torch.randint(0, 16, (N, K), generator=g), 4)
    cb = torch.randn(N, 16, generator=g).half()
    x = torch.randn(M, K, generator=g).half()
    dense = torch.tensor([True, False, False])
    outs = []
    for ct in (sg.input_major_codes(codes, 4, K), to_layout(codes, K)):
        out = torch.empty(M, N, dtype=torch.float16)
        outs.append(sg.sparse_project(x, ct, cb, 4, N, threshold=0.5, dense_rows=dense, out=out, backend="torch"))
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match=name):
        sg.sparse_project(x, to_layout(codes, K)[:, :-1], cb, 4, N, threshold=0.5, dense_rows=dense,
                          out=torch.empty(M, N, dtype=torch.float16), backend="torch")


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


def case(seed):
    """(x fp16 [M, K], dense bool [M], t, codes, cb, residual or None, act or None, f); t at a random quantile
    of |x| (sparsity 0..0.9), some x all zero."""
    r = random.Random(seed)
    K, M = r.choice(CASE_SIZES + [r.randint(1, 3000), 4096]), r.choice([1, 1, 2, 3, 5, 8, 16])
    act = r.choice([None, None, "silu", "gelu_tanh"])
    f = r.choice(CASE_SIZES + [r.randint(1, 400)])
    N = r.choice(CASE_SIZES + [r.randint(1, 800), 4096])
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) / K ** 0.5).to(torch.float16)  # outputs ~1: act(gate) * up stays in fp16
    if r.random() < 0.05:
        x.zero_()
    s = r.choice([0.0, 0.1, 0.25, 0.5, 0.7, 0.9])
    t = float(x.float().abs().flatten().quantile(s)) if s and K > 1 else 0.0
    dense = torch.rand(M, generator=g) < 0.3
    if act is None:
        codes = pack_codes(torch.randint(0, 16, (N, K), generator=g), 4)
        cb = torch.randn(N, 16, generator=g).to(torch.float16)
    else:
        parts = [(pack_codes(torch.randint(0, 16, (f, K), generator=g), 4),
                  torch.randn(f, 16, generator=g).to(torch.float16)) for _ in range(2)]
        codes, cb, _ = interleave_gate_up(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    res = torch.randn(M, cb.shape[0], generator=g).to(torch.float16) if act is None and r.random() < 0.5 else None
    return x, dense, t, codes, cb, res, act, f


def reference(x, dense, t, codes, cb, res, act, f):
    t = sg.threshold_in(t, x.dtype)
    xs = torch.where((x.abs() > t) | dense[:, None], x, torch.zeros((), dtype=x.dtype))
    y = sg.sparse_gemv_reference(xs, codes, cb, 4)
    if act is not None:
        y = y.view(y.shape[0], -1, 2, 8)
        return _act_ref(y[:, :, 0].reshape(y.shape[0], -1)[:, :f], act) * y[:, :, 1].reshape(y.shape[0], -1)[:, :f]
    return y if res is None else y + res.double()


def run(c, ct, rows=None, splits=None):
    """The case ``c`` through sparse_project on CUDA with the tile-major codes ``ct`` (rows: a slice of its rows)."""
    x, dense, t, codes, cb, res, act, f = c
    if rows is not None:
        x, dense, res = x[rows], dense[rows], None if res is None else res[rows]
    N = cb.shape[0]
    out = torch.empty(x.shape[0], f if act else N, dtype=torch.float16, device="cuda")
    sg.sparse_project(x.cuda(), ct, cb.cuda(), 4, N, threshold=t, dense_rows=dense.cuda(), out=out,
                      residual=None if res is None else res.cuda(), act=act, f=f, kernel="mma", splits=splits)
    return out.cpu()


def check(seed, splits=None, rows=True):
    """Case ``seed`` on the kernel against float64, run to run bitwise and (``rows``) each row its bits alone."""
    c = case(seed)
    ct = sm.tile_codes(c[3].cuda(), c[0].shape[1])
    y = run(c, ct, splits=splits)
    ref = reference(*c)
    err = float((y.double() - ref).norm())
    assert err < 2e-3 * float(ref.norm()) + 2.0 ** -24 * y.numel() ** 0.5, (seed, err, float(ref.norm()))
    assert torch.equal(run(c, ct, splits=splits), y), seed  # run to run
    if rows:
        for m in range(y.shape[0]):  # each row its bits alone
            assert torch.equal(run(c, ct, slice(m, m + 1), splits=splits)[0], y[m]), (seed, m)


def torch_launch(seen):
    """A stand-in for sparse_mma.launch (same arguments) computing through the input-major torch path."""

    def launch(x2, ct, codebook, N, out, residual, t, dense_u8, epi, f, kopts, splits_=None):
        seen.append((tuple(x2.shape), t, dense_u8.dtype, epi, f, splits_))
        xs = torch.where((x2.abs() > t) | (dense_u8 != 0)[:, None], x2, torch.zeros((), dtype=x2.dtype))
        y = sg._torch(xs, sm.to_input_major(ct, N), codebook, 4, N)
        if epi:
            y = y.view(y.shape[0], -1, 2, 8)
            y = _act_ref(y[:, :, 0].reshape(y.shape[0], -1)[:, :f], "silu" if epi == 1 else "gelu_tanh") * \
                y[:, :, 1].reshape(y.shape[0], -1)[:, :f]
        elif residual is not None:
            y = y + residual.float()
        return out.copy_(y)
    return launch


def test_dispatch_reaches_the_mma_launcher(monkeypatch):
    """With the extension reported ready (faked here), sparse_project hands tile-major codes to sparse_mma.launch
    with the select's arguments (t rounded to fp16, dense rows as uint8, the epilogue code, f, the splits); the
    stand-in launcher gives the reference's result."""
    seen = []
    monkeypatch.setattr(sm.EXT, "ready", lambda *a, **k: object())
    monkeypatch.setattr(sm, "launch", torch_launch(seen))
    for seed in (2, 3, 11, 12, 13, 17):
        c = case(seed)
        x, dense, t, codes, cb, res, act, f = c
        N = cb.shape[0]
        out = torch.empty(x.shape[0], f if act else N, dtype=torch.float16)
        sg.sparse_project(x, sm.tile_codes(codes, x.shape[1]), cb, 4, N, threshold=t, dense_rows=dense, out=out,
                          residual=res, act=act, f=f, kernel="mma", splits=3)
        assert seen[-1] == (tuple(x.shape), sg.threshold_in(t, x.dtype), torch.uint8,
                            {None: 0, "silu": 1, "gelu_tanh": 2}[act], f, 3)
        ref = reference(*c)
        assert float((out.double() - ref).norm()) < 2e-3 * float(ref.norm()) + 2.0 ** -24 * out.numel() ** 0.5, seed
    assert len(seen) == 6


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
        check(seed, rows=seed % 3 == 0)
    assert int(ss._COUNTERS[torch.device("cuda", torch.cuda.current_device())].abs().sum()) == 0


@need_gpu
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_mma_sparse_forced_splits(splits):
    _built()
    for seed in range(500, 530):
        if -(-case(seed)[0].shape[1] // splits) <= sm.MAX_KS:
            check(seed, splits=splits, rows=seed % 2 == 0)
    assert all(int(c.abs().sum()) == 0 for c in ss._COUNTERS.values())


@need_gpu
def test_mma_sparse_skips_the_codes_of_dropped_inputs():
    """The codes of dropped inputs point at a NaN centroid: the kernel never reads them."""
    _built()
    g = torch.Generator().manual_seed(5)
    N, K = 600, 2000
    x = torch.randn(2, K, generator=g).half()
    t = 0.8
    dense = torch.tensor([True, False])
    idx = torch.randint(0, 15, (N, K), generator=g)
    idx[:, x[1].abs() <= t] = 15
    cb = torch.randn(N, 16, generator=g).half()
    cb_nan = cb.clone()
    cb_nan[:, 15] = float("nan")
    codes = pack_codes(idx, 4)
    c = (x[1:], dense[1:], t, codes, cb_nan, None, None, 0)
    y = run(c, sm.tile_codes(codes.cuda(), K))
    assert torch.isfinite(y).all()
    ref = reference(x[1:], dense[1:], t, codes, cb, None, None, 0)
    assert float((y.double() - ref).norm()) < 2e-3 * float(ref.norm())


@need_gpu
def test_mma_sparse_graph_replay():
    """Captured in a CUDA graph (no host sync), a replay on new x gives the eager call's bits."""
    _built()
    c = case(7)
    x, dense, t, codes, cb, res, act, f = c
    K, N, M = x.shape[1], cb.shape[0], x.shape[0]
    ct = sm.tile_codes(codes.cuda(), K)
    xs, ds, cbd = x.cuda(), dense.cuda(), cb.cuda()
    rd = None if res is None else res.cuda()
    out = torch.empty(M, f if act else N, dtype=torch.float16, device="cuda")

    def call():
        sg.sparse_project(xs, ct, cbd, 4, N, threshold=t, dense_rows=ds, out=out, residual=rd, act=act, f=f,
                          kernel="mma")
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    x2 = (torch.randn(M, K, generator=torch.Generator().manual_seed(9)) / K ** 0.5).half()
    xs.copy_(x2.cuda())
    graph.replay()
    got = out.cpu().clone()
    assert torch.equal(got, run((x2, dense, t, codes, cb, res, act, f), ct))


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
    """The engine under the default sparse_kernel ("mma") with the extension faked ready (CPU): its 4-bit
    projections get tile-major codes, every site's sparse GEMV reaches the launcher (epilogues 0 and 1 = SiLU), and
    VERIFY rows are bitwise decode steps."""
    from test_sparse_engine import TINY, decode, engine
    from trapetum.eval.random_model import random_checkpoint
    from trapetum.eval.verify_exact import check as verify_check
    seen = []
    monkeypatch.setattr(sm, "ready", lambda device, kopts: kopts.sparse_kernel == "mma")
    monkeypatch.setattr(sm.EXT, "ready", lambda *a, **k: object())
    monkeypatch.setattr(sm, "launch", torch_launch(seen))
    eng = engine(random_checkpoint("llama2-7b", "cb4", device="cpu", overrides=TINY), kernel="mma")
    assert all(sm.is_layout(p.ct) for L in eng.model.layers
               for p in (L.attention.qkv, L.attention.o, L.mlp.gate_up.proj, L.mlp.down))
    toks = [7, 11, 23]
    steps = decode(eng, toks, 0)
    assert {e[3] for e in seen} == {0, 1} and len(seen) >= 4 * 2 * 3
    assert torch.equal(eng.verify(torch.tensor(toks), 0)[:3], steps)
    res = verify_check(eng, rows=(1, 3), bases=(6,))
    assert all(r["ok"] for r in res), [r for r in res if not r["ok"]]


def test_mma_is_the_default_and_cuda_is_gone():
    """The tensor-core kernel is the default (it beat the first CUDA sparse kernel, "cuda", in every end-to-end cell:
    BENCHMARKS.md session 17); "cuda" was deleted with that kernel, and a config naming it fails with a ConfigError
    that lists the choices (no silent fallback). Without the extension (the CPU here) "mma" keeps input-major codes
    and runs "compact" where compact_ok, as "cuda" did."""
    from trapetum.errors import ConfigError
    from trapetum.schemes.codebook import CodebookProjection
    from trapetum.settings import SPARSE_KERNELS, KernelOptions, Options
    assert SPARSE_KERNELS == ("mma", "compact", "masked")
    assert DEFAULT_KERNELS.sparse_kernel == "mma" and KernelOptions().sparse_kernel == "mma"
    assert Options().kernels.sparse_kernel == "mma"
    with pytest.raises(ConfigError, match=r"kernels\.sparse_kernel: expected one of mma, compact, masked, got 'cuda'"):
        Options().replace(kernels={"sparse_kernel": "cuda"})
    assert sg.compact_ok(64, 4, "mma") and sg.compact_ok(64, 8, "mma") and not sg.compact_ok(64, 4, "masked")
    assert sg.CUDA_LAYOUTS == (sm,)
    g = torch.Generator().manual_seed(4)
    codes = pack_codes(torch.randint(0, 16, (64, 32), generator=g), 4)
    p = CodebookProjection(codes, torch.randn(64, 16, generator=g), 4, 32, None)
    if sm.EXT.ready(codes.device, DEFAULT_KERNELS) is None:
        assert p.enable_sparse() and torch.equal(p.ct, sg.input_major_codes(codes, 4, 32))


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
    with pytest.raises(SystemExit):  # the deleted kernel: argparse's one-line "invalid choice" listing the choices
        p.parse_args(["--sparse-kernel", "cuda"])
