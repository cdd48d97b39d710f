"""Codebook GEMV kernels vs the float64 reference, and the batch-invariance contract (each row of an M-row call has
the bits of the M = 1 call on that row). CPU: the Triton kernel under the interpreter and the torch path, small and
odd shapes; GPU: the mma kernel at the real shapes, the experimental variants."""
from __future__ import annotations

import random
import warnings

import pytest
import torch

from trapetum.kernels import codebook_layout as layout
from trapetum.kernels import cuda_ext
from trapetum.kernels.pack import pack_codes, unpack_codes
from trapetum.settings import KernelOptions

from kernels_conftest import DEVICE, ON_GPU, TOL, codebook_gemv as cg, rel_err, requires_cuda
from shapes import (AWKWARD, BENCH_GEMV_4BIT, MODELS, ROWS, ROWS_GATE_UP_4BIT, ROWS_GEMV_4BIT, ROWS_GEMV_8BIT,
                    ROWS_ODD_CPU, gemv_shapes)

N_RANDOM = 90
KERNELS_OFF = KernelOptions(cuda=False)
VARIANTS = (3, 4, 5, 7)  # experimental variants on canonical codes (11 takes tiled codes)


def _weights(n, k, bits, gen, device=DEVICE):
    kb = -(-k * bits // 8)
    codes = torch.randint(0, 256, (n, kb), dtype=torch.uint8, generator=gen)
    cb = torch.randn(n, 1 << bits, generator=gen).half()
    return codes.to(device), cb.to(device)


def _xv():
    """The experimental variants module if its kernels can run here, else None."""
    if not ON_GPU:
        return None
    from trapetum.kernels.experimental import codebook_gemv_variants as xv
    return xv if xv.available() else None


def _backends(m, k, bits):
    """'triton', plus on the GPU the production mma kernel and the experimental variants 'vN'."""
    if not (ON_GPU and cg.mma_shape_ok(m, k, bits) and cg.mma_available()):
        return ["triton"]
    return ["triton", "mma"] + ([f"v{v}" for v in VARIANTS] if _xv() is not None else [])


def _gemv(be, x, codes, cb, bits, res=None, out=None):
    if be.startswith("v"):
        return _xv().gemv(x, codes, cb, bits, res, variant=int(be[1:]), out=out)
    return cg.codebook_gemv(x, codes, cb, bits, res, out=out, backend=be)


def _gate_up(be, x, codes, cb, bits, f, act):
    if be.startswith("v"):
        return _xv().gemv_gate_up(x, codes, cb, bits, f, act, variant=int(be[1:]))
    return cg.codebook_gemv_gate_up(x, codes, cb, bits, f, act, backend=be)


def _case(seed):
    r = random.Random(seed)
    bits = r.choice([2, 4, 4, 8])
    m = r.choice([1, 1, 1, 2, 3, 5, 8, 9, 16])
    if ON_GPU:
        k = r.choice(AWKWARD + [r.randint(1, 9000), 128 * r.randint(1, 90)])
        n = r.choice(AWKWARD + [r.randint(1, 5000)])
    else:
        k = r.choice(AWKWARD + [r.randint(1, 600)])
        n = r.choice(AWKWARD[:5] + [r.randint(1, 80)])
    return bits, m, k, n, r.random() < 0.3


@pytest.mark.parametrize("seed", range(N_RANDOM))
def test_gemv_random_shapes(seed):
    bits, m, k, n, with_res = _case(seed)
    gen = torch.Generator().manual_seed(seed)
    codes, cb = _weights(n, k, bits, gen)
    x = torch.randn(m, k, generator=gen).half().to(DEVICE)
    res = torch.randn(m, n, generator=gen).half().to(DEVICE) if with_res else None
    ref = cg.codebook_gemv_reference(x, codes, cb, bits, res)  # float64, on the test device
    for be in _backends(m, k, bits):
        y = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEVICE)  # poisoned
        _gemv(be, x, codes, cb, bits, res, out=y)
        err = rel_err(y, ref)
        assert err < TOL[torch.float16], (be, bits, m, k, n, err)


