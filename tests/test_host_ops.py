"""The decode step's host ops (kernels/host_ops.py, kernels/host/cpu_step.c, tp_gemv_multi of codebook_host.c):
the fused GEMV bitwise against the single-weight GEMV plus torch's fp32 epilogue (bias, residual) and against
float64 for the activation, batch- and thread-invariant; RMSNorm and attention against float64; RoPE bitwise
against the reference's ``Rotary.apply``; the k / v append; bad arguments."""
from __future__ import annotations

import random

import pytest
import torch

from trapetum.kernels import host_gemv as hg
from trapetum.kernels import host_ops as ho
from trapetum.kernels.pack import pack_codes
from trapetum.models.layers import Rotary

if not hg.available():
    pytest.skip(f"host kernels unavailable: {hg.error()}", allow_module_level=True)

AWKWARD = (1, 3, 53, 97, 257)


def _rel(y, ref):
    return float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _weight(bits, N, K, g):
    idx = torch.randint(0, 1 << bits, (N, K), generator=g)
    return pack_codes(idx, bits), torch.randn(N, 1 << bits, generator=g).to(torch.float16)


def _cases(n, seed=0):
    rng = random.Random(seed)
    pick = lambda lo, hi: rng.choice(AWKWARD) if rng.random() < 0.4 else rng.randint(lo, hi)  # noqa: E731
    return [(rng.choice((4, 8)), rng.randint(1, 16), [pick(1, 200) for _ in range(rng.randint(1, 4))], pick(1, 400),
             rng.random() < 0.5) for _ in range(n)]


@pytest.mark.parametrize("chunk", range(4))
def test_fused_gemv_is_the_single_gemvs_side_by_side(chunk):
    for i, (bits, M, Ns, K, with_bias) in enumerate(_cases(60, chunk)):
        g = torch.Generator().manual_seed(100 * chunk + i)
        ws = [_weight(bits, N, K, g) for N in Ns]
        bias = [torch.randn(N, generator=g) if with_bias and j != 1 else None for j, N in enumerate(Ns)]
        f = ho.FusedGemv([(c, cb, b) for (c, cb), b in zip(ws, bias)], bits, K)
        x = torch.randn(M, K, generator=g)
        want = torch.cat([hg.codebook_gemv_host(x, c, cb, bits, K, threads=1) + (b if b is not None else 0)
                          for (c, cb), b in zip(ws, bias)], 1)
        res = torch.randn(M, sum(Ns), generator=g)
        for t in (1, 2, 3):
            assert torch.equal(f(x, threads=t), want), (bits, M, Ns, K, t)
            assert torch.equal(f(x, residual=res, threads=t), res + want), (bits, M, Ns, K, t)
        for m in range(M):  # row m alone: the same bits
            assert torch.equal(f(x[m:m + 1], threads=1), want[m:m + 1])


def test_gemv_pass_is_its_calls_one_by_one():
    """GemvPass (one C call over a list, bench_cpu's step pass) gives each call's bits, activation and bias included."""
    g = torch.Generator().manual_seed(5)
    calls, want = [], []
    for i, (bits, M, Ns, K, with_bias) in enumerate(_cases(12, 11)):
        ws = [_weight(bits, N, K, g) for N in Ns[:2]]
        act = "silu" if i % 3 == 0 else None
        if act:
            ws = [ws[0], _weight(bits, Ns[0], K, g)]
        bias = [torch.randn(c.shape[0], generator=g) if with_bias else None for c, _ in ws]
        f = ho.FusedGemv([(c, cb, b) for (c, cb), b in zip(ws, bias)], bits, K, act=act)
        x = torch.randn(M, K, generator=g)
        calls.append((f, x, torch.full((M, f.out_features), float("nan"))))
        want.append(f(x, threads=1))
    for t in (1, 3):
        ho.GemvPass(calls, t).run()
        for (f, _, y), w in zip(calls, want):
            assert torch.equal(y, w), (f.bits, f.out_features, t)
    f, x, y = calls[0]
    with pytest.raises(ValueError, match="out must be fp32"):
        ho.GemvPass([(f, x, torch.empty(x.shape[0], f.out_features + 1))], 1)
    with pytest.raises(ValueError, match="threads must be at least 1"):
        ho.GemvPass(calls, 0)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_fused_gate_up_activation_against_float64(act):
    for i, (bits, M, Ns, K, with_bias) in enumerate(_cases(30, 7)):
        g = torch.Generator().manual_seed(i)
        F_ = Ns[0]
        (cg, bg), (cu, bu) = _weight(bits, F_, K, g), _weight(bits, F_, K, g)
        bias = torch.randn(F_, generator=g) if with_bias else None
        f = ho.FusedGemv([(cg, bg, bias), (cu, bu, None)], bits, K, act=act)
        x = torch.randn(M, K, generator=g)
        gate = hg.reference(x, cg, bg, bits, K) + (bias.double() if bias is not None else 0)
        want = ho.reference_act(gate, hg.reference(x, cu, bu, bits, K), act)
        y = f(x, threads=1)
        assert y.shape == (M, F_) and _rel(y, want) < 1e-5, (bits, M, F_, K)
        assert torch.equal(f(x, threads=3), y)
        assert torch.equal(f(x[-1:], threads=1), y[-1:])


