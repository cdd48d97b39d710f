"""The CUDA sparse GEMV of 4-bit codebooks (kernels/sparse_cuda.py, cuda/sparse_gemv.cu) through
``sparse_gemv.sparse_project``: its warp-major layout (on the CPU), and on CUDA the kernel against float64 over
random shapes and sparsities 0-90 % (N off 256, K odd, 1..16 rows, all-zero x, dense rows, residual and gate/up
epilogues), run to run and row by row bitwise, the codes of dropped inputs unread, K ranges forced, counters left
zero, a CUDA-graph replay, and the engine's VERIFY contract with the kernel (the engine tests of
test_sparse_engine.py run it too: "cuda" is the default kernel where the extension builds). On the CPU the
dispatch and the engine wiring run against a stand-in launcher (the extension faked ready). ``run``, ``check``,
``torch_launch`` and the ``*_for`` bodies take the kernel ("cuda" here, "mma" in test_sparse_mma.py): the two CUDA
kernels keep one contract, tested by the same code."""
import random

import pytest
import torch

from trapetum.kernels import sparse_cuda as sc
from trapetum.kernels import sparse_gemv as sg
from trapetum.kernels import sparse_mma as sm
from trapetum.kernels.codebook_gemv import _act_ref
from trapetum.kernels.codebook_layout import interleave_gate_up
from trapetum.kernels.pack import pack_codes
from trapetum.settings import DEFAULT_KERNELS

CUDA = torch.cuda.is_available() and sc.EXT.ready(torch.device("cuda"), DEFAULT_KERNELS) is not None
need_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA and the sparse GEMV extension")
SIZES = [1, 3, 16, 53, 97, 255, 256, 257, 300, 513]
MODULES = {"cuda": sc, "mma": sm}  # sparse_kernel -> its layout module
LAYOUTS = {"cuda": sc.warp_major_codes, "mma": sm.tile_codes}  # sparse_kernel -> the codes its kernel reads