def test_gemv_1d_input_and_default_backend():
    gen = torch.Generator().manual_seed(1)
    codes, cb = _weights(37, 256, 4, gen)
    x = torch.randn(256, generator=gen).half().to(DEVICE)
    y = cg.codebook_gemv(x, codes, cb, 4)
    assert y.shape == (37,)
    assert rel_err(y, cg.codebook_gemv_reference(x.cpu(), codes.cpu(), cb.cpu(), 4)) < TOL[torch.float16]


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("f,k,m,bits", [(13, 64, 1, 4), (24, 256, 3, 4), (8, 128, 16, 8), (53, 97, 2, 2)])
def test_gate_up_fused(act, f, k, m, bits):
    gen = torch.Generator().manual_seed(f * k + m)
    gc, gcb = _weights(f, k, bits, gen)
    uc, ucb = _weights(f, k, bits, gen)
    codes, cb, ff = cg.interleave_gate_up(gc, gcb, uc, ucb)
    x = torch.randn(m, k, generator=gen).half().to(DEVICE)
    g = cg.codebook_gemv_reference(x.cpu(), gc.cpu(), gcb.cpu(), bits)
    u = cg.codebook_gemv_reference(x.cpu(), uc.cpu(), ucb.cpu(), bits)
    ref = cg._act_ref(g, act) * u
    for be in _backends(m, k, bits) + ["torch"]:
        y = _gate_up(be, x, codes, cb, bits, ff, act)
        assert y.shape == (m, f)
        assert rel_err(y, ref) < TOL[torch.float16], be


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    idx = torch.randint(0, 1 << bits, (7, 53))
    codes = pack_codes(idx, bits)
    assert codes.shape == (7, -(-53 * bits // 8))
    assert torch.equal(unpack_codes(codes, bits, 53).long(), idx)


def test_canonical_nibble_order():
    # column 2j in the low nibble, 2j+1 in the high nibble
    codes = torch.tensor([[0x21]], dtype=torch.uint8)
    cb = torch.arange(16, dtype=torch.float16).reshape(1, 16)
    w = cg.dequantize(codes, cb, 4, 2)
    assert w.tolist() == [[1.0, 2.0]]


def test_bad_shapes_raise():
    gen = torch.Generator().manual_seed(0)
    codes, cb = _weights(8, 64, 4, gen)
    x = torch.randn(2, 64).half().to(DEVICE)
    with pytest.raises(ValueError, match="codes"):
        cg.codebook_gemv(torch.randn(2, 66).half().to(DEVICE), codes, cb, 4)
    with pytest.raises(ValueError, match="codebook"):
        cg.codebook_gemv(x, codes, cb[:, :8], 4)
    with pytest.raises(ValueError, match="x"):
        cg.codebook_gemv(x.float(), codes, cb, 4)
    with pytest.raises(ValueError, match="bits"):
        cg.codebook_gemv(x, codes, cb, 3)
    with pytest.raises(ValueError, match="residual"):
        cg.codebook_gemv(x, codes, cb, 4, residual=torch.zeros(2, 9, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="x"):
        cg.codebook_gemv(torch.randn(2, 2, 64).half().to(DEVICE), codes, cb, 4)
    with pytest.raises(ValueError, match="codes"):
        cg.codebook_gemv(x, codes.view(torch.int8), cb, 4)
    with pytest.raises(ValueError, match="out"):
        cg.codebook_gemv(x, codes, cb, 4, out=torch.empty(2, 7, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="backend"):
        cg.codebook_gemv(x, codes, cb, 4, backend="cublas")
    with pytest.raises(ValueError, match="f"):
        c2, cb2, f = cg.interleave_gate_up(codes, cb, codes, cb)
        cg.codebook_gemv_gate_up(x, c2, cb2, 4, 99)
    with pytest.raises(ValueError, match="act"):
        c2, cb2, f = cg.interleave_gate_up(codes, cb, codes, cb)
        cg.codebook_gemv_gate_up(x, c2, cb2, 4, f, act="relu")
    if not ON_GPU:
        with pytest.raises(ValueError, match="backend"):
            cg.codebook_gemv(x, codes, cb, 4, backend="mma")


# ----------------------------------------------------------------------------- batch invariance, CPU
def _rows_equal_singles(call, x, res=None):
    """For M = 1..len(x): each row of call(x[:M], res[:M]) has the bits of call(x[i:i+1], res[i:i+1])."""
    singles = [call(x[i:i + 1], None if res is None else res[i:i + 1])[0] for i in range(x.shape[0])]
    for m in range(1, x.shape[0] + 1):
        y = call(x[:m], None if res is None else res[:m])
        for i in range(m):
            assert torch.equal(y[i], singles[i]), (m, i)
    return singles


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("k,n", ROWS_ODD_CPU)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_rows_bitwise_equal_single_rows(bits, k, n, backend):
    """Fallback backends: M-row calls, M = 1..16, row by row equal to single-row calls (plain and residual)."""
    gen = torch.Generator().manual_seed(bits * 1000 + k + n)
    codes, cb = _weights(n, k, bits, gen)
    x = torch.randn(len(ROWS), k, generator=gen).half().to(DEVICE)
    res = torch.randn(len(ROWS), n, generator=gen).half().to(DEVICE) if (k + bits) % 2 else None
    _rows_equal_singles(lambda xm, rm: cg.codebook_gemv(xm, codes, cb, bits, rm, backend=backend), x, res)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("f,k,bits", [(13, 97, 4), (5, 64, 8), (21, 53, 2)])
def test_gate_up_rows_bitwise_equal_single_rows(f, k, bits, act, backend):
    gen = torch.Generator().manual_seed(f + k + bits)
    gc, gcb = _weights(f, k, bits, gen)
    uc, ucb = _weights(f, k, bits, gen)
    codes, cb, ff = cg.interleave_gate_up(gc, gcb, uc, ucb)
    x = torch.randn(len(ROWS), k, generator=gen).half().to(DEVICE)
    _rows_equal_singles(lambda xm, _: cg.codebook_gemv_gate_up(xm, codes, cb, bits, ff, act, backend=backend), x)


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_triton_rows_ignore_what_other_rows_hold():
    gen = torch.Generator().manual_seed(5)
    codes, cb = _weights(53, 97, 4, gen)
    x = torch.randn(16, 97, generator=gen).half().to(DEVICE)
    y = cg.codebook_gemv(x, codes, cb, 4, backend="triton")
    x2 = x.clone()
    x2[1:] = (6e4 * torch.sign(torch.randn(15, 97, generator=gen))).half().to(DEVICE)  # huge (inf in their outputs)
    assert torch.equal(cg.codebook_gemv(x2, codes, cb, 4, backend="triton")[0], y[0])


def test_triton_gather_and_global_loads_agree():
    """kopts.triton_gather only changes where each centroid is read from: the same bits under the interpreter; compiled,
    the gather's register layout can give the row sums another reduction tree (each form is batch-invariant by
    itself, and a configuration's form is fixed for the process)."""
    gen = torch.Generator().manual_seed(6)
    for bits in (2, 4, 8):
        codes, cb = _weights(37, 130, bits, gen)
        x = torch.randn(3, 130, generator=gen).half().to(DEVICE)
        a = cg.codebook_gemv(x, codes, cb, bits, backend="triton", kopts=KernelOptions(triton_gather=True))
        b = cg.codebook_gemv(x, codes, cb, bits, backend="triton", kopts=KernelOptions(triton_gather=False))
        assert (rel_err(a, b) < 1e-3) if ON_GPU else torch.equal(a, b), bits


class _FailingGather:
    """Stands in for the Triton kernel: raises when launched with USE_GATHER=True."""

    def __init__(self, real):
        self.real = real

    def __getitem__(self, grid):
        def launch(*args, USE_GATHER, **kw):
            if USE_GATHER:
                raise RuntimeError("no tl.gather here")
            return self.real[grid](*args, USE_GATHER=USE_GATHER, **kw)
        return launch


def test_gather_probe_decides_once_per_configuration(monkeypatch):
    """A configuration whose tl.gather form does not compile (some Triton builds assert on some tile shapes) uses
    global loads from its first launch on: one warning, the same bits, no retry; another configuration decides for
    itself."""
    gen = torch.Generator().manual_seed(7)
    codes, cb = _weights(20, 64, 4, gen)
    x = torch.randn(2, 64, generator=gen).half().to(DEVICE)
    want = cg.codebook_gemv(x, codes, cb, 4, backend="triton", kopts=KernelOptions(triton_gather=False))
    monkeypatch.setattr(cg, "_cb_gemv_kernel", _FailingGather(cg._cb_gemv_kernel))
    monkeypatch.setattr(cg, "_GATHER_OK", {})
    with pytest.warns(UserWarning, match="tl.gather"):
        y = cg.codebook_gemv(x, codes, cb, 4, backend="triton")
    assert torch.equal(y, want) and list(cg._GATHER_OK.values()) == [False]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided: no second warning, no second attempt
        assert torch.equal(cg.codebook_gemv(x, codes, cb, 4, backend="triton"), want)
    codes2, cb2 = _weights(20, 64, 2, gen)
    with pytest.warns(UserWarning, match="tl.gather"):  # another configuration: its own decision
        cg.codebook_gemv(x, codes2, cb2, 2, backend="triton")
    assert len(cg._GATHER_OK) == 2


def test_production_extension_has_no_variants():
    assert "variant" not in cuda_ext._DECLS and not any("experimental" in s for s in cuda_ext.SOURCES)
    from trapetum.kernels.experimental import codebook_gemv_variants as xv
    assert xv.EXT.present() and xv.EXT.name != cuda_ext.MAIN.name


# ----------------------------------------------------------------------------- GPU, full size
@requires_cuda
@pytest.mark.parametrize("model", list(MODELS))
def test_gemv_real_shapes_gpu(model):
    gen = torch.Generator().manual_seed(7)
    for k, n in gemv_shapes(model):
        codes, cb = _weights(n, k, 4, gen)
        x16 = torch.randn(16, k, generator=gen).half().cuda()
        ref16 = cg.codebook_gemv_reference(x16, codes, cb, 4)  # float64 on the GPU
        for m in (1, 2, 8, 9, 16):
            for be in _backends(m, k, 4):
                y = _gemv(be, x16[:m], codes, cb, 4)
                assert rel_err(y, ref16[:m]) < TOL[torch.float16], (model, k, n, m, be)


@requires_cuda
def test_gemv_lm_head_8bit_gpu():
    gen = torch.Generator().manual_seed(3)
    codes, cb = _weights(32000, 4096, 8, gen)
    x = torch.randn(1, 4096, generator=gen).half().cuda()
    ref = cg.codebook_gemv_reference(x, codes, cb, 8)
    for be in ("triton", "mma"):
        assert rel_err(cg.codebook_gemv(x, codes, cb, 8, backend=be), ref) < TOL[torch.float16], be


@requires_cuda
@pytest.mark.parametrize("k,n", BENCH_GEMV_4BIT[:3])
def test_gemv_bitwise_reproducible_and_batch_invariant_gpu(k, n):
    gen = torch.Generator().manual_seed(11)
    codes, cb = _weights(n, k, 4, gen)
    x = torch.randn(8, k, generator=gen).half().cuda()
    for be in _backends(8, k, 4):
        y0 = _gemv(be, x, codes, cb, 4)
        for _ in range(20):
            assert torch.equal(_gemv(be, x, codes, cb, 4), y0), be
        assert torch.equal(_gemv(be, x[:1], codes, cb, 4), y0[:1]), be  # row 0 alone: the same bits


@requires_cuda
def test_gemv_cuda_graph_gpu():
    gen = torch.Generator().manual_seed(5)
    codes, cb = _weights(4096, 4096, 4, gen)
    for m in (1, 8, 16):  # the decode path, and the multi-row paths (x copied into fragment order first)
        x = torch.randn(m, 4096, generator=gen).half().cuda()
        res = torch.randn(m, 4096, generator=gen).half().cuda()
        y = torch.empty(m, 4096, dtype=torch.float16, device="cuda")
        cg.codebook_gemv(x, codes, cb, 4, res, out=y)  # warm-up: compile, set attributes
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            cg.codebook_gemv(x, codes, cb, 4, res, out=y)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cg.codebook_gemv(x, codes, cb, 4, res, out=y)
        eager = cg.codebook_gemv(x, codes, cb, 4, res)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager), m


@requires_cuda
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_gemv_pdl_after_a_producer_is_bitwise_the_same_gpu(m):
    """With PDL the GEMV (and, from 3 rows on, the x copy before it) may start while the kernel writing x still
    runs: the results must not change. x is written by a PDL-aware RMSNorm just before, in a graph and eagerly."""
    from trapetum.kernels import fused
    gen = torch.Generator().manual_seed(m)
    codes, cb = _weights(11008, 4096, 4, gen)
    tiled = cg.tile_codes(codes)
    src = torch.randn(m, 4096, generator=gen).half().cuda()
    nw = torch.randn(4096, generator=gen).half().cuda()
    x = torch.empty_like(src)
    y = torch.empty(m, 11008, dtype=torch.float16, device="cuda")

    def step(kopts):
        fused.rmsnorm(src, nw, 1e-5, out=x, kopts=kopts)
        cg.codebook_gemv(x, tiled, cb, 4, out=y, tiled=True, kopts=kopts)
        return y.clone()

    want = step(KernelOptions(pdl="off"))
    on = KernelOptions(pdl="all")
    for _ in range(5):
        assert torch.equal(step(on), want)
    graph = torch.cuda.CUDAGraph()
    step(on)
    with torch.cuda.graph(graph):
        fused.rmsnorm(src, nw, 1e-5, out=x, kopts=on)
        cg.codebook_gemv(x, tiled, cb, 4, out=y, tiled=True, kopts=on)
    for _ in range(5):
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want)


def _row_case(kind, k, n, bits, gen):
    """(codes, codebook, f or None) on the GPU for the invariance tests (random data made on the GPU)."""
    g = torch.Generator(device="cuda").manual_seed(k * 3 + n + bits)
    rows = 2 * n if kind == "gate_up" else n
    codes = torch.randint(0, 256, (rows, k * bits // 8), dtype=torch.uint8, device="cuda", generator=g)
    cb = torch.randn(rows, 1 << bits, device="cuda", generator=g).half()
    if kind == "gate_up":
        codes, cb, f = cg.interleave_gate_up(codes[:n], cb[:n], codes[n:], cb[n:])
        return codes, cb, f
    return codes, cb, None


ROW_CASES = ([("plain", k, n, 4) for k, n in ROWS_GEMV_4BIT] + [("gate_up", k, f, 4) for k, f in ROWS_GATE_UP_4BIT]
             + [("plain", k, n, 8) for k, n in ROWS_GEMV_8BIT] + [("gate_up", 4096, 11008, 8)])


@requires_cuda
@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "canonical"])
@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: "-".join(map(str, c)))
def test_mma_rows_bitwise_equal_single_rows_gpu(case, tiled):
    """The verify contract at the real shapes: for M = 1..16, each row of the M-row call equals the M = 1 call on
    that row (plain with and without residual, gate/up SiLU and GELU), whatever the other rows hold."""
    kind, k, n, bits = case
    gen = torch.Generator().manual_seed(k + n)
    codes, cb, f = _row_case(kind, k, n, bits, gen)
    kc = cg.tile_codes(codes) if tiled else codes
    be = None if tiled else "mma"
    x = torch.randn(len(ROWS), k, generator=gen).half().cuda()
    if kind == "plain":
        res = torch.randn(len(ROWS), n, generator=gen).half().cuda()
        for r in (None, res):
            def calls(xm, rm):
                return cg.codebook_gemv(xm, kc, cb, bits, rm, backend=be, tiled=tiled)
            singles = _rows_equal_singles(calls, x, r)
        acts = [None]
    else:
        acts = ["silu", "gelu_tanh"]
        for act in acts:
            def calls(xm, _, act=act):
                return cg.codebook_gemv_gate_up(xm, kc, cb, bits, f, act, backend=be, tiled=tiled)
            singles = _rows_equal_singles(calls, x)
    x2 = x.clone()
    x2[1:] = 6e4 * torch.sign(torch.randn(len(ROWS) - 1, k, generator=gen)).half().cuda()
    y = calls(x2, None if kind != "plain" else res)
    assert torch.equal(y[0], singles[0])  # huge values in the other rows change nothing in row 0
    if k * n <= 4096 * 32000:  # float64 sanity of the multi-row path
        ref = (cg.codebook_gemv_reference(x, codes, cb, bits, res) if kind == "plain"
               else cg.codebook_gemv_gate_up_reference(x, codes, cb, bits, f, acts[-1]))
        assert rel_err(calls(x, res if kind == "plain" else None), ref) < TOL[torch.float16]


GROUPED_CASES = [("plain", 4096, 4096, 4), ("plain", 11008, 4096, 4), ("gate_up", 4096, 11008, 4),
                 ("plain", 4096, 4096, 8)]


GROUPED_ROWS = (17, 31, 32, 48, 63, 64, 65, 100, 128, 256)  # 2..16 groups of 16, the last one full or shorter


@requires_cuda
@pytest.mark.parametrize("gpb", [4, 2, 1], ids=lambda g: f"groups{g}")
@pytest.mark.parametrize("case", GROUPED_CASES, ids=lambda c: "-".join(map(str, c)))
def test_grouped_rows_bitwise_equal_single_rows_gpu(case, gpb):
    """More than 16 rows on tiled codes (batched decode): one launch over groups of 16 rows, the last one shorter,
    gpb groups a block sharing each dequantized weight (KernelOptions.grouped_gemv_groups); each row of a
    17..256-row call has the bits of its one-row call (with and without residual; gate/up SiLU), and the rows
    agree with float64."""
    kind, k, n, bits = case
    gen = torch.Generator().manual_seed(k + 7 * n + bits)
    codes, cb, f = _row_case(kind, k, n, bits, gen)
    kc = cg.tile_codes(codes)
    mx = max(GROUPED_ROWS)
    x = torch.randn(mx, k, generator=gen).half().cuda()
    res = torch.randn(mx, n, generator=gen).half().cuda() if kind == "plain" else None
    ko = KernelOptions(grouped_gemv_groups=gpb)

    def call(xm, rm):
        if kind == "plain":
            return cg.codebook_gemv(xm, kc, cb, bits, rm, tiled=True, kopts=ko)
        return cg.codebook_gemv_gate_up(xm, kc, cb, bits, f, "silu", tiled=True, kopts=ko)
    for r in ((None, res) if res is not None else (None,)):
        singles = torch.cat([call(x[i:i + 1], None if r is None else r[i:i + 1]) for i in range(mx)])
        for m in GROUPED_ROWS:
            y = call(x[:m], None if r is None else r[:m])
            assert torch.equal(y, singles[:m]), (case, m)
    x2 = x.clone()  # huge values in the rows of the other groups of a block change nothing in rows 0..15
    x2[16:] = 6e4 * torch.sign(torch.randn(mx - 16, k, generator=gen)).half().cuda()
    assert torch.equal(call(x2[:64], None)[:16], call(x[:64], None)[:16])
    ref = (cg.codebook_gemv_reference(x[:65], codes, cb, bits, res[:65]) if kind == "plain"
           else cg.codebook_gemv_gate_up_reference(x[:65], codes, cb, bits, f, "silu"))
    assert rel_err(call(x[:65], res[:65] if res is not None else None), ref) < TOL[torch.float16]


def test_grouped_rows_shape_rule():
    """More than 16 rows run on the mma kernel only with tiled codes (groups of 16 in one launch), up to
    MAX_GROUPED_ROWS; the projections say how many rows one call takes."""
    assert cg.mma_shape_ok(17, 4096, 4, tiled=True) and cg.mma_shape_ok(cg.MAX_GROUPED_ROWS, 4096, 8, tiled=True)
    assert not cg.mma_shape_ok(17, 4096, 4) and not cg.mma_shape_ok(cg.MAX_GROUPED_ROWS + 1, 4096, 4, tiled=True)
    from trapetum.schemes.codebook import CodebookProjection
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (32, 64), dtype=torch.uint8, generator=g)
    p = CodebookProjection(codes, torch.randn(32, 16, generator=g).half(), 4, 128, None, kopts=KernelOptions())
    assert p.rows_per_call == (cg.MAX_GROUPED_ROWS if p.tiled else 16)


