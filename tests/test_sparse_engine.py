"""The sparse-input GEMV in the engine (kernels/sparse_gemv.sparse_project, schemes/codebook.py, engine_ops.py):
the fused select + GEMV + epilogue against float64 over random shapes, rows bitwise their one-row calls, and a
4-bit engine with thresholds: the sparse path taken, its logits the select + dense kernel's within rounding, VERIFY
rows bitwise decode steps, passes above ``KernelOptions.sparse_rows`` on the dense kernel. On CUDA the same engine
tests run with CUDA graphs (a host sync would fail the capture)."""
import random

import pytest
import torch

from trapetum.eval.random_model import random_checkpoint
from trapetum.eval.verify_exact import check
from trapetum.kernels import sparse_gemv as sg
from trapetum.kernels import sparse_split
from trapetum.kernels.codebook_gemv import _act_ref
from trapetum.kernels.codebook_layout import interleave_gate_up
from trapetum.kernels.pack import pack_codes
from trapetum.kernels.triton_util import triton_ok
from trapetum.models.sparsity import SiteThresholds, SparsityTable
from trapetum.runtime.engine import GpuEngine
from trapetum.settings import Options

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = triton_ok(torch.device(DEV))
SIZES = [1, 3, 16, 53, 64, 97, 128, 257]


def rel(a, b):
    return float((a.double() - b).norm() / max(float(b.norm()), 1e-30))