def test_warp_major_layout_round_trip():
    r = random.Random(0)
    for _ in range(12):
        N, K = r.choice(SIZES + [r.randint(1, 700)]), r.choice(SIZES + [r.randint(1, 400)])
        idx = torch.randint(0, 16, (N, K), generator=torch.Generator().manual_seed(N * 1000 + K))
        codes = pack_codes(idx, 4)
        cw = sc.warp_major_codes(codes, K)
        assert cw.dtype == torch.int32 and tuple(cw.shape) == (-(-N // 256), K, 32)
        n, k = r.randrange(N), r.randrange(K)  # row n = 256 g + 32 i + lane: nibble i of word [g, k, lane]
        word = int(cw[n // 256, k, n % 32]) & 0xFFFFFFFF
        assert (word >> (4 * ((n % 256) // 32))) & 15 == int(idx[n, k])
        assert torch.equal(sc.to_input_major(cw, N), sg.input_major_codes(codes, 4, K))


def falls_back_off_the_gpu(to_layout, name: str) -> None:
    """Without the kernel (the torch backend here) codes in a CUDA layout (``to_layout(codes, K)``) give the
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


def test_warp_major_codes_fall_back_off_the_gpu():
    """Without the kernel (the torch backend here) warp-major codes give the input-major path's bits."""
    falls_back_off_the_gpu(sc.warp_major_codes, "warp-major")


def test_splits_follow_the_shape():
    assert sc.splits(4096, 4096) == 32 and sc.splits(4096, 12288) == 11 and sc.splits(11008, 4096) == 32
    assert sc.splits(4096, 22016) == 6 and sc.splits(100, 4096) == 1 and sc.splits(50000, 300000) == 49
    for K, N in [(4096, 4096), (11008, 4096), (28672, 8192), (50000, 300000)]:
        assert -(-K // sc.splits(K, N)) <= sc.MAX_KS


def case(seed):
    """(x fp16 [M, K], dense bool [M], t, codes, cb, residual or None, act or None, f); t at a random quantile
    of |x| (sparsity 0..0.9), some x all zero."""
    r = random.Random(seed)
    K, M = r.choice(SIZES + [r.randint(1, 3000), 4096]), r.choice([1, 1, 2, 3, 5, 8, 16])
    act = r.choice([None, None, "silu", "gelu_tanh"])
    f = r.choice(SIZES + [r.randint(1, 400)])
    N = r.choice(SIZES + [r.randint(1, 800), 4096])
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


def run(c, ct, rows=None, splits=None, kernel="cuda"):
    x, dense, t, codes, cb, res, act, f = c
    if rows is not None:
        x, dense, res = x[rows], dense[rows], None if res is None else res[rows]
    N = cb.shape[0]
    out = torch.empty(x.shape[0], f if act else N, dtype=torch.float16, device="cuda")
    sg.sparse_project(x.cuda(), ct, cb.cuda(), 4, N, threshold=t, dense_rows=dense.cuda(), out=out,
                      residual=None if res is None else res.cuda(), act=act, f=f, kernel=kernel, splits=splits)
    return out.cpu()


def check(seed, splits=None, rows=True, kernel="cuda"):
    c = case(seed)
    ct = LAYOUTS[kernel](c[3].cuda(), c[0].shape[1])
    y = run(c, ct, splits=splits, kernel=kernel)
    ref = reference(*c)
    err = float((y.double() - ref).norm())
    assert err < 2e-3 * float(ref.norm()) + 2.0 ** -24 * y.numel() ** 0.5, (seed, err, float(ref.norm()))
    assert torch.equal(run(c, ct, splits=splits, kernel=kernel), y), seed  # run to run
    if rows:
        for m in range(y.shape[0]):  # each row its bits alone
            assert torch.equal(run(c, ct, slice(m, m + 1), splits=splits, kernel=kernel)[0], y[m]), (seed, m)


@need_cuda
@pytest.mark.parametrize("chunk", range(4))
def test_cuda_sparse_against_float64(chunk):
    for seed in range(chunk * 60, chunk * 60 + 60):
        check(seed, rows=seed % 3 == 0)
    assert int(sc._COUNTERS[torch.device("cuda", torch.cuda.current_device())].abs().sum()) == 0


@need_cuda
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_cuda_sparse_forced_splits(splits):
    for seed in range(500, 530):
        if -(-case(seed)[0].shape[1] // splits) <= sc.MAX_KS:
            check(seed, splits=splits, rows=seed % 2 == 0)
    assert all(int(c.abs().sum()) == 0 for c in sc._COUNTERS.values())


@need_cuda
def test_cuda_sparse_skips_the_codes_of_dropped_inputs():
    skips_the_codes_of_dropped_inputs_for("cuda")


def skips_the_codes_of_dropped_inputs_for(kernel):
    """The codes of dropped inputs point at a NaN centroid: the kernel never reads them."""
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
    y = run(c, LAYOUTS[kernel](codes.cuda(), K), kernel=kernel)
    assert torch.isfinite(y).all()
    ref = reference(x[1:], dense[1:], t, codes, cb, None, None, 0)
    assert float((y.double() - ref).norm()) < 2e-3 * float(ref.norm())


@need_cuda
def test_cuda_sparse_graph_replay():
    graph_replay_for("cuda")


def graph_replay_for(kernel):
    """Captured in a CUDA graph (no host sync), a replay on new x gives the eager call's bits."""
    c = case(7)
    x, dense, t, codes, cb, res, act, f = c
    K, N, M = x.shape[1], cb.shape[0], x.shape[0]
    ct = LAYOUTS[kernel](codes.cuda(), K)
    xs, ds, cbd = x.cuda(), dense.cuda(), cb.cuda()
    rd = None if res is None else res.cuda()
    out = torch.empty(M, f if act else N, dtype=torch.float16, device="cuda")

    def call():
        sg.sparse_project(xs, ct, cbd, 4, N, threshold=t, dense_rows=ds, out=out, residual=rd, act=act, f=f,
                          kernel=kernel)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    x2 = (torch.randn(M, K, generator=torch.Generator().manual_seed(9)) / K ** 0.5).half()
    xs.copy_(x2.cuda())
    graph.replay()
    got = out.cpu().clone()
    assert torch.equal(got, run((x2, dense, t, codes, cb, res, act, f), ct, kernel=kernel))


@need_cuda
def test_engine_cuda_sparse_kernel_keeps_the_verify_contract():
    """The engine's 4-bit projections hold warp-major codes under the default kernel; VERIFY rows are bitwise
    the decode steps, from position 0 (the dense row inside a pass) and later."""
    from test_sparse_engine import TINY, decode, engine  # the same tiny model and thresholds
    from trapetum.eval.random_model import random_checkpoint
    from trapetum.eval.verify_exact import check as verify_check
    eng = engine(random_checkpoint("llama2-7b", "cb4", device="cuda", overrides=TINY))
    assert all(sc.is_layout(p.ct) for L in eng.model.layers
               for p in (L.attention.qkv, L.attention.o, L.mlp.gate_up.proj, L.mlp.down))
    toks = [7, 11, 23]
    steps = decode(eng, toks, 0)
    assert torch.equal(eng.verify(torch.tensor(toks), 0)[:3], steps)
    res = verify_check(eng, rows=(1, 3, 16), bases=(6,))
    assert all(r["ok"] for r in res), [r for r in res if not r["ok"]]


def torch_launch(seen, kernel="cuda"):
    """A stand-in for ``kernel``'s layout module's launch (same arguments) computing through the input-major torch
    path."""
    mod = MODULES[kernel]

    def launch(x2, ct, codebook, N, out, residual, t, dense_u8, epi, f, kopts, splits_=None):
        seen.append((tuple(x2.shape), t, dense_u8.dtype, epi, f, splits_))
        xs = torch.where((x2.abs() > t) | (dense_u8 != 0)[:, None], x2, torch.zeros((), dtype=x2.dtype))
        y = sg._torch(xs, mod.to_input_major(ct, N), codebook, 4, N)
        if epi:
            y = y.view(y.shape[0], -1, 2, 8)
            y = _act_ref(y[:, :, 0].reshape(y.shape[0], -1)[:, :f], "silu" if epi == 1 else "gelu_tanh") * \
                y[:, :, 1].reshape(y.shape[0], -1)[:, :f]
        elif residual is not None:
            y = y + residual.float()
        return out.copy_(y)
    return launch


def test_dispatch_reaches_the_cuda_launcher(monkeypatch):
    dispatch_reaches_the_launcher_for("cuda", monkeypatch)


def dispatch_reaches_the_launcher_for(kernel, monkeypatch):
    """With the extension reported ready (faked here), sparse_project hands codes in ``kernel``'s layout to its
    module's launch with the select's arguments (t rounded to fp16, dense rows as uint8, the epilogue code, f, the
    splits); the stand-in launcher gives the reference's result."""
    seen = []
    mod = MODULES[kernel]
    monkeypatch.setattr(mod.EXT, "ready", lambda *a, **k: object())
    monkeypatch.setattr(mod, "launch", torch_launch(seen, kernel))
    for seed in (2, 3, 11, 12, 13, 17):
        c = case(seed)
        x, dense, t, codes, cb, res, act, f = c
        N = cb.shape[0]
        out = torch.empty(x.shape[0], f if act else N, dtype=torch.float16)
        sg.sparse_project(x, LAYOUTS[kernel](codes, x.shape[1]), cb, 4, N, threshold=t, dense_rows=dense, out=out,
                          residual=res, act=act, f=f, kernel=kernel, splits=3)
        assert seen[-1] == (tuple(x.shape), sg.threshold_in(t, x.dtype), torch.uint8,
                            {None: 0, "silu": 1, "gelu_tanh": 2}[act], f, 3)
        ref = reference(*c)
        assert float((out.double() - ref).norm()) < 2e-3 * float(ref.norm()) + 2.0 ** -24 * out.numel() ** 0.5, seed
    assert len(seen) == 6


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only: on CUDA the real kernel's engine test runs")
@pytest.mark.usefixtures("torch_fallbacks")
def test_engine_wiring_with_a_stand_in_launcher(monkeypatch):
    engine_wiring_for("cuda", monkeypatch)


def engine_wiring_for(kernel, monkeypatch):
    """The engine under sparse_kernel ``kernel`` with the extension faked ready (CPU): its 4-bit projections get
    codes in that kernel's layout, every site's sparse GEMV reaches the launcher (epilogues 0 and 1 = SiLU), and
    VERIFY rows are bitwise decode steps."""
    from test_sparse_engine import TINY, decode, engine
    from trapetum.eval.random_model import random_checkpoint
    from trapetum.eval.verify_exact import check as verify_check
    seen = []
    mod = MODULES[kernel]
    monkeypatch.setattr(mod, "ready", lambda device, kopts: kopts.sparse_kernel == kernel)
    monkeypatch.setattr(mod.EXT, "ready", lambda *a, **k: object())
    monkeypatch.setattr(mod, "launch", torch_launch(seen, kernel))
    eng = engine(random_checkpoint("llama2-7b", "cb4", device="cpu", overrides=TINY), kernel=kernel)
    assert all(mod.is_layout(p.ct) for L in eng.model.layers
               for p in (L.attention.qkv, L.attention.o, L.mlp.gate_up.proj, L.mlp.down))
    toks = [7, 11, 23]
    steps = decode(eng, toks, 0)
    assert {e[3] for e in seen} == {0, 1} and len(seen) >= 4 * 2 * 3
    assert torch.equal(eng.verify(torch.tensor(toks), 0)[:3], steps)
    res = verify_check(eng, rows=(1, 3), bases=(6,))
    assert all(r["ok"] for r in res), [r for r in res if not r["ok"]]
