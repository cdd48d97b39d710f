"""Host (CPU) codebook GEMV (kernels/host_gemv.py, kernels/host/codebook_host.c) against the float64
dequantize-and-multiply reference: 4- and 8-bit, 240 random shapes with awkward sizes, M = 1..16 rows, every code
path the CPU runs (portable C, AVX2, AVX-512), threads 1..4. Bitwise contracts: each row equals its M = 1 result,
every thread count gives the same bits, run to run."""
from __future__ import annotations

import random
import warnings

import pytest
import torch

from trapetum.kernels import host_gemv as hg
from trapetum.kernels.pack import pack_codes, unpack_codes

if not hg.available():
    pytest.skip(f"host kernels unavailable: {hg.error()}", allow_module_level=True)

AWKWARD = (1, 3, 53, 97, 257)
PATHS = hg.PATHS[: hg.PATHS.index(hg.best_path()) + 1]  # every path this CPU runs


def _shapes(n: int, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pick = lambda lo, hi: rng.choice(AWKWARD) if rng.random() < 0.4 else rng.randint(lo, hi)  # noqa: E731
        out.append((rng.choice((4, 8)), rng.randint(1, 16), pick(1, 300), pick(1, 600)))  # bits, M, N, K
    return out


def _case(bits, M, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 1 << bits, (N, K), generator=g)
    cb = torch.randn(N, 1 << bits, generator=g).to(torch.float16)
    x = torch.randn(M, K, generator=g)
    return x, pack_codes(idx, bits), cb


def _rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


SHAPES = _shapes(240)


@pytest.mark.parametrize("chunk", range(8))
def test_matches_float64_reference_batch_and_thread_invariant(chunk):
    for i, (bits, M, N, K) in enumerate(SHAPES[chunk::8]):
        x, codes, cb = _case(bits, M, N, K, seed=chunk * 1000 + i)
        ref = hg.reference(x, codes, cb, bits, K)
        for path in PATHS:
            y = hg.codebook_gemv_host(x, codes, cb, bits, K, threads=1, path=path)
            assert y.shape == (M, N) and y.dtype == torch.float32
            assert _rel(y, ref) < 2e-6, (bits, M, N, K, path, _rel(y, ref))
            for m in range(M):  # batch invariance: row m alone gives the same bits
                assert torch.equal(hg.codebook_gemv_host(x[m:m + 1], codes, cb, bits, K, threads=1, path=path),
                                   y[m:m + 1]), (bits, M, N, K, path, m)
            for t in (2, 3, 4):  # every thread count gives the same bits
                assert torch.equal(hg.codebook_gemv_host(x, codes, cb, bits, K, threads=t, path=path), y), \
                    (bits, M, N, K, path, t)


def test_the_4bit_128_column_blocks_and_their_remainder():
    """K at and around multiples of 128 (the AVX-512 4-bit kernel's blocks of 64 code bytes, then 32-column steps):
    the float64 reference, row m alone, and every thread count, on every path."""
    for i, K in enumerate((127, 128, 129, 160, 255, 256, 384, 575, 576, 640, 896)):
        for M in (1, 2, 5):
            x, codes, cb = _case(4, M, 37, K, seed=500 + 10 * i + M)
            ref = hg.reference(x, codes, cb, 4, K)
            for path in PATHS:
                y = hg.codebook_gemv_host(x, codes, cb, 4, K, threads=1, path=path)
                assert _rel(y, ref) < 2e-6, (K, M, path, _rel(y, ref))
                for m in range(M):
                    assert torch.equal(hg.codebook_gemv_host(x[m:m + 1], codes, cb, 4, K, threads=1, path=path),
                                       y[m:m + 1]), (K, M, path, m)
                assert torch.equal(hg.codebook_gemv_host(x, codes, cb, 4, K, threads=3, path=path), y), (K, M, path)


@pytest.mark.parametrize("bits", (4, 8))
def test_deterministic_run_to_run_on_a_model_sized_matrix(bits):
    x, codes, cb = _case(bits, 16, 1536, 576, seed=bits)
    ref = hg.reference(x, codes, cb, bits, 576)
    for path in PATHS:
        first = hg.codebook_gemv_host(x, codes, cb, bits, threads=2, path=path)
        assert _rel(first, ref) < 2e-6
        for t in (1, 2, 3, 4, 1, 4):
            assert torch.equal(hg.codebook_gemv_host(x, codes, cb, bits, threads=t, path=path), first)


def test_strided_x_and_out_views_and_the_default_thread_count():
    x, codes, cb = _case(4, 5, 97, 53, seed=7)
    wide = torch.zeros(5, 80)
    wide[:, 3:56] = x
    out = torch.full((5, 120), 7.0)
    y = hg.codebook_gemv_host(wide[:, 3:56], codes, cb, 4, 53, out=out[:, 10:107])
    assert torch.equal(y, hg.codebook_gemv_host(x, codes, cb, 4, 53, threads=1))
    assert torch.equal(out[:, :10], torch.full((5, 10), 7.0)) and torch.equal(out[:, 107:], torch.full((5, 13), 7.0))
    # other input dtypes are converted to fp32 first
    assert torch.equal(hg.codebook_gemv_host(x.double(), codes, cb, 4, 53), hg.codebook_gemv_host(x, codes, cb, 4))


def test_codes_rows_with_a_stride_are_read_in_place():
    x, codes, cb = _case(8, 3, 53, 97, seed=3)
    big = torch.zeros(53, 128, dtype=torch.uint8)
    big[:, :97] = codes
    assert torch.equal(hg.codebook_gemv_host(x, big[:, :97], cb, 8, 97), hg.codebook_gemv_host(x, codes, cb, 8, 97))


def test_bad_arguments_are_refused():
    x, codes, cb = _case(4, 2, 8, 10, seed=1)
    with pytest.raises(ValueError, match="not supported"):
        hg.codebook_gemv_host(x, codes, cb, 2)
    with pytest.raises(ValueError, match="codes must be"):
        hg.codebook_gemv_host(x, codes[:, :3], cb, 4)
    with pytest.raises(ValueError, match="codebook must be"):
        hg.codebook_gemv_host(x, codes, cb.float(), 4)
    with pytest.raises(ValueError, match="x must be"):
        hg.codebook_gemv_host(x[:, :9], codes, cb, 4, 10)
    with pytest.raises(ValueError, match="threads"):
        hg.codebook_gemv_host(x, codes, cb, 4, threads=0)
    assert hg.codebook_gemv_host(x[:0], codes, cb, 4).shape == (0, 8)


def test_a_missing_compiler_gives_one_clear_message(monkeypatch):
    monkeypatch.setattr(hg, "_tried", False)
    monkeypatch.setattr(hg, "_lib", None)
    monkeypatch.setattr(hg, "_err", None)
    monkeypatch.setattr(hg, "_compiler", lambda: None)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not hg.available()
        assert not hg.available()  # reported once
    assert len(w) == 1 and "no C compiler" in str(w[0].message)
    assert "gcc" in hg.error()
    with pytest.raises(RuntimeError, match="unavailable"):
        hg.codebook_gemv_host(*_case(4, 1, 2, 2, seed=0)[:1], *_case(4, 1, 2, 2, seed=0)[1:], 4)


def test_the_build_is_cached_per_source(tmp_path, monkeypatch):
    monkeypatch.setattr(hg, "cache_dir", lambda: tmp_path / "host")
    lib = hg._build()
    files = list((tmp_path / "host").glob("codebook_host-*.so"))
    assert len(files) == 1 and lib.tp_path() in range(len(hg.PATHS))
    mtime = files[0].stat().st_mtime_ns
    hg._build()
    assert files[0].stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_host_gemv_object_matches_the_function_and_checks_once():
    x, codes, cb = _case(8, 6, 257, 97, seed=11)
    g = hg.HostGemv(codes, cb, 8, 97)
    for t in (None, 1, 3):
        assert torch.equal(g(x, t), hg.codebook_gemv_host(x, codes, cb, 8, 97, threads=1))
    assert torch.equal(g(x.double()), hg.codebook_gemv_host(x, codes, cb, 8, 97))
    with pytest.raises(ValueError, match="x must be"):
        g(x[:, :5])
    with pytest.raises(ValueError, match="codebook must be"):
        hg.HostGemv(codes, cb[:, :16], 8, 97)


def test_the_pool_under_rapid_and_concurrent_calls():
    """Back-to-back calls of changing sizes and thread counts, and callers on several Python threads at once
    (the pool takes one call at a time): every result is the single-thread one."""
    import threading
    cases = [_case(4 if i % 2 else 8, 1 + i % 3, (17, 400, 1, 129)[i % 4], 64 + i, seed=100 + i) for i in range(8)]
    want = [hg.codebook_gemv_host(x, c, cb, 8 if i % 2 == 0 else 4, threads=1) for i, (x, c, cb) in enumerate(cases)]
    for r in range(300):
        i = r % 8
        x, c, cb = cases[i]
        assert torch.equal(hg.codebook_gemv_host(x, c, cb, 8 if i % 2 == 0 else 4, threads=1 + r % 4), want[i])
    bad = []

    def caller(k):
        for r in range(100):
            i = (r + k) % 8
            x, c, cb = cases[i]
            if not torch.equal(hg.codebook_gemv_host(x, c, cb, 8 if i % 2 == 0 else 4, threads=3), want[i]):
                bad.append((k, r))

    ts = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad


def _child_sum(q):
    x, c, cb = _case(4, 2, 300, 100, seed=9)
    q.put(float(hg.codebook_gemv_host(x, c, cb, 4, threads=3).double().sum()))


def test_a_forked_child_starts_its_own_pool():
    import multiprocessing as mp
    x, c, cb = _case(4, 2, 300, 100, seed=9)
    want = float(hg.codebook_gemv_host(x, c, cb, 4, threads=3).double().sum())  # the parent's pool is running
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_sum, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0 and q.get(timeout=5) == want


@pytest.mark.parametrize("bits", (4, 8))
def test_dequantize_is_exact_and_matmul_matches_the_reference(bits):
    for i, (M, N, K) in enumerate([(17, 53, 97), (40, 257, 1), (64, 3000, 53), (33, 97, 257)]):
        x, codes, cb = _case(bits, M, N, K, seed=50 + i)
        g = hg.HostGemv(codes, cb, bits, K)
        w = torch.gather(cb.float(), 1, unpack_codes(codes, bits, K).long())
        assert torch.equal(g.dequantize(), w)
        assert torch.equal(g.dequantize(5, 9) if N > 9 else g.dequantize(0, 1), w[5:9] if N > 9 else w[:1])
        assert _rel(g.matmul(x, rows=128), hg.reference(x, codes, cb, bits, K)) < 2e-6
    with pytest.raises(ValueError, match="outside"):
        g.dequantize(3, 1000)


def test_limit_path_caps_the_calls_that_name_none():
    """``limit_path`` (bench_cpu --host-path): calls that name no path take the capped path, bit for bit that path's
    results; a cap above the CPU's best leaves its best; None lifts the cap; an unknown name raises."""
    best = hg.best_path()
    try:
        for bits, K in ((4, 257), (8, 97)):
            x, codes, cb = _case(bits, 3, 53, K, seed=7)
            for p in PATHS:
                assert hg.limit_path(p) == p == hg.best_path()
                assert torch.equal(hg.codebook_gemv_host(x, codes, cb, bits, K, threads=2),
                                   hg.codebook_gemv_host(x, codes, cb, bits, K, threads=2, path=p)), (bits, p)
        assert hg.limit_path(hg.PATHS[-1]) == best
        with pytest.raises(ValueError, match="host path"):
            hg.limit_path("sse2")
    finally:
        assert hg.limit_path(None) == best
