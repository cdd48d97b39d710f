"""RMSNorm, RoPE + KV append and activation epilogue kernels vs float64 references."""
from __future__ import annotations

import random

import pytest
import torch

from kernels_conftest import DEVICE, ON_GPU, TOL, fused as fu, rel_err, requires_cuda
from shapes import AWKWARD, MODELS
from trapetum.settings import KernelOptions

PDL_OFF = KernelOptions(pdl="off")


@pytest.mark.parametrize("seed", range(30))
def test_rmsnorm_random_shapes(seed):
    r = random.Random(seed)
    n = r.choice(AWKWARD + [r.randint(1, 9000 if ON_GPU else 3000)])
    m = r.choice([1, 2, 5])
    offset = r.choice([0.0, 1.0])
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=gen) * r.choice([0.01, 1.0, 30.0])).half().to(DEVICE)
    w = torch.randn(n, generator=gen).to(r.choice([torch.float16, torch.float32])).to(DEVICE)
    y = torch.full_like(x, float("nan"))
    fu.rmsnorm(x, w, 1e-6, offset=offset, out=y)
    assert rel_err(y, fu.rmsnorm_reference(x.cpu(), w.cpu(), 1e-6, offset)) < TOL[torch.float16]


@pytest.mark.parametrize("seed", range(30))
def test_rope_kv_append_random(seed):
    r = random.Random(500 + seed)
    hkv = r.choice([1, 2, 4])
    hq = hkv * r.choice([1, 2, 4])
    d = r.choice([64, 128, 256, 80])
    rot = r.choice([d, d, d // 2])
    t = r.choice([1, 1, 3, 17])
    tmax = r.choice([t, 53, 97, 257])
    pos = r.randint(0, tmax - t)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=gen).half().to(DEVICE)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).half().to(DEVICE)  # k, v as strided views
    k, v = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    kc = torch.randn(hkv, tmax, d, generator=gen).half().to(DEVICE)
    vc = torch.randn(hkv, tmax, d, generator=gen).half().to(DEVICE)
    kc0, vc0, q0 = kc.clone(), vc.clone(), q.clone()
    cos, sin = fu.rope_tables(tmax, rot, r.choice([10000.0, 500000.0]), device=DEVICE)
    p = torch.tensor([pos], device=DEVICE) if r.random() < 0.5 else pos
    fu.rope_kv_append(q, k, v, kc, vc, p, cos, sin)
    positions = torch.arange(pos, pos + t)
    assert rel_err(q, fu.rope_reference(q0.cpu(), positions, cos.cpu(), sin.cpu())) < TOL[torch.float16]
    rk = fu.rope_reference(k.cpu(), positions, cos.cpu(), sin.cpu())
    assert rel_err(kc[:, pos:pos + t].transpose(0, 1), rk) < TOL[torch.float16]
    assert torch.equal(vc[:, pos:pos + t].transpose(0, 1).cpu(), v.cpu())
    # nothing else in the caches moved
    keep = torch.ones(tmax, dtype=torch.bool)
    keep[pos:pos + t] = False
    assert torch.equal(kc[:, keep].cpu(), kc0[:, keep].cpu()) and torch.equal(vc[:, keep].cpu(), vc0[:, keep].cpu())


@pytest.mark.parametrize("seed", range(20))
def test_act_mul_random(seed):
    r = random.Random(900 + seed)
    f = r.choice(AWKWARD + [r.randint(1, 20000 if ON_GPU else 3000)])
    m = r.choice([1, 3])
    act = r.choice(["silu", "gelu_tanh"])
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(m, f, generator=gen) * 4).half().to(DEVICE)
    u = torch.randn(m, f, generator=gen).half().to(DEVICE)
    y = fu.act_mul(g, u, act)
    assert rel_err(y, fu.act_mul_reference(g.cpu(), u.cpu(), act)) < TOL[torch.float16]