def test_rmsnorm_against_float64():
    g = torch.Generator().manual_seed(0)
    for D in AWKWARD + (576,):
        for rows, offset in ((1, 0.0), (7, 1.0)):
            x, w = torch.randn(rows, D, generator=g) * 3, torch.randn(D, generator=g)
            y = ho.rmsnorm(x, w, 1e-6, offset)
            assert _rel(y, ho.reference_rmsnorm(x, w, 1e-6, offset)) < 1e-6
            assert torch.equal(ho.rmsnorm(x[-1:], w, 1e-6, offset), y[-1:])


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("rd", [8, 6])
def test_rope_is_the_reference_rotation_and_appends_k_v(interleave, rd):
    g = torch.Generator().manual_seed(rd)
    M, Hq, Hkv, hd, start, S = 3, 4, 2, 8, 5, 16
    rope = Rotary(rd, 10000.0, None, 64, interleave)
    cos, sin = rope.cos_sin(torch.arange(start, start + M))
    qkv = torch.randn(M, (Hq + 2 * Hkv) * hd, generator=g)  # q, k, v as views of one fused row (strided)
    q = qkv[:, :Hq * hd].view(M, Hq, hd)
    k = qkv[:, Hq * hd:(Hq + Hkv) * hd].view(M, Hkv, hd)
    v = qkv[:, (Hq + Hkv) * hd:].view(M, Hkv, hd)
    kc, vc = torch.zeros(Hkv, S, hd), torch.zeros(Hkv, S, hd)
    qo = ho.rope_kv(q, k, v, cos.contiguous(), sin.contiguous(), kc, vc, start, interleave)
    assert torch.equal(qo, rope.apply(q.transpose(0, 1), cos, sin).transpose(0, 1))  # [H, T, hd] in the reference
    assert torch.equal(kc[:, start:start + M], rope.apply(k.transpose(0, 1), cos, sin))
    assert torch.equal(vc[:, start:start + M], v.transpose(0, 1))
    assert not kc[:, :start].any() and not kc[:, start + M:].any()


