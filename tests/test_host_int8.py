"""The int8 numerics of the host GEMV (Options.host_numerics "int8"; kernels/host/codebook_host_q8.c,
host_gemv.Int8Tables for 4-bit codes, Int8Weights, the dense form, for 8-bit ones): against the float64 reference of the same quantized formulation over 240 random shapes
(awkward sizes, M = 1..16), within the activation and codebook quantization's bound of the fp32 reference, every
code path the CPU runs bitwise the portable C (AVX-512 with and without VNNI too), batch invariant, the same bits
for every thread count and run to run; the fused GEMVs and the CPU step in this mode; the default unchanged."""
from __future__ import annotations

import random

import pytest
import torch

import trapetum
from tiny_models import build_cbk
from trapetum.kernels import host_gemv as hg
from trapetum.kernels import host_ops as ho
from trapetum.kernels.pack import pack_codes, unpack_codes
from trapetum.settings import Options

if not hg.available():
    pytest.skip(f"host kernels unavailable: {hg.error()}", allow_module_level=True)

PATHS = hg.PATHS[: hg.PATHS.index(hg.best_path()) + 1]  # every path this CPU runs
AWKWARD_K = (1, 3, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 257, 576, 1025)
AWKWARD_N = (1, 3, 53, 97, 257)


def _shapes(n: int, seed: int = 7):
    rng = random.Random(seed)
    return [(rng.randint(1, 16), rng.choice(AWKWARD_N) if rng.random() < 0.4 else rng.randint(1, 300),
             rng.choice(AWKWARD_K) if rng.random() < 0.5 else rng.randint(1, 1100)) for _ in range(n)]


