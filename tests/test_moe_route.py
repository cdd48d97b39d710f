"""kernels/moe_route.py (Triton; interpreted on the CPU): the fused scores + top-k against models/blocks/moe.
select_experts (the reference) over random configs (E, k, softmax / sigmoid, bias, norm, scale), ties to the lower
index, rows independent bitwise."""
from dataclasses import dataclass

import pytest
import torch

from trapetum.kernels import moe_route as mr
from trapetum.models.blocks.moe import select_experts

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not mr.available(DEV), reason="needs Triton (CUDA or TRITON_INTERPRET=1)")


@dataclass
class Cfg:
    num_experts: int
    num_experts_per_tok: int
    router_scoring: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    router_topk: str = "greedy"
    n_group: int = 1
    topk_group: int = 1


def _distinct_logits(M, E, g):
    """Logits whose scores are far apart (no near-ties the two fp32 computations could order differently)."""
    return torch.stack([torch.randperm(E, generator=g).float() * 0.05 - 1 for _ in range(M)])


CASES = [(1, 1, 1, "softmax", False, 1.0, False), (3, 8, 2, "softmax", True, 1.0, False),
         (16, 64, 6, "softmax", False, 1.0, False), (5, 60, 4, "sigmoid", True, 2.5, True),
         (2, 3, 3, "sigmoid", False, 1.0, False), (4, 257, 8, "softmax", True, 1.0, True),
         (7, 128, 1, "sigmoid", True, 1.0, True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_route_matches_select_experts(case):
    M, E, k, scoring, norm, scale, has_bias = case
    g = torch.Generator().manual_seed(E * 31 + k)
    cfg = Cfg(E, k, scoring, norm, scale)
    logits = _distinct_logits(M, E, g).to(DEV)
    bias = (torch.randn(E, generator=g) * 0.01).to(DEV) if has_bias else None
    w, i = mr.route(logits.half(), k, scoring, norm, scale, bias)
    rw, ri = select_experts(logits.half().float(), cfg, bias)
    assert torch.equal(i.long(), ri)
    assert float((w - rw).abs().max() / rw.abs().max()) < 1e-5
    for m in (0, M - 1):  # rows independent
        w1, i1 = mr.route(logits[m:m + 1].half().clone(), k, scoring, norm, scale, bias)
        assert torch.equal(w1[0], w[m]) and torch.equal(i1[0], i[m])


def test_ties_go_to_the_lower_index():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 0.0]], device=DEV)
    w, i = mr.route(logits, 4, "softmax", False)
    assert i.tolist() == [[1, 2, 4, 3]]
    assert torch.equal(i.long(), select_experts(logits, Cfg(6, 4))[1])


def test_applies_and_bad_arguments():
    assert mr.applies(Cfg(64, 6)) and not mr.applies(Cfg(64, 6, router_topk="noaux_tc", n_group=8, topk_group=4))
    x = torch.zeros(2, 8, device=DEV)
    for call, word in ((lambda: mr.route(x, 9, "softmax", False), "k:"),
                       (lambda: mr.route(x, 2, "relu", False), "scoring:"),
                       (lambda: mr.route(x[0], 2, "softmax", False), "logits:")):
        with pytest.raises(ValueError) as e:
            call()
        assert word in str(e.value)