@pytest.mark.parametrize("window,softcap", [(None, None), (4, None), (None, 5.0), (3, 2.0)])
def test_attention_rows_against_float64(window, softcap):
    g = torch.Generator().manual_seed(3)
    for Hq, Hkv, hd, start, M in ((4, 2, 8, 0, 1), (6, 3, 53, 9, 5), (2, 2, 16, 30, 16), (9, 3, 64, 120, 2)):
        rope = Rotary(hd // 2 * 2, 10000.0, None, 512)  # (53: the last feature not rotated)
        cos, sin = rope.cos_sin(torch.arange(start, start + M))
        kc, vc = torch.randn(Hkv, start + M + 3, hd, generator=g), torch.randn(Hkv, start + M + 3, hd, generator=g)
        q, k, v = (torch.randn(M, h, hd, generator=g) for h in (Hq, Hkv, Hkv))
        qo = torch.empty(M, Hq, hd)
        out = ho.attend(q, k, v, cos.contiguous(), sin.contiguous(), kc, vc, start, hd ** -0.5, False, window,
                        softcap, qo=qo)
        want = ho.reference_attend(qo, kc, vc, start, hd ** -0.5, window, softcap)
        assert out.shape == (M, Hq * hd) and _rel(out, want) < 1e-5, (Hq, Hkv, hd, start, M)
        for m in range(M):  # row m alone over the cache as it stands: the same bits
            one = ho.attend(q[m:m + 1], k[m:m + 1], v[m:m + 1], cos[m:m + 1].contiguous(), sin[m:m + 1].contiguous(),
                            kc, vc, start + m, hd ** -0.5, False, window, softcap)
            assert torch.equal(one, out[m:m + 1])


@pytest.mark.parametrize("chunk", range(2))
def test_fused_gemv_of_the_norm_is_rmsnorm_then_the_gemv(chunk):
    for i, (bits, M, Ns, K, with_bias) in enumerate(_cases(40, 20 + chunk)):
        g = torch.Generator().manual_seed(500 + 100 * chunk + i)
        ws = [_weight(bits, N, K, g) for N in Ns]
        bias = [torch.randn(N, generator=g) if with_bias and j != 1 else None for j, N in enumerate(Ns)]
        f = ho.FusedGemv([(c, cb, b) for (c, cb), b in zip(ws, bias)], bits, K)
        xs = torch.randn(M, K + 3, generator=g)[:, 2:K + 2]  # rows with a stride
        w, offset = torch.randn(K, generator=g), (0.0, 1.0)[i % 2]
        res = torch.randn(M, sum(Ns), generator=g)
        h = ho.rmsnorm(xs.contiguous(), w, 1e-6, offset)
        for t in (1, 2, 3):
            assert torch.equal(f(xs, threads=t, norm=(w, 1e-6, offset)), f(h, threads=1)), (bits, M, Ns, K, t)
            assert torch.equal(f(xs, residual=res, threads=t, norm=(w, 1e-6, offset)), f(h, residual=res, threads=1))
        if len(Ns) >= 2 and Ns[0] == Ns[1] or i % 5 == 0:  # with the activation (two weights of equal rows)
            fa = ho.FusedGemv([(ws[0][0], ws[0][1], bias[0]), (ws[0][0], ws[0][1], None)], bits, K, act="silu")
            assert torch.equal(fa(xs, threads=2, norm=(w, 1e-6, offset)), fa(h, threads=1))
    with pytest.raises(ValueError, match="norm weight"):
        f(xs, norm=(w[:-1], 1e-6, 0.0))


def test_attention_read_out_of_the_fused_rows_is_attend():
    g = torch.Generator().manual_seed(4)
    for Hq, Hkv, hd, start, M, window, softcap in ((4, 2, 8, 0, 1, None, None), (6, 3, 53, 9, 5, 4, None),
                                                   (9, 3, 64, 120, 2, None, 5.0), (2, 2, 16, 30, 16, 3, 2.0)):
        rope = Rotary(hd // 2 * 2, 10000.0, None, 512)
        cos, sin = (t.contiguous() for t in rope.cos_sin(torch.arange(start, start + M)))
        kc, vc = torch.randn(Hkv, start + M + 3, hd, generator=g), torch.randn(Hkv, start + M + 3, hd, generator=g)
        kc2, vc2 = kc.clone(), vc.clone()
        qkv = torch.randn(M, (Hq + 2 * Hkv) * hd, generator=g)
        q, k, v = (qkv[:, a * hd:b * hd].reshape(M, b - a, hd) for a, b in ((0, Hq), (Hq, Hq + Hkv),
                                                                             (Hq + Hkv, Hq + 2 * Hkv)))
        want = ho.attend(q, k, v, cos, sin, kc, vc, start, hd ** -0.5, False, window, softcap)
        got = ho.attend_fused(qkv, Hq, Hkv, hd, cos, sin, kc2, vc2, start, hd ** -0.5, False, window, softcap,
                              torch.empty(M, Hq, hd))
        assert torch.equal(got, want) and torch.equal(kc2, kc) and torch.equal(vc2, vc), (Hq, Hkv, hd, start, M)


def test_bad_arguments_are_refused():
    g = torch.Generator().manual_seed(0)
    c, cb = _weight(4, 5, 7, g)
    c8, cb8 = _weight(8, 5, 7, g)
    with pytest.raises(ValueError):
        ho.FusedGemv([(c, cb, None), (c8, cb8, None)], 4, 7)  # an 8-bit weight in a 4-bit call
    with pytest.raises(ValueError):
        ho.FusedGemv([(c, cb, None)], 4, 7, act="silu")  # an activation takes two weights
    f = ho.FusedGemv([(c, cb, None)], 4, 7)
    with pytest.raises(ValueError):
        f(torch.randn(2, 8))
    with pytest.raises(ValueError):
        f(torch.randn(2, 7), residual=torch.randn(2, 4))
    with pytest.raises(ValueError):
        ho.rmsnorm(torch.randn(2, 5), torch.randn(4), 1e-6)
    q, kc = torch.randn(1, 2, 4), torch.zeros(2, 3, 4)
    cs = torch.ones(1, 4)
    with pytest.raises(ValueError):  # position 3 is outside a cache of 3
        ho.rope_kv(q, q, q, cs, cs, kc, kc.clone(), 3)
