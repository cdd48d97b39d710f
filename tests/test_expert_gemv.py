"""kernels/expert_gemv.py (Triton; on the CPU under TRITON_INTERPRET=1): the selected experts' gate/up and down GEMVs
against their float64 references over random shapes (awkward K / F / D, E, k, M up to 16, bits 2 / 4 / 8 and fp16),
and the contracts bitwise: row m of an M-row call equals the one-row call on row m (rows choosing the same and
different experts), reruns identical, the slot order fixed."""
import zlib

import pytest
import torch

from trapetum.kernels import expert_gemv as xg
from trapetum.kernels.codebook_layout import interleave_gate_up

pytestmark = pytest.mark.skipif(not xg.available(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                                reason="needs Triton (CUDA or TRITON_INTERPRET=1)")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rel(a, b):
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def stacks(scheme, E, K, F, D, bits, g):
    """(gate/up stack w, cb), (down stack w, cb) with random weights of scale ~ 1 / sqrt(fan in)."""
    if scheme == "fp16":
        gu = (torch.randn(E, 2 * F, K, generator=g) / K ** 0.5).half()
        dn = (torch.randn(E, D, F, generator=g) / F ** 0.5).half()
        return (gu.to(DEV), None), (dn.to(DEV), None)
    nc, kbk, kbf = 1 << bits, -(-K * bits // 8), -(-F * bits // 8)
    codes, cbs = [], []
    for _ in range(E):
        parts = [torch.randint(0, 256, (F, kbk), generator=g, dtype=torch.uint8) for _ in range(2)]
        books = [(torch.randn(F, nc, generator=g) / K ** 0.5).half() for _ in range(2)]
        c, b, _ = interleave_gate_up(parts[0], books[0], parts[1], books[1])
        codes.append(c)
        cbs.append(b)
    dc = torch.randint(0, 256, (E, D, kbf), generator=g, dtype=torch.uint8)
    db = (torch.randn(E, D, nc, generator=g) / F ** 0.5).half()
    return (torch.stack(codes).to(DEV), torch.stack(cbs).to(DEV)), (dc.to(DEV), db.to(DEV))


def routing(M, E, k, g):
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int32)
    w = torch.rand(M, k, generator=g)
    return idx.to(DEV), (w / w.sum(-1, keepdim=True)).to(DEV)


CASES = [  # scheme, bits, E, k, M, K, F, D
    ("codebook", 4, 1, 1, 1, 1, 1, 1),
    ("codebook", 4, 3, 2, 3, 53, 3, 97),
    ("codebook", 4, 8, 2, 16, 97, 53, 3),
    ("codebook", 4, 6, 6, 5, 64, 24, 48),
    ("codebook", 2, 5, 3, 4, 53, 17, 33),
    ("codebook", 8, 4, 2, 2, 33, 9, 20),
    ("fp16", 4, 1, 1, 1, 1, 1, 1),
    ("fp16", 4, 3, 2, 3, 53, 3, 97),
    ("fp16", 4, 8, 3, 16, 97, 53, 5),
    ("fp16", 4, 7, 7, 2, 40, 33, 257),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_expert_gemvs_match_float64_reference(case):
    scheme, bits, E, k, M, K, F, D = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))  # not hash(): salted per process
    (gw, gc), (dw, dc) = stacks(scheme, E, K, F, D, bits, g)
    x = torch.randn(M, K, generator=g).half().to(DEV)
    idx, w = routing(M, E, k, g)
    res = torch.randn(M, D, generator=g).half().to(DEV)
    for act in ("silu", "gelu_tanh"):
        h = xg.expert_gate_up(x, idx, gw, gc, bits, F, act)
        assert h.shape == (M, k, F)
        assert rel(h, xg.expert_gate_up_reference(x, idx, gw, gc, bits, F, act)) < 2e-3
    y = xg.expert_down(h, idx, w, dw, dc, bits)
    assert rel(y, xg.expert_down_reference(h, idx, w, dw, dc, bits)) < 2e-3
    y2 = xg.expert_down(h, idx, w, dw, dc, bits, residual=res)
    assert rel(y2, xg.expert_down_reference(h, idx, w, dw, dc, bits, residual=res)) < 2e-3


def _random_cases(n, seed=17):
    g = torch.Generator().manual_seed(seed)
    sizes = (1, 3, 8, 16, 24, 53, 64, 97)

    def pick(seq):
        return seq[int(torch.randint(len(seq), (1,), generator=g))]
    out = []
    for _ in range(n):
        E = pick((1, 2, 5, 8, 12))
        out.append((pick(("codebook", "fp16")), pick((2, 4, 4, 8)), E, 1 + int(torch.randint(E, (1,), generator=g)),
                    pick((1, 2, 3, 7, 16)), pick(sizes), pick(sizes), pick(sizes)))
    return out