@requires_cuda
@pytest.mark.parametrize("bits", [4, 8])
def test_experimental_variants_give_the_production_bits_gpu(bits):
    """Same table, same mma order and reduction: every kept variant gives the production kernel's bits."""
    from trapetum.kernels.experimental import codebook_gemv_variants as xv
    assert xv.available(), xv.EXT.error()
    gen = torch.Generator().manual_seed(bits)
    for k, n in ((4096, 4096), (1024, 1000)):
        codes, cb = _weights(n, k, bits, gen)
        tiled = cg.tile_codes(codes)
        for m in (1, 5, 16):
            x = torch.randn(m, k, generator=gen).half().cuda()
            want = cg.codebook_gemv(x, tiled, cb, bits, tiled=True)
            for v in xv.VARIANTS:
                got = xv.gemv(x, tiled if v == xv.TILED_VARIANT else codes, cb, bits, variant=v)
                assert torch.equal(got, want), (v, k, n, m)


@requires_cuda
@pytest.mark.parametrize("k,n", [(4096, 4096), (1000, 300)])
def test_triton_rows_bitwise_equal_single_rows_gpu(k, n):
    gen = torch.Generator().manual_seed(k + n)
    for bits in (2, 4, 8):
        codes, cb = _weights(n, k, bits, gen)
        x = torch.randn(len(ROWS), k, generator=gen).half().cuda()
        res = torch.randn(len(ROWS), n, generator=gen).half().cuda()
        _rows_equal_singles(lambda xm, rm, c=codes, b=cb, nb=bits: cg.codebook_gemv(xm, c, b, nb, rm, backend="triton"),
                            x, res)