def case(seed):
    """(x fp16 [M, K], dense bool [M], t, codes, codebook, bits, residual or None, act or None, f)."""
    r = random.Random(seed)
    K, M, bits = r.choice(SIZES + [r.randint(1, 300)]), r.choice([1, 2, 3, 5]), r.choice([4, 8])
    act = r.choice([None, None, "silu", "gelu_tanh"])
    f = r.choice(SIZES + [r.randint(1, 200)])
    N = r.choice(SIZES + [r.randint(1, 300)])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(torch.float16)
    t = r.choice([0.0, 0.3, 0.7, 1.2])
    dense = torch.rand(M, generator=g) < 0.3
    if act is None:
        idx = torch.randint(0, 1 << bits, (N, K), generator=g)
        codes, cb = pack_codes(idx, bits), torch.randn(N, 1 << bits, generator=g).to(torch.float16)
    else:
        parts = [(pack_codes(torch.randint(0, 1 << bits, (f, K), generator=g), bits),
                  torch.randn(f, 1 << bits, generator=g).to(torch.float16)) for _ in range(2)]
        codes, cb, _ = interleave_gate_up(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    res = torch.randn(M, cb.shape[0], generator=g).to(torch.float16) if act is None and r.random() < 0.5 else None
    return x, dense, t, codes, cb, bits, res, act, f


def reference(x, dense, t, codes, cb, bits, res, act, f):
    xs = torch.where((x.abs() > t) | dense[:, None], x, torch.zeros((), dtype=x.dtype))
    y = sg.sparse_gemv_reference(xs, codes, cb, bits)
    if act is not None:
        y = y.view(y.shape[0], -1, 2, 8)
        return _act_ref(y[:, :, 0].reshape(y.shape[0], -1)[:, :f], act) * y[:, :, 1].reshape(y.shape[0], -1)[:, :f]
    return y if res is None else y + res.double()


def run(c, backend, rows=None, kernel="compact", splits=None):
    x, dense, t, codes, cb, bits, res, act, f = c
    if rows is not None:
        x, dense, res = x[rows], dense[rows], None if res is None else res[rows]
    N = cb.shape[0]
    ct = sg.input_major_codes(codes, bits, x.shape[1])
    out = torch.empty(x.shape[0], f if act else N, dtype=torch.float16, device=DEV)
    sg.sparse_project(x.to(DEV), ct.to(DEV), cb.to(DEV), bits, N, threshold=t, dense_rows=dense.to(DEV), out=out,
                      residual=None if res is None else res.to(DEV), act=act, f=f, backend=backend, kernel=kernel,
                      splits=splits)
    return out.cpu()


def check_case(seed, backend, kernel="compact", splits=None):
    c = case(seed)
    y = run(c, backend, kernel=kernel, splits=splits)
    ref = reference(*c)
    # one fp16 rounding of the output; below fp16's normal range (6.1e-5) a rounding is absolute, at most half a
    # subnormal step (2^-25 per element): the H200 met a 1x1 output of 3.3e-7 (seed 1031), 9% off after that rounding
    err = float((y.double() - ref.double().cpu()).norm())
    assert err < 2e-3 * float(ref.double().norm()) + 2.0 ** -24 * y.numel() ** 0.5, (seed, backend)
    assert torch.equal(run(c, backend, kernel=kernel, splits=splits), y)
    for m in range(y.shape[0]):  # each row its bits alone
        assert torch.equal(run(c, backend, slice(m, m + 1), kernel=kernel, splits=splits)[0], y[m]), (seed, m)


@pytest.mark.parametrize("chunk", range(2))
def test_sparse_project_torch_against_float64(chunk):
    for seed in range(chunk * 60, chunk * 60 + 60):
        check_case(seed, "torch")


@pytest.mark.skipif(not TRITON, reason="Triton cannot run here (no CUDA, no interpreter)")
@pytest.mark.parametrize("kernel,splits", [("compact", None), ("compact", 3), ("masked", None)])
def test_sparse_project_interpreter_against_float64(kernel, splits):
    """(splits: the compacted kernel's K ranges forced, so that the split sums and their counters run on small K.)"""
    # seed 1087: K = 1, whose input-major codes [1, NB] torch may give strides (1, 1) (an int32 view of them failed)
    seeds = range(1000, 1000 + (200 if splits is None else 60)) if DEV == "cuda" else [*range(1000, 1012), 1087]
    assert any(sg.compact_ok(case(s)[4].shape[0], case(s)[5], "compact") for s in seeds)
    for seed in seeds:
        check_case(seed, "triton", kernel, splits)
    assert False not in sg._COMPACT_OK.values()  # the compacted kernel ran, not the masked fallback
    if kernel == "compact" and sparse_split._COUNTERS:
        assert all(int(c.abs().sum()) == 0 for c in sparse_split._COUNTERS.values())  # every counter left at zero


def test_compact_splits_follow_the_shape():
    assert sg.compact_splits(4096, 12288) == 6 and sg.compact_splits(11008, 4096) == 16
    assert sg.compact_splits(200, 4096) == 1 and sg.compact_splits(4096, 22016) == 3


@pytest.mark.skipif(not TRITON, reason="Triton cannot run here (no CUDA, no interpreter)")
def test_compact_kernel_skips_the_codes_of_zero_inputs():
    """The codes of dropped inputs point at a NaN centroid: the compacted kernel never reaches them."""
    g = torch.Generator().manual_seed(5)
    N, K, bits = 128, 200, 4
    x = torch.randn(2, K, generator=g).half()
    t = 0.8
    dense = torch.tensor([True, False])
    dropped = x[1].abs() <= t
    idx = torch.randint(0, 15, (N, K), generator=g)
    idx[:, dropped] = 15
    cb = torch.randn(N, 16, generator=g).half()
    cb_nan = cb.clone()
    cb_nan[:, 15] = float("nan")
    codes = pack_codes(idx, bits)
    c1 = (x[1:], dense[1:], t, codes, cb_nan, bits, None, None, 0)
    y = run(c1, "triton")
    assert torch.isfinite(y).all()
    assert rel(y, reference(x[1:], dense[1:], t, codes, cb, bits, None, None, 0)) < 2e-3


def test_select_is_the_models_rule():
    """The threshold rounds to x's dtype before the compare, as ``x.abs() > t`` of torch does on fp16."""
    x = torch.tensor([[0.1, -0.1001, 0.0999, 2.0]], dtype=torch.float16)
    t = 0.1000001
    want = torch.where(x.abs() > t, x, torch.zeros((), dtype=x.dtype))
    assert sg.threshold_in(t, torch.float16) == float(torch.tensor(t, dtype=torch.float16))
    xs = torch.where(x.abs() > sg.threshold_in(t, torch.float16), x, torch.zeros((), dtype=x.dtype))
    assert torch.equal(xs, want)


def test_bad_arguments():
    c = case(3)
    x, dense, t, codes, cb, bits, res, act, f = c
    ct = sg.input_major_codes(codes, bits, x.shape[1])
    with pytest.raises(ValueError, match="out must be"):
        sg.sparse_project(x, ct, cb, bits, cb.shape[0], threshold=t, dense_rows=dense,
                          out=torch.empty(1, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="dense_rows"):
        sg.sparse_project(x, ct, cb, bits, cb.shape[0], threshold=t, dense_rows=dense[:0],
                          out=torch.empty(x.shape[0], f if act else cb.shape[0], dtype=torch.float16), act=act, f=f)


# -- the engine ---------------------------------------------------------------------------------------------
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, max_position_embeddings=256)


@pytest.fixture(scope="module")
def ckpt():
    return random_checkpoint("llama2-7b", "cb4", device=DEV, overrides=TINY)


def table(n_layers=2):
    # the tiny model's site inputs: normed rows ~1, the o / down inputs ~1e-2 (random 0.02-scale weights)
    return SparsityTable(tuple(SiteThresholds(0.6, 0.004, 0.6, 0.0004) for _ in range(n_layers)))


def engine(ckpt, sparse_rows=16, sparsity=True, kernel="mma"):
    opts = Options().replace(kernels={"sparse_rows": sparse_rows, "sparse_kernel": kernel})
    return GpuEngine(ckpt, 64, device=DEV, options=opts, sparsity=table() if sparsity else None)


def prompt(n=12):
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def decode(eng, toks, base):
    out = []
    for r, tok in enumerate(toks):
        eng.set_position(torch.tensor(tok), base + r)
        eng.step(greedy=False)
        out.append(eng.logits.clone())
    return torch.stack(out)


@pytest.mark.usefixtures("torch_fallbacks")  # tests/conftest.py: the kernels' torch forms on the CPU (speed)
def test_engine_takes_the_sparse_path_and_keeps_the_verify_contract(ckpt, monkeypatch):
    calls = []
    real = sg.sparse_project
    monkeypatch.setattr("trapetum.schemes.codebook.sparse_project",
                        lambda *a, **k: (calls.append(k.get("act")), real(*a, **k))[1])
    eng = engine(ckpt)
    assert all(L.attention.qkv.sparse_ready and L.mlp.gate_up.sparse_ready for L in eng.model.layers)
    eng.prefill(prompt(), all_logits=False)
    toks = torch.tensor(prompt(5)[:5]) % 90 + 3
    steps = decode(eng, toks.tolist(), 12)
    assert len(calls) >= 4 * 2 and "silu" in calls  # q/k/v, o, gate/up, down of both layers, per step
    res = check(eng, rows=(1, 3, 16), bases=(6,))
    assert all(r["ok"] for r in res), [r for r in res if not r["ok"]]
    # the same steps with the select + dense kernel (sparse_rows 0): the same sparse model, other rounding
    ref = engine(ckpt, sparse_rows=0)
    ref.prefill(prompt(), all_logits=False)
    want = decode(ref, toks.tolist(), 12)
    dense = engine(ckpt, sparsity=False)
    dense.prefill(prompt(), all_logits=False)
    d = decode(dense, toks.tolist(), 12)
    err, gap = rel(steps, want.double()), rel(d, want.double())
    assert err < 1e-2 and err < gap / 5, (err, gap)


@pytest.mark.usefixtures("torch_fallbacks")
def test_passes_above_sparse_rows_run_the_dense_kernel(ckpt, monkeypatch):
    calls = []
    real = sg.sparse_project
    monkeypatch.setattr("trapetum.schemes.codebook.sparse_project",
                        lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k))[1])
    eng, ref = engine(ckpt, sparse_rows=2), engine(ckpt, sparse_rows=0)
    for e in (eng, ref):
        e.prefill(prompt(), all_logits=False)
    toks = torch.tensor([5, 9, 17, 33])
    calls.clear()
    assert torch.equal(eng.verify(toks[:3], 12), ref.verify(toks[:3], 12))  # 3 rows > 2: the dense kernel
    assert calls == []
    ver = eng.verify(toks[:2], 12).clone()  # 2 rows: the sparse GEMV, each row its decode step
    assert calls and set(calls) == {2}
    assert torch.equal(ver, decode(eng, toks[:2].tolist(), 12))


