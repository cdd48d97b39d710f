"""kernels/latent_attention.py (Triton; on the CPU under TRITON_INTERPRET=1): absorbed latent attention and the
per-head GEMVs against float64 references over awkward shapes (R up to 512 + 64, many heads per latent, lengths
crossing the 64-position chunks), the absorbed form equal to expanded attention, and the VERIFY contract bitwise
(row m of an M-row call equals the one-row call at start + m)."""
import pytest
import torch

from trapetum.kernels import latent_attention as la

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not la.available(DEV), reason="needs Triton (CUDA or TRITON_INTERPRET=1)")


def rel(a, b):
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def inputs(M, H, R, P, T, g):
    q_lat = (torch.randn(M, H, R, generator=g) / R ** 0.5).half().to(DEV)
    q_rot = (torch.randn(M, H, P, generator=g) / P ** 0.5).half().to(DEV)
    cache = torch.randn(T, R + P, generator=g).half().to(DEV)
    return q_lat, q_rot, cache


CASES = [  # M, H, R, P, start, T
    (1, 1, 1, 1, 0, 1),
    (1, 3, 53, 7, 12, 16),
    (3, 16, 32, 16, 60, 70),
    (4, 17, 97, 3, 63, 80),
    (2, 5, 512, 64, 130, 140),
    (16, 2, 24, 8, 0, 20),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_latent_attention_matches_float64(case):
    M, H, R, P, start, T = case
    g = torch.Generator().manual_seed(sum(case))
    q_lat, q_rot, cache = inputs(M, H, R, P, T, g)
    for scale in (0.1, 1.0):
        o = la.latent_attention(q_lat, q_rot, cache, start, scale)
        assert o.shape == (M, H, R)
        assert rel(o, la.latent_attention_reference(q_lat, q_rot, cache, start, scale)) < 3e-3


def test_many_heads_per_latent():
    g = torch.Generator().manual_seed(5)
    q_lat, q_rot, cache = inputs(2, 128, 512, 64, 80, g)
    o = la.latent_attention(q_lat, q_rot, cache, 70, 0.07)
    assert rel(o, la.latent_attention_reference(q_lat, q_rot, cache, 70, 0.07)) < 3e-3


def test_rows_bitwise_one_row_calls_and_device_start():
    """Row m equals the one-row call at start + m; the start may be a device tensor (a graph's position);
    positions past a row's length are never read; reruns identical."""
    M, H, R, P, start = 5, 17, 40, 8, 61
    g = torch.Generator().manual_seed(2)
    q_lat, q_rot, cache = inputs(M, H, R, P, 80, g)
    ws = la.workspace(16, H, R, 80, DEV)
    o = la.latent_attention(q_lat, q_rot, cache, torch.tensor([start], device=DEV), 0.3, ws=ws)
    assert torch.equal(o, la.latent_attention(q_lat, q_rot, cache, start, 0.3))
    junk = cache.clone()
    junk[start + M:] = float("nan")
    assert torch.equal(o, la.latent_attention(q_lat, q_rot, junk, start, 0.3))
    for m in range(M):
        one = la.latent_attention(q_lat[m:m + 1].clone(), q_rot[m:m + 1].clone(), cache, start + m, 0.3)
        assert torch.equal(one[0], o[m]), m


def test_absorbed_equals_expanded_attention():
    """q_lat = W_uk^T q_nope, a = W_uv o: the same as softmax over k_h = [W_uk c, k_rot], v_h = W_uv c (float64),
    with the per-head GEMVs of the kernel module."""
    M, H, R, P, nope, vd, start = 3, 4, 48, 8, 16, 24, 20
    g = torch.Generator().manual_seed(9)
    w_uk = (torch.randn(H, nope, R, generator=g) / R ** 0.5).half().to(DEV)
    w_uv = (torch.randn(H, vd, R, generator=g) / R ** 0.5).half().to(DEV)
    q_nope = torch.randn(M, H, nope, generator=g).half().to(DEV)
    q_rot = torch.randn(M, H, P, generator=g).half().to(DEV)
    cache = torch.randn(start + M, R + P, generator=g).half().to(DEV)
    q_lat = la.head_gemv(q_nope, w_uk.transpose(1, 2).contiguous())
    assert rel(q_lat, la.head_gemv_reference(q_nope, w_uk.transpose(1, 2))) < 2e-3
    a = la.head_gemv(la.latent_attention(q_lat, q_rot, cache, start, 0.2), w_uv)
    c, kr = cache[:, :R].double(), cache[:, R:].double()
    k = torch.einsum("hnr,tr->htn", w_uk.double(), c)
    v = torch.einsum("hvr,tr->htv", w_uv.double(), c)
    for m in range(M):
        L = start + m + 1
        s = (torch.einsum("hn,htn->ht", q_nope[m].double(), k[:, :L]) + q_rot[m].double() @ kr[:L].T) * 0.2
        want = torch.einsum("ht,htv->hv", torch.softmax(s, -1), v[:, :L])
        assert rel(a[m], want) < 5e-3


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 5, 53, 97), (16, 2, 257, 3), (2, 16, 128, 512)])
def test_head_gemv_matches_float64_and_rows_independent(shape):
    M, H, N, K = shape
    g = torch.Generator().manual_seed(M * 7 + K)
    x = torch.randn(M, H, K, generator=g).half().to(DEV)
    w = (torch.randn(H, N, K, generator=g) / K ** 0.5).half().to(DEV)
    y = la.head_gemv(x, w)
    assert rel(y, la.head_gemv_reference(x, w)) < 2e-3
    assert torch.equal(la.head_gemv(x[-1:].clone(), w)[0], y[-1])