def _case(M, N, K, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 16, (N, K), generator=g)
    cb = (torch.randn(N, 16, generator=g) * scale).to(torch.float16)
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g))
    if K > 40:  # an outlier column and an all-zero block
        x[:, K // 3] *= 30
        x[:, :min(32, K // 2)] = 0
    return x, pack_codes(idx, 4), cb


def _gemv(x, codes, t8, K, path, threads=1):
    return hg.codebook_gemv_host(x, codes, t8, 4, K, threads=threads, path=path)


def _abs_reference(x, codes, t8, K):
    """float64 s[n] * sum_k |d xq| |q|: the scale of the fp32 rounding error."""
    xq, d = hg.quantize_x(x)
    w = torch.gather(t8.q.double().abs(), 1, unpack_codes(codes, 4, K).long())
    xd = (xq.double() * d.double().repeat_interleave(32, 1)[:, :K]).abs()
    return (xd @ w.T) * t8.scale.double().abs().unsqueeze(0)


SHAPES = _shapes(240)


@pytest.mark.parametrize("chunk", range(8))
def test_int8_matches_its_float64_reference_on_every_path_bitwise(chunk):
    lib = hg.library()
    for i, (M, N, K) in enumerate(SHAPES[chunk::8]):
        x, codes, cb = _case(M, N, K, seed=chunk * 1000 + i)
        t8 = hg.int8_tables(cb, 4)
        ref = hg.reference_int8(x, codes, t8, K)
        tol = (K / 256 + 8) * 1.2e-7 * _abs_reference(x, codes, t8, K) + 1e-30
        y = _gemv(x, codes, t8, K, "c")
        assert y.shape == (M, N) and y.dtype == torch.float32
        assert bool(((y.double() - ref).abs() <= tol).all()), (M, N, K, float((y.double() - ref).abs().max()))
        for path in PATHS[1:]:  # the integers are exact: every path gives the portable C's bits
            assert torch.equal(_gemv(x, codes, t8, K, path), y), (M, N, K, path)
        if PATHS[-1] in ("avx512", "avx512vbmi", "avx512fp16"):
            lib.tp_q8_no_vnni(1)  # the AVX-512 form without VNNI, on a machine that has it
            try:
                assert torch.equal(_gemv(x, codes, t8, K, PATHS[-1]), y), (M, N, K, "no vnni")
            finally:
                lib.tp_q8_no_vnni(0)
        best = PATHS[-1]
        yb = _gemv(x, codes, t8, K, best)
        for m in range(M):  # batch invariance
            assert torch.equal(_gemv(x[m:m + 1], codes, t8, K, best), yb[m:m + 1]), (M, N, K, m)
        for t in (2, 3):  # every thread count, the same bits
            assert torch.equal(_gemv(x, codes, t8, K, best, threads=t), yb), (M, N, K, t)
        assert torch.equal(_gemv(x, codes, t8, K, best), yb)  # run to run


def test_int8_within_the_quantization_bound_of_the_fp32_reference():
    """|y_int8 - y| <= sum_k |x| |c - s q| + |s q| |x - d xq| (both roundings' worst case) plus fp32 slack."""
    for i, (M, N, K) in enumerate(SHAPES[:60]):
        x, codes, cb = _case(M, N, K, seed=5000 + i)
        t8 = hg.int8_tables(cb, 4)
        y = _gemv(x, codes, t8, K, PATHS[-1])
        ref = hg.reference(x, codes, cb, 4, K)  # the fp32 numerics' float64 reference
        idx = unpack_codes(codes, 4, K).long()
        c = torch.gather(cb.double(), 1, idx)
        w8 = torch.gather(t8.q.double() * t8.scale.double().unsqueeze(1), 1, idx)
        xq, d = hg.quantize_x(x)
        xd = xq.double() * d.double().repeat_interleave(32, 1)[:, :K]
        bound = x.double().abs() @ (c - w8).abs().T + (x.double() - xd).abs() @ w8.abs().T
        slack = 1e-5 * (x.double().abs() @ c.abs().T) + 1e-30
        assert bool(((y.double() - ref).abs() <= bound + slack).all()), (M, N, K)
        assert float((w8 - c).abs().max()) <= float(t8.scale.max()) / 2 * (1 + 1e-6)


def test_quantize_x_is_the_c_prepare_and_the_tables_are_as_defined():
    for i, (M, N, K) in enumerate(SHAPES[:40]):
        x, codes, cb = _case(M, N, K, seed=9000 + i)
        xq, d = hg.quantize_x(x)
        assert int(xq.abs().max()) <= 127
        h = hg.HostGemv(codes, hg.int8_tables(cb, 4), 4, K)
        want = xq.float() * d.repeat_interleave(32, 1)[:, :K]
        assert torch.equal(h.quantized_x(x), want)  # the C prepare quantizes bit for bit as quantize_x
        t8 = hg.int8_tables(cb, 4)
        c = cb.float()
        assert torch.equal(t8.scale, c.abs().amax(1) / 127.0)
        assert int(t8.q.abs().max()) <= 127 and t8.q.dtype == torch.int8
        assert float((t8.q.float() * t8.scale.unsqueeze(1) - c).abs().max()) <= float(t8.scale.max()) / 2 * 1.000001


def test_shared_storage_gives_the_int8_tables_of_its_decoded_rows():
    g = torch.Generator().manual_seed(3)
    N, G = 53, 8
    shared = torch.randn(-(-N // G), 16, generator=g).to(torch.float16)
    scale = (torch.rand(N, generator=g) + 0.5).to(torch.float16)
    st = hg.SharedTables(shared, scale, G)
    a = hg.int8_tables(st, 4)
    b = hg.int8_tables(hg.row_centroids(st, N, 4).to(torch.float16), 4)
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)


def test_zero_rows_and_zero_inputs():
    N, K = 5, 100
    cb = torch.zeros(N, 16, dtype=torch.float16)
    codes = pack_codes(torch.randint(0, 16, (N, K)), 4)
    t8 = hg.int8_tables(cb, 4)
    assert int(t8.q.abs().max()) == 0 and float(t8.scale.abs().max()) == 0
    for path in PATHS:
        assert torch.equal(_gemv(torch.randn(2, K), codes, t8, K, path), torch.zeros(2, N))
        cb2 = torch.randn(N, 16).to(torch.float16)
        assert torch.equal(_gemv(torch.zeros(1, K), codes, hg.int8_tables(cb2, 4), K, path), torch.zeros(1, N))


def test_int8_tables_take_4_bit_only_and_fused_gemvs_one_numerics():
    cb8 = torch.randn(4, 256).to(torch.float16)
    with pytest.raises(ValueError):
        hg.int8_tables(cb8, 8)
    K = 70
    x, codes, cb = _case(1, 9, K, seed=1)
    t8 = hg.int8_tables(cb, 4)
    with pytest.raises(ValueError):
        ho.FusedGemv([(codes, t8, None), (codes, cb, None)], 4, K)
    c8, cbb = _case8(1, 9, K, seed=2)[1:]
    with pytest.raises(ValueError):  # the dense form stands for 8-bit codes only
        hg.codebook_gemv_host(x, codes, hg.int8_weights(c8, cbb, K), 4, K)
    w8 = hg.int8_weights(c8, cbb, K)
    with pytest.raises(ValueError):  # its weights checked: shape
        hg.codebook_gemv_host(x, c8, hg.Int8Weights(w8.w[:, :64].contiguous(), w8.scale, cbb), 8, K)


# ---------------------------------------------------------------- 8-bit: the dense form (hg.Int8Weights)
def _case8(M, N, K, seed, shared=False):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (N, K), generator=g)
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g))
    if K > 40:
        x[:, K // 3] *= 30
        x[:, :min(32, K // 2)] = 0
    if shared:
        G = 4
        tables = hg.SharedTables(torch.randn(-(-N // G), 256, generator=g).to(torch.float16),
                                 (torch.rand(N, generator=g) + 0.5).to(torch.float16), G)
    else:
        tables = (torch.randn(N, 256, generator=g) * torch.exp(torch.randn(N, 1, generator=g))).to(torch.float16)
    return x, pack_codes(idx, 8), tables


SHAPES8 = _shapes(240, seed=8)


@pytest.mark.parametrize("chunk", range(4))
def test_int8_8bit_dense_form_matches_its_float64_reference_on_every_path_bitwise(chunk):
    lib = hg.library()
    for i, (M, N, K) in enumerate(SHAPES8[chunk::4]):
        x, codes, tables = _case8(M, N, K, seed=20000 + chunk * 1000 + i, shared=i % 5 == 0)
        w8 = hg.int8_weights(codes, tables, K, rows=37)  # looked up in blocks of rows that do not divide N
        ref = hg.reference_int8(x, codes, w8, K)
        xq, d = hg.quantize_x(x)
        wabs = hg.HostGemv(codes, w8, 8, K).dequantize().double().abs()
        xd = (xq.double() * d.double().repeat_interleave(32, 1)[:, :K]).abs()
        tol = (K / 256 + 8) * 1.2e-7 * (xd @ wabs.T) + 1e-30
        y = hg.codebook_gemv_host(x, codes, w8, 8, K, path="c")
        assert y.shape == (M, N) and y.dtype == torch.float32
        assert bool(((y.double() - ref).abs() <= tol).all()), (M, N, K, float((y.double() - ref).abs().max()))
        for path in PATHS[1:]:  # exact integers: every path gives the portable C's bits
            assert torch.equal(hg.codebook_gemv_host(x, codes, w8, 8, K, path=path), y), (M, N, K, path)
        if PATHS[-1] in ("avx512", "avx512vbmi", "avx512fp16"):
            lib.tp_q8_no_vnni(1)
            try:
                assert torch.equal(hg.codebook_gemv_host(x, codes, w8, 8, K, path=PATHS[-1]), y), (M, N, K)
            finally:
                lib.tp_q8_no_vnni(0)
        for m in range(M):  # batch invariance
            assert torch.equal(hg.codebook_gemv_host(x[m:m + 1], codes, w8, 8, K), y[m:m + 1]), (M, N, K, m)
        for t in (2, 3):
            assert torch.equal(hg.codebook_gemv_host(x, codes, w8, 8, K, threads=t), y), (M, N, K, t)


def test_int8_8bit_dense_form_is_the_int8_tables_looked_up():
    """w[n, k] = q[n, idx(n, k)] with q, s rounded as the 4-bit tables are (per row s = max |c| / 127), in the q8
    order, zero past K; within the rounding bound of the fp32 reference."""
    for i, (M, N, K) in enumerate(SHAPES8[:40]):
        x, codes, tables = _case8(M, N, K, seed=30000 + i, shared=i % 3 == 0)
        w8 = hg.int8_weights(codes, tables, K)
        c = hg.row_centroids(tables, N, 8)
        s = c.abs().amax(1) / 127.0
        assert torch.equal(w8.scale, s)
        q = torch.where(s.unsqueeze(1) > 0, torch.round(c / s.unsqueeze(1).clamp_min(1e-38)), torch.zeros(()))
        want = torch.gather(q, 1, unpack_codes(codes, 8, K).long())
        order = hg.q8_order(K)
        assert sorted(order.tolist()) == list(range(order.numel())) and order.numel() % 128 == 0
        natural = torch.empty(w8.w.shape, dtype=torch.float32)
        natural[:, order] = w8.w.float()
        assert torch.equal(natural[:, :K], want) and not bool(natural[:, K:].any())
        y = hg.codebook_gemv_host(x, codes, w8, 8, K)
        ref = hg.reference(x, codes, tables, 8, K)
        wq = want.double() * s.double().unsqueeze(1)
        cw = torch.gather(c.double(), 1, unpack_codes(codes, 8, K).long())
        xq, d = hg.quantize_x(x)
        xd = xq.double() * d.double().repeat_interleave(32, 1)[:, :K]
        bound = x.double().abs() @ (cw - wq).abs().T + (x.double() - xd).abs() @ wq.abs().T
        slack = 1e-5 * (x.double().abs() @ cw.abs().T) + 1e-30
        assert bool(((y.double() - ref).abs() <= bound + slack).all()), (M, N, K)


def test_int8_8bit_fused_call_and_prefill_matmul():
    K, N = 300, 41
    x, codes, tables = _case8(3, N, K, seed=77)
    w8 = hg.int8_weights(codes, tables, K)
    h = hg.HostGemv(codes, w8, 8, K)
    assert h.int8 and h.nbytes == w8.w.numel() + 4 * N  # the codes are not read
    y = h(x, threads=2)
    assert torch.equal(y, hg.codebook_gemv_host(x, codes, w8, 8, K))
    f = ho.FusedGemv([(codes, w8, None)], 8, K)
    assert f.int8 and torch.equal(f(x, threads=3), y)
    mm = h.matmul(x)  # prefill: x quantized as the GEMV does, times the dequantized int8 weights
    assert torch.allclose(mm, y, rtol=1e-5, atol=1e-5 * float(y.abs().max()))


def test_fused_int8_gemv_is_bitwise_the_single_gemvs_plus_epilogue():
    K = 200
    x, c1, cb1 = _case(3, 37, K, seed=11)
    _, c2, cb2 = _case(3, 37, K, seed=12)
    t1, t2 = hg.int8_tables(cb1, 4), hg.int8_tables(cb2, 4)
    bias = torch.randn(74)
    res = torch.randn(3, 74)
    for threads in (1, 2, 3):
        f = ho.FusedGemv([(c1, t1, bias[:37]), (c2, t2, bias[37:])], 4, K)
        y = f(x, residual=res, threads=threads)
        want = res + (torch.cat([_gemv(x, c1, t1, K, None), _gemv(x, c2, t2, K, None)], 1) + bias)
        assert torch.equal(y, want)
        act = ho.FusedGemv([(c1, t1, None), (c2, t2, None)], 4, K, act="silu")(x, threads=threads)
        g, u = _gemv(x, c1, t1, K, None), _gemv(x, c2, t2, K, None)
        assert torch.allclose(act, torch.nn.functional.silu(g) * u, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_cbk("llama2", tmp_path_factory.mktemp("llama2_int8"))


def _run(dec, tokens, threads=None):
    if threads is not None:
        dec.cpu_step.threads = threads
    cache = dec.new_cache(1, 64)
    with torch.inference_mode():
        rows = [dec(torch.tensor([tokens[:6]]), cache, 0)[0]]
        for i, t in enumerate(tokens[6:]):
            rows.append(dec(torch.tensor([[t]]), cache, 6 + i)[0])
    return torch.cat(rows)


TOKENS = [1, 5, 9, 14, 3, 22, 7, 30, 11, 4, 18, 25]


def test_model_in_int8_mode_step_threads_and_reference_ops(llama):
    m8 = trapetum.load(llama, options=Options(host_numerics="int8"))
    dec = m8.decoder
    mods = [mod for mod in dec.modules() if getattr(mod, "host", None) is not None]
    assert all(mod.host.int8 for mod in mods) and {mod.bits for mod in mods} == {4, 8}  # the 8-bit head too
    assert all(isinstance(mod.host.tables, hg.Int8Weights) == (mod.bits == 8) for mod in mods)
    got = _run(dec, TOKENS)
    for t in (2, 3):  # the same bits at every thread count
        assert torch.equal(_run(dec, TOKENS, threads=t), got)
    assert torch.equal(_run(dec, TOKENS, threads=1), got)  # run to run
    # the reference decoder's ops on the same int8 GEMVs (cpu_step off): the same numbers up to fp32 rounding
    ref8 = trapetum.load(llama, options=Options(host_numerics="int8", cpu_step=False)).decoder
    want = _run(ref8, TOKENS)
    assert float((got - want).norm() / want.norm()) < 1e-5
    # against the fp32 mode: the quantization's difference, small but not zero
    fp = _run(trapetum.load(llama).decoder, TOKENS)
    rel = float((got - fp).norm() / fp.norm())
    assert 0 < rel < 0.05, rel


def test_default_options_keep_the_fp32_numerics(llama):
    assert Options().host_numerics == "fp32"
    dec = trapetum.load(llama).decoder
    mods = [mod for mod in dec.modules() if getattr(mod, "host", None) is not None]
    assert mods and not any(mod.host.int8 for mod in mods)
    assert not any(isinstance(mod.host.tables, (hg.Int8Tables, hg.Int8Weights)) for mod in mods)
    with pytest.raises(Exception):
        Options(host_numerics="int4")