@pytest.mark.usefixtures("torch_fallbacks")
def test_set_sparsity_and_the_bench_calibration(ckpt):
    """set_sparsity(None) gives back the dense engine's bits; bench_sparse --e2e's recorder finds every layer's and
    site's quantile thresholds from one prompt pass."""
    from trapetum.eval.bench_sparse import _recorded_thresholds
    from trapetum.models.sparsity import SITES
    dense = engine(ckpt, sparsity=False)
    dense.prefill(prompt(), all_logits=False)
    want = decode(dense, [5, 9, 17], 12)
    eng = engine(ckpt)
    tags = {(4 * i + j + 1) * 1e-30: (i, site) for i in range(2) for j, site in enumerate(SITES)}
    eng.set_sparsity(SparsityTable(tuple(SiteThresholds(*[t for t, (i, _) in tags.items() if i == layer])
                                         for layer in range(2))))
    found = {}
    with _recorded_thresholds([0.25, 0.5], tags, found):  # the PREFILL pass, as bench_sparse runs it
        eng.prefill_pass(torch.as_tensor(prompt(), dtype=torch.long, device=eng.device))
    assert len(found) == 2 * 2 * 4
    assert all(0 < found[(0.25, i, s)] < found[(0.5, i, s)] for i in range(2) for s in SITES)
    eng.set_sparsity(None)
    eng.prefill(prompt(), all_logits=False)
    assert torch.equal(decode(eng, [5, 9, 17], 12), want)


@pytest.mark.skipif(not TRITON, reason="Triton cannot run here (no CUDA, no interpreter)")
def test_engine_interpreter_compact_kernel_keeps_the_verify_contract(ckpt):
    """The engine with the compacted kernel itself (Triton; on the CPU under the interpreter): VERIFY rows bitwise
    decode steps, from position 0 (the dense row inside a pass) and later."""
    eng = engine(ckpt, kernel="compact")
    assert not any(mod.is_layout(L.mlp.down.ct) for mod in sg.CUDA_LAYOUTS for L in eng.model.layers)
    assert all(sg.compact_ok(p.out_features, 4, "compact") for L in eng.model.layers
               for p in (L.attention.qkv, L.attention.o, L.mlp.gate_up.proj, L.mlp.down))
    toks = [7, 11, 23]
    steps = decode(eng, toks, 0)
    assert torch.equal(eng.verify(torch.tensor(toks), 0)[:3], steps)
    res = check(eng, rows=(1, 3), bases=(6,))
    assert all(r["ok"] for r in res), [r for r in res if not r["ok"]]
    assert False not in sg._COMPACT_OK.values()