def test_bad_arguments():
    g = torch.Generator().manual_seed(0)
    q_lat, q_rot, cache = inputs(1, 2, 8, 4, 4, g)
    for call, word in ((lambda: la.latent_attention(q_lat.float(), q_rot, cache, 0, 1.0), "q_lat:"),
                       (lambda: la.latent_attention(q_lat, q_rot, cache[:, :10], 0, 1.0), "cache:"),
                       (lambda: la.head_gemv(q_lat, q_rot), "w:")):
        with pytest.raises(ValueError) as e:
            call()
        assert word in str(e.value) and "\n" not in str(e.value)


def test_torch_fallback_matches_float64_and_rows(monkeypatch):
    """TRITON_INTERPRET=0 on the CPU: the torch fallbacks, the same references and the same row contract."""
    if DEV.type == "cuda":
        pytest.skip("the fallback runs where Triton cannot")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not la.available(DEV)
    g = torch.Generator().manual_seed(4)
    q_lat, q_rot, cache = inputs(4, 6, 40, 8, 50, g)
    o = la.latent_attention(q_lat, q_rot, cache, 40, 0.2)
    assert rel(o, la.latent_attention_reference(q_lat, q_rot, cache, 40, 0.2)) < 3e-3
    assert torch.equal(la.latent_attention(q_lat[2:3].clone(), q_rot[2:3].clone(), cache, 42, 0.2)[0], o[2])
    w = (torch.randn(6, 9, 40, generator=g) / 40 ** 0.5).half()
    y = la.head_gemv(q_lat, w)
    assert rel(y, la.head_gemv_reference(q_lat, w)) < 2e-3
    assert torch.equal(la.head_gemv(q_lat[3:].clone(), w)[0], y[3])


def _rope_reference(x, cos, sin, interleave):
    x = x.double()
    P = x.shape[-1]
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :P // 2], x[..., P // 2:])
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


@pytest.mark.parametrize("shape", [(1, 1, 2, 1, 1, 0), (5, 3, 6, 53, 7, 9), (4, 17, 64, 512, 128, 30)])
@pytest.mark.parametrize("interleave", [True, False])
def test_rope_latent_append_matches_float64(shape, interleave, monkeypatch):
    n, H, P, R, nope, start = shape
    g = torch.Generator().manual_seed(n + H + P)
    T = start + n + 3
    q = torch.randn(n, H, nope + P, generator=g).half().to(DEV)
    c = torch.randn(n, R, generator=g).half().to(DEV)
    kr = torch.randn(n, P, generator=g).half().to(DEV)
    ang = torch.rand(T, P // 2, generator=g) * 6
    cos, sin = ang.cos().to(DEV), ang.sin().to(DEV)
    cache0 = torch.randn(T, R + P, generator=g).half().to(DEV)
    for interp in ("1", "0") if DEV.type == "cpu" else ("1",):  # the kernel, then (CPU) the torch fallback
        monkeypatch.setenv("TRITON_INTERPRET", interp)
        cache = cache0.clone()
        st = torch.tensor([start], dtype=torch.int32, device=DEV)
        q_rot = la.rope_latent_append(q, c, kr, cos, sin, st, cache, nope, interleave)
        cs, sn = cos[start:start + n].double(), sin[start:start + n].double()
        assert rel(q_rot, _rope_reference(q[..., nope:], cs[:, None], sn[:, None], interleave)) < 1e-3
        assert torch.equal(cache[start:start + n, :R], c)
        assert rel(cache[start:start + n, R:], _rope_reference(kr, cs, sn, interleave)) < 1e-3
        assert torch.equal(cache[:start], cache0[:start]) and torch.equal(cache[start + n:], cache0[start + n:])
        one = cache0.clone()
        q1 = la.rope_latent_append(q[-1:].clone(), c[-1:].clone(), kr[-1:].clone(), cos, sin, start + n - 1, one,
                                   nope, interleave)
        assert torch.equal(q1[0], q_rot[-1]) and torch.equal(one[start + n - 1], cache[start + n - 1])
    monkeypatch.undo()