# ----------------------------------------------------------------------------- tiled codes
@pytest.mark.parametrize("n,kb", [(1, 64), (16, 64), (17, 192), (100, 128), (33, 2048)])
def test_tile_codes_layout(n, kb):
    """Lane (g, t) of tile T, chunk c, half h reads 512 contiguous bytes per warp: rows 16T+g+8h, bytes 64c+16t."""
    gen = torch.Generator().manual_seed(n + kb)
    codes = torch.randint(0, 256, (n, kb), dtype=torch.uint8, generator=gen)
    t = layout.tile_codes(codes)
    assert t.shape == (-(-n // 16) * 16, kb) and torch.equal(layout.untile_codes(t, n), codes)
    assert cg.tile_codes is layout.tile_codes  # re-exported for the engine
    flat, r = t.reshape(-1), random.Random(n)
    for _ in range(50):
        T, c, h, g, tt = r.randrange(t.shape[0] // 16), r.randrange(kb // 64), r.randrange(2), r.randrange(8), r.randrange(4)
        off = (T * (kb // 64) + c) * 1024 + h * 512 + (g * 4 + tt) * 16
        row = 16 * T + g + 8 * h
        want = codes[row, 64 * c + 16 * tt: 64 * c + 16 * tt + 16] if row < n else torch.zeros(16, dtype=torch.uint8)
        assert torch.equal(flat[off: off + 16], want)
    with pytest.raises(ValueError, match="multiple of 64"):
        layout.tile_codes(codes[:, :32])
    with pytest.raises(ValueError, match="tiled"):
        layout.untile_codes(t[:, :32], n)


def test_tiled_call_checks():
    gen = torch.Generator().manual_seed(2)
    codes, cb = _weights(20, 128, 4, gen, device="cpu")
    x = torch.randn(128, generator=gen).half()
    with pytest.raises(ValueError, match="tiled codes need 32 rows"):
        cg.codebook_gemv(x, codes, cb, 4, tiled=True)
    with pytest.raises(ValueError, match="mma"):
        cg.codebook_gemv(x, cg.tile_codes(codes), cb, 4, tiled=True, backend="triton")


def test_tiled_codes_fall_back_without_the_kernel():
    """Kernel options with cuda off (or no CUDA kernel): tiled codes are untiled for the fallback path."""
    gen = torch.Generator().manual_seed(4)
    codes, cb = _weights(40, 256, 4, gen)
    x = torch.randn(2, 256, generator=gen).half().to(DEVICE)
    y = cg.codebook_gemv(x, cg.tile_codes(codes), cb, 4, tiled=True, kopts=KERNELS_OFF)
    assert rel_err(y, cg.codebook_gemv_reference(x, codes, cb, 4)) < TOL[torch.float16]
    assert torch.equal(y, cg.codebook_gemv(x, codes, cb, 4, kopts=KERNELS_OFF))
    gc, gb = _weights(24, 256, 4, gen)
    uc, ub = _weights(24, 256, 4, gen)
    ic, ib, f = cg.interleave_gate_up(gc, gb, uc, ub)
    y = cg.codebook_gemv_gate_up(x, cg.tile_codes(ic), ib, 4, f, "silu", tiled=True, kopts=KERNELS_OFF)
    assert rel_err(y, cg.codebook_gemv_gate_up_reference(x, ic, ib, 4, f, "silu")) < TOL[torch.float16]


@requires_cuda
@pytest.mark.parametrize("seed", range(60))
def test_tiled_gemv_random_gpu(seed):
    """Tiled codes: float64 agreement and the same bits as the kernel on canonical codes."""
    r = random.Random(seed)
    bits = r.choice([4, 4, 8])
    k = (512 // bits) * r.randint(1, 60)
    n = r.choice(AWKWARD + [r.randint(1, 5000)])
    m = r.choice([1, 1, 2, 5, 8, 9, 16])
    gen = torch.Generator().manual_seed(seed)
    codes, cb = _weights(n, k, bits, gen)
    x = torch.randn(m, k, generator=gen).half().cuda()
    res = torch.randn(m, n, generator=gen).half().cuda() if r.random() < 0.4 else None
    tiled = cg.tile_codes(codes)
    y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    cg.codebook_gemv(x, tiled, cb, bits, res, out=y, tiled=True)
    assert rel_err(y, cg.codebook_gemv_reference(x, codes, cb, bits, res)) < TOL[torch.float16], (bits, m, k, n)
    assert torch.equal(y, cg.codebook_gemv(x, codes, cb, bits, res, backend="mma"))
    for _ in range(5):
        assert torch.equal(cg.codebook_gemv(x, tiled, cb, bits, res, tiled=True), y)


@requires_cuda
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_tiled_gate_up_gpu(act):
    gen = torch.Generator().manual_seed(9)
    gc, gb = _weights(11008, 4096, 4, gen)
    uc, ub = _weights(11008, 4096, 4, gen)
    codes, cb, f = cg.interleave_gate_up(gc, gb, uc, ub)
    x = torch.randn(1, 4096, generator=gen).half().cuda()
    y = cg.codebook_gemv_gate_up(x, cg.tile_codes(codes), cb, 4, f, act, tiled=True)
    assert torch.equal(y, cg.codebook_gemv_gate_up(x, codes, cb, 4, f, act, backend="mma"))
    ref = cg.codebook_gemv_gate_up_reference(x, codes, cb, 4, f, act)
    assert rel_err(y, ref) < TOL[torch.float16]
