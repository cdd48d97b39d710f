"""kernels/expert_gemv_2x8.py (Triton; interpreted on the CPU): AQLM 2x8 experts' gate/up and down GEMVs against
float64 references (random codes, codebooks, scales; awkward K / F / D, E, k, M) and the row contract bitwise."""
import pytest
import torch

from trapetum.kernels import expert_gemv_2x8 as x8

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not x8.available(DEV), reason="needs Triton (CUDA or TRITON_INTERPRET=1)")


def rel(a, b):
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def stacks(E, K, F, D, g):
    def codes(*shape):
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8).to(DEV)

    def books(*shape, fan):
        return (torch.randn(*shape, generator=g) / fan ** 0.5).half().to(DEV)
    gu = (codes(E, 2, F, K // 8, 2), books(E, 2, 2, 256, 8, fan=K), (1 + torch.rand(E, 2, F, generator=g)).half().to(DEV))
    dn = (codes(E, D, F // 8, 2), books(E, 2, 256, 8, fan=F), (1 + torch.rand(E, D, generator=g)).half().to(DEV))
    return gu, dn


@pytest.mark.parametrize("case", [(1, 1, 1, 8, 8, 1), (3, 2, 3, 56, 24, 53), (8, 3, 16, 104, 40, 17),
                                  (6, 6, 2, 8, 8, 97), (4, 2, 5, 264, 16, 33)], ids=str)
def test_2x8_expert_gemvs_match_float64(case):
    E, k, M, K, F, D = case
    g = torch.Generator().manual_seed(sum(case))
    (gc, gb, gs), (dc, db, ds) = stacks(E, K, F, D, g)
    x = torch.randn(M, K, generator=g).half().to(DEV)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(DEV)
    w = torch.rand(M, k, generator=g).to(DEV)
    res = torch.randn(M, D, generator=g).half().to(DEV)
    for act in ("silu", "gelu_tanh"):
        h = x8.expert_gate_up_2x8(x, idx, gc, gb, gs, act)
        assert rel(h, x8.expert_gate_up_2x8_reference(x, idx, gc, gb, gs, act)) < 2e-3
    y = x8.expert_down_2x8(h, idx, w, dc, db, ds, residual=res)
    assert rel(y, x8.expert_down_2x8_reference(h, idx, w, dc, db, ds, residual=res)) < 2e-3
    m = M - 1  # the last row alone: the same bits
    h1 = x8.expert_gate_up_2x8(x[m:].clone(), idx[m:].clone(), gc, gb, gs, "gelu_tanh")
    assert torch.equal(h1[0], h[m])
    y1 = x8.expert_down_2x8(h1, idx[m:].clone(), w[m:].clone(), dc, db, ds, residual=res[m:].clone())
    assert torch.equal(y1[0], y[m])


def test_2x8_bad_arguments():
    g = torch.Generator().manual_seed(0)
    (gc, gb, gs), _ = stacks(2, 16, 8, 8, g)
    x = torch.randn(1, 16, generator=g).half().to(DEV)
    idx = torch.zeros(1, 1, dtype=torch.long, device=DEV)
    for call, word in ((lambda: x8.expert_gate_up_2x8(x[:, :12].contiguous(), idx, gc, gb, gs), "x:"),
                       (lambda: x8.expert_gate_up_2x8(x, idx, gc, gb[:, :1].contiguous(), gs), "codebooks:"),
                       (lambda: x8.expert_gate_up_2x8(x, idx.float(), gc, gb, gs), "idx:")):
        with pytest.raises(ValueError) as e:
            call()
        assert word in str(e.value) and "\n" not in str(e.value)