def test_rmsnorm_fp32_input_gives_fp16():
    """A residual stream kept in fp32 (prefill) is normalized straight into fp16."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 200, generator=g) * 10).to(DEVICE)
    w = torch.randn(200, generator=g).half().to(DEVICE)
    y = fu.rmsnorm(x, w, 1e-6)
    assert y.dtype == torch.float16 and y.shape == x.shape
    assert rel_err(y, fu.rmsnorm_reference(x.cpu(), w.cpu(), 1e-6)) < TOL[torch.float16]


def test_fused_bad_shapes_raise():
    x = torch.randn(2, 8).half().to(DEVICE)
    with pytest.raises(ValueError, match="weight"):
        fu.rmsnorm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="x"):
        fu.rmsnorm(x.double(), torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="up"):
        fu.act_mul(x, x[:, :4])
    with pytest.raises(ValueError, match="act"):
        fu.act_mul(x, x, "relu")
    q = torch.randn(4, 64).half().to(DEVICE)
    k = torch.randn(2, 64).half().to(DEVICE)
    kc = torch.zeros(2, 16, 64).half().to(DEVICE)
    cos, sin = fu.rope_tables(16, 64, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache"):
        fu.rope_kv_append(q, k, k, kc[:1], kc, 0, cos, sin)
    with pytest.raises(ValueError, match="pos"):
        fu.rope_kv_append(q, k, k, kc, kc.clone(), 16, cos, sin)
    with pytest.raises(ValueError, match="cos"):
        fu.rope_kv_append(q, k, k, kc, kc.clone(), 0, cos.double(), sin)


@requires_cuda
@pytest.mark.parametrize("model", list(MODELS))
def test_fused_real_shapes_gpu(model):
    h, f, nh, nkv, d, _ = MODELS[model]
    x = torch.randn(1, h, device="cuda").half()
    w = torch.randn(h, device="cuda").half()
    assert rel_err(fu.rmsnorm(x, w, 1e-5), fu.rmsnorm_reference(x, w, 1e-5)) < TOL[torch.float16]
    g, u = torch.randn(2, 1, f, device="cuda").half()
    assert rel_err(fu.act_mul(g, u), fu.act_mul_reference(g, u)) < TOL[torch.float16]
    q = torch.randn(nh, d, device="cuda").half()
    k = torch.randn(nkv, d, device="cuda").half()
    kc = torch.zeros(nkv, 4096, d, device="cuda").half()
    vc = torch.zeros_like(kc)
    cos, sin = fu.rope_tables(4096, d, device="cuda")
    q0 = q.clone()
    fu.rope_kv_append(q, k, k, kc, vc, torch.tensor([4095], device="cuda"), cos, sin)
    pos = torch.tensor([4095])
    assert rel_err(q, fu.rope_reference(q0[None].cpu(), pos, cos.cpu(), sin.cpu())[0]) < TOL[torch.float16]
    # programmatic dependent launch (kopts) changes nothing
    assert torch.equal(fu.rmsnorm(x, w, 1e-5, kopts=PDL_OFF), fu.rmsnorm(x, w, 1e-5))
    q1, kc1, vc1 = q0.clone(), kc.clone(), vc.clone()
    fu.rope_kv_append(q1, k, k, kc1, vc1, torch.tensor([4095], device="cuda"), cos, sin, kopts=PDL_OFF)
    assert torch.equal(q1, q) and torch.equal(kc1, kc) and torch.equal(vc1, vc)


def test_fused_kernel_options_and_torch_fallback(monkeypatch):
    """kopts reach the launches (PDL off: the same bits); without Triton (TRITON_INTERPRET=0 on the CPU) the torch
    paths give the references."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 100, generator=gen).half().to(DEVICE)
    w = torch.randn(100, generator=gen).half().to(DEVICE)
    y = fu.rmsnorm(x, w, 1e-6)
    assert torch.equal(fu.rmsnorm(x, w, 1e-6, kopts=PDL_OFF), y)
    q = torch.randn(2, 4, 32, generator=gen).half().to(DEVICE)
    k = torch.randn(2, 2, 32, generator=gen).half().to(DEVICE)
    kc = torch.zeros(2, 10, 32, dtype=torch.float16, device=DEVICE)
    cos, sin = fu.rope_tables(10, 16, device=DEVICE)
    q1, kc1, vc1 = q.clone(), kc.clone(), kc.clone()
    fu.rope_kv_append(q1, k, k, kc1, vc1, 3, cos, sin, kopts=PDL_OFF)
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert rel_err(fu.rmsnorm(x, w, 1e-6), fu.rmsnorm_reference(x, w, 1e-6)) < TOL[torch.float16]
        q2, kc2, vc2 = q.clone(), kc.clone(), kc.clone()
        fu.rope_kv_append(q2, k, k, kc2, vc2, 3, cos, sin)
        assert rel_err(q2, q1) < TOL[torch.float16] and rel_err(kc2, kc1) < TOL[torch.float16]
        assert torch.equal(vc2, vc1)
