"""The mma GEMV's fragment order (kernels/codebook_layout.py) and the producers that write it: RMSNorm, the
attention merge and the gate/up epilogue. Contract: a producer's Fragments hold exactly the values of its row-major
result at the addresses ``to_fragments`` gives (bitwise), and a GEMV fed Fragments gives bitwise what it gives on
the row-major rows (it then skips its own copy). CPU: the reference permutation against the CUDA copy kernel's piece
rule, the Triton producers under TRITON_INTERPRET=1, the fallbacks; GPU: the CUDA kernels and the engine."""
import pytest
import torch

from trapetum.kernels import codebook_gemv as cg
from trapetum.kernels.attention import attention_rows, attention_workspace
from trapetum.kernels.codebook_layout import (FRAG_ROWS, Fragments, frag_index, frag_pieces, from_fragments,
                                              to_fragments)
from trapetum.kernels.fused import rmsnorm, rope_tables
from trapetum.kernels.triton_util import triton_ok

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def piece_rule(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The CUDA x_fragments_kernel's rule, piece by piece: 16-byte piece r of row m (r = (c * 4 + t) * PT + i)
    goes to piece ((c * PT + i) * M + m) * 4 + t."""
    M, K = x.shape
    pt = frag_pieces(bits)
    n8 = K // 8
    src = x.reshape(M, n8, 8)
    out = torch.empty(M * n8, 8, dtype=x.dtype)
    for m in range(M):
        for r in range(n8):
            c, t, i = r // (4 * pt), (r // pt) & 3, r % pt
            out[((c * pt + i) * M + m) * 4 + t] = src[m, r]
    return out.view(M, K)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M,K", [(3, 128), (5, 256), (8, 384), (16, 128), (9, 640)])
def test_to_fragments_is_the_kernels_piece_rule_and_inverts(bits, M, K):
    if K % (32 * frag_pieces(bits)):
        pytest.skip("not a fragment width")
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M * K)).half()
    f = to_fragments(x, bits)
    assert torch.equal(f, piece_rule(x, bits))
    assert torch.equal(from_fragments(f, bits), x)
    assert torch.equal(Fragments(f, bits).rows(), x)
    idx = frag_index(torch.arange(M).view(-1, 1), torch.arange(K).view(1, -1), M, frag_pieces(bits))
    assert torch.equal(idx.reshape(-1).sort().values, torch.arange(M * K))  # a permutation


def test_fragment_shapes_are_checked():
    with pytest.raises(ValueError, match="K % 128"):
        to_fragments(torch.zeros(4, 96), 4)
    with pytest.raises(ValueError, match="bits"):
        frag_pieces(2)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M,N", [(3, 128), (7, 256), (16, 384)])
def test_rmsnorm_writes_fragments_bitwise(bits, M, N):
    if N % (32 * frag_pieces(bits)):
        pytest.skip("not a fragment width")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(M + N)
    x = torch.randn(M, N, generator=g).half().to(dev)
    w = (1 + 0.1 * torch.randn(N, generator=g)).half().to(dev)
    ref = rmsnorm(x, w, 1e-5)
    got = rmsnorm(x, w, 1e-5, frag_bits=bits)
    assert isinstance(got, Fragments) and got.bits == bits
    assert torch.equal(got.data.cpu(), to_fragments(ref.cpu(), bits))
    with pytest.raises(ValueError, match="frag_bits"):
        rmsnorm(x[:, :96], w[:96], 1e-5, frag_bits=4)


@pytest.mark.parametrize("rows,hq,hkv,d,pos", [(3, 4, 2, 32, 0), (5, 4, 4, 64, 37), (8, 8, 2, 32, 90)])
def test_attention_merge_writes_fragments_bitwise(rows, hq, hkv, d, pos):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if not triton_ok(torch.device(dev)):
        pytest.skip("needs Triton (a GPU or TRITON_INTERPRET=1)")
    g = torch.Generator().manual_seed(rows * 31 + pos)
    tmax = 128
    q = torch.randn(rows, hq, d, generator=g).half().to(dev)
    k = torch.randn(rows, hkv, d, generator=g).half().to(dev)
    v = torch.randn(rows, hkv, d, generator=g).half().to(dev)
    kc0 = torch.randn(hkv, tmax, d, generator=g).half().to(dev)
    vc0 = torch.randn(hkv, tmax, d, generator=g).half().to(dev)
    cos, sin = (t.to(dev) for t in rope_tables(tmax, d))
    ws = attention_workspace(hq, d, tmax, torch.device(dev), hkv=hkv, rows=rows)
    outs = []
    for fb in (None, 4):
        kc, vc = kc0.clone(), vc0.clone()
        outs.append(attention_rows(q, k, v, kc, vc, pos, cos, sin, scale=d ** -0.5, workspace=ws, frag_bits=fb))
    ref, got = outs
    assert isinstance(got, Fragments)
    assert torch.equal(got.data.cpu(), to_fragments(ref.reshape(rows, -1).cpu(), 4))
    with pytest.raises(ValueError, match="frag_bits"):
        attention_rows(q, k, v, kc0.clone(), vc0.clone(), pos, cos, sin, scale=d ** -0.5, fused=False, frag_bits=4)


def _gate_up_weights(f, K, g, dev, bits=4):
    codes = torch.randint(0, 256, (2 * f, K * bits // 8), generator=g, dtype=torch.uint8)
    cb = (0.05 * torch.randn(2 * f, 1 << bits, generator=g)).half()
    return codes.to(dev), cb.to(dev)


@pytest.mark.parametrize("M", [3, 6])
def test_gate_up_fallback_writes_fragments_and_mma_inputs_are_refused_without_it(M):
    g = torch.Generator().manual_seed(M)
    f, K = 128, 128
    codes, cb = _gate_up_weights(f, K, g, "cpu")
    x = torch.randn(M, K, generator=g).half()
    ref = cg.codebook_gemv_gate_up(x, codes, cb, 4, f, backend="torch")
    got = cg.codebook_gemv_gate_up(x, codes, cb, 4, f, backend="torch", out_frag_bits=4)
    assert isinstance(got, Fragments) and torch.equal(got.data, to_fragments(ref, 4))
    with pytest.raises(ValueError, match="out_frag_bits"):
        cg.codebook_gemv_gate_up(x[:2], codes, cb, 4, f, backend="torch", out_frag_bits=4)
    # without the mma kernel nothing reads fragments, and a Fragments input is refused in one line
    assert cg.reads_fragments(M, 4, tiled=False) is None
    with pytest.raises(ValueError, match="fragment order"):
        cg.codebook_gemv(Fragments(to_fragments(x, 4), 4), codes[:f], cb[:f], 4, backend="torch")


# ---------------------------------------------------------------------------------------------- GPU
@gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M", [3, 4, 8, 9, 13, 16])
@pytest.mark.parametrize("N,K", [(256, 512), (4096, 4096), (336, 11008)])
def test_mma_gemv_on_fragments_is_bitwise_its_copy(bits, M, N, K):
    if K % (512 // bits):
        pytest.skip("not an mma width")
    if not cg.mma_available():
        pytest.skip("needs the CUDA kernels")
    g = torch.Generator().manual_seed(M * N + bits)
    codes = cg.tile_codes(torch.randint(0, 256, (N, K * bits // 8), generator=g, dtype=torch.uint8).cuda())
    cb = (0.05 * torch.randn(N, 1 << bits, generator=g)).half().cuda()
    x = torch.randn(M, K, generator=g).half().cuda()
    res = torch.randn(M, N, generator=g).half().cuda()
    assert cg.reads_fragments(M, bits, tiled=True) == bits
    for r in (None, res):
        a = cg.codebook_gemv(x, codes, cb, bits, r, tiled=True)
        b = cg.codebook_gemv(Fragments(to_fragments(x, bits), bits), codes, cb, bits, r, tiled=True)
        assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize("M", [3, 8, 16])
@pytest.mark.parametrize("f,K", [(128, 256), (11008, 4096)])
def test_mma_gate_up_writes_fragments_bitwise(M, f, K):
    if not cg.mma_available():
        pytest.skip("needs the CUDA kernels")
    g = torch.Generator().manual_seed(M + f)
    gc, gcb = _gate_up_weights(f, K, g, "cpu")
    codes, cb, _ = cg.interleave_gate_up(gc[:f], gcb[:f], gc[f:], gcb[f:])
    codes, cb = cg.tile_codes(codes.cuda()), cb.cuda()
    x = torch.randn(M, K, generator=g).half().cuda()
    ref = cg.codebook_gemv_gate_up(x, codes, cb, 4, f, tiled=True)
    for xin in (x, Fragments(to_fragments(x, 4), 4)):
        got = cg.codebook_gemv_gate_up(xin, codes, cb, 4, f, tiled=True, out_frag_bits=4)
        assert isinstance(got, Fragments) and torch.equal(got.data, to_fragments(ref, 4))


@gpu
def test_engine_verify_with_fragment_producers_is_bitwise_without():
    from trapetum.eval.random_model import random_checkpoint
    from trapetum.runtime.engine import GpuEngine
    from trapetum.settings import KernelOptions, Options
    ck = random_checkpoint("llama2-7b", "cb4", layers=2)
    logits = {}
    for on in (True, False):
        eng = GpuEngine(ck, 256, device="cuda", options=Options(kernels=KernelOptions(frag_producers=on)))
        eng.prefill(list(range(1, 41)))
        for m in (FRAG_ROWS, 8, 16):
            toks = torch.arange(100, 100 + m, device="cuda")
            logits[on, m] = eng.verify(toks, 40).clone()
    for m in (FRAG_ROWS, 8, 16):
        assert torch.equal(logits[True, m], logits[False, m]), m