@pytest.mark.parametrize("case", _random_cases(16), ids=lambda c: "-".join(map(str, c)))
def test_expert_gemvs_random_shapes(case):
    test_expert_gemvs_match_float64_reference(case)


@pytest.mark.parametrize("scheme", ["codebook", "fp16"])
def test_rows_are_independent_and_reruns_identical(scheme):
    """VERIFY rows: each row's h and y bitwise its one-row call's, whatever the other rows chose; rows choosing the
    same experts (a repeated row) give the same bits; reruns are identical."""
    E, k, M, K, F, D = 8, 3, 16, 97, 53, 40
    g = torch.Generator().manual_seed(7)
    (gw, gc), (dw, dc) = stacks(scheme, E, K, F, D, 4, g)
    x = torch.randn(M, K, generator=g).half().to(DEV)
    idx, w = routing(M, E, k, g)
    x[5], idx[5], w[5] = x[2], idx[2], w[2]  # two rows alike
    idx[7] = idx[8]  # same experts, different inputs
    res = torch.randn(M, D, generator=g).half().to(DEV)
    res[5] = res[2]
    h = xg.expert_gate_up(x, idx, gw, gc, 4, F)
    y = xg.expert_down(h, idx, w, dw, dc, 4, residual=res)
    assert torch.equal(h, xg.expert_gate_up(x, idx, gw, gc, 4, F))
    assert torch.equal(y, xg.expert_down(h, idx, w, dw, dc, 4, residual=res))
    assert torch.equal(h[5], h[2]) and torch.equal(y[5], y[2])
    for m in (0, 2, 7, 15):
        hm = xg.expert_gate_up(x[m:m + 1].clone(), idx[m:m + 1].clone(), gw, gc, 4, F)
        assert torch.equal(hm[0], h[m])
        ym = xg.expert_down(hm, idx[m:m + 1].clone(), w[m:m + 1].clone(), dw, dc, 4, residual=res[m:m + 1].clone())
        assert torch.equal(ym[0], y[m])
    # int64 ids (select_experts' dtype) give the same bits as int32
    assert torch.equal(y, xg.expert_down(h, idx.long(), w, dw, dc, 4, residual=res))


def test_slot_order_is_fixed():
    """y sums the slots in order 0..k-1: permuting the slots changes nothing in exact arithmetic and is allowed to
    change bits, but the same slots in the same order always give the same bits; a zero weight drops a slot."""
    E, k, M, K, F, D = 4, 2, 3, 33, 17, 21
    g = torch.Generator().manual_seed(3)
    (gw, gc), (dw, dc) = stacks("codebook", E, K, F, D, 4, g)
    x = torch.randn(M, K, generator=g).half().to(DEV)
    idx, w = routing(M, E, k, g)
    h = xg.expert_gate_up(x, idx, gw, gc, 4, F)
    w0 = w.clone()
    w0[:, 1] = 0
    one = xg.expert_down(h[:, :1].contiguous(), idx[:, :1].contiguous(), w0[:, :1].contiguous(), dw, dc, 4)
    assert torch.equal(xg.expert_down(h, idx, w0, dw, dc, 4), one)
    perm = xg.expert_down(h.flip(1).contiguous(), idx.flip(1).contiguous(), w.flip(1).contiguous(), dw, dc, 4)
    assert rel(perm, xg.expert_down(h, idx, w, dw, dc, 4)) < 2e-3


def test_bad_arguments_are_one_line_errors():
    g = torch.Generator().manual_seed(1)
    (gw, gc), (dw, dc) = stacks("codebook", 2, 16, 8, 8, 4, g)
    x = torch.randn(2, 16, generator=g).half().to(DEV)
    idx, w = routing(2, 2, 1, g)
    for call, word in ((lambda: xg.expert_gate_up(x.float(), idx, gw, gc, 4, 8), "x:"),
                       (lambda: xg.expert_gate_up(x, idx.float(), gw, gc, 4, 8), "idx:"),
                       (lambda: xg.expert_gate_up(x, idx, gw, gc, 4, 9), "f:"),
                       (lambda: xg.expert_gate_up(x, idx, gw, gc[:, :, :8], 4, 8), "codebook"),
                       (lambda: xg.expert_gate_up(x, idx, gw, gc, 4, 8, act="relu"), "act:"),
                       (lambda: xg.expert_down(torch.zeros(2, 1, 8).half().to(DEV), idx, w[:, :1], dw, dc, 3),
                        "bits:")):
        with pytest.raises(ValueError) as e:
            call()
        assert word in str(e.value) and "\n" not in str(e.value)
