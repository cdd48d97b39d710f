"""The tensor-core 2x8 kernel (kernels/additive_mma.py, the "mma" aqlm_kernel option): its packed layout and option
on the CPU; on the GPU (skipped without CUDA) against the float64 reference over many shapes, M = 1..16, row
invariance bitwise, the engine's verify contract in that mode and the engine against its CPU reference."""
import pytest
import torch

from trapetum.errors import ConfigError
from trapetum.kernels.additive_layout import dequantize_aqlm, index_to_codes, pack_2x8_mma, unpack_2x8_mma
from trapetum.kernels.additive_mma import PackedMma2x8, mma_gemv_reference, mma_weight_reference
from trapetum.settings import KernelOptions, Options

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def rel(a, b):
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def part(N, G, gen, device="cpu", bias=False):
    codes = index_to_codes(torch.randint(0, 256, (N, G, 2), generator=gen), 8)
    cb = (torch.randn(2, 256, 1, 8, generator=gen) * 0.5).half()
    sc = (torch.rand(N, 1, 1, 1, generator=gen) * 0.05 + 0.01).half()
    b = (torch.randn(N, generator=gen) * 0.1).half() if bias else None
    return tuple(t.to(device) if t is not None else None for t in (codes, cb, sc, b))


# ----------------------------------------------------------------------------- CPU: layout, references, option
@pytest.mark.parametrize("N,G", [(1, 8), (3, 16), (53, 24), (97, 8), (257, 40)])
def test_pack_roundtrip_and_positions(N, G):
    gen = torch.Generator().manual_seed(N * G)
    codes = index_to_codes(torch.randint(0, 256, (N, G, 2), generator=gen), 8)
    buf = pack_2x8_mma(codes)
    tiles = -(-N // 32)
    assert buf.dtype == torch.uint8 and buf.numel() == tiles * 32 * G * 2
    assert torch.equal(unpack_2x8_mma(buf, N, G), codes)
    v = buf.view(tiles, G // 8, 32, 16)  # [tile][chunk][lane 4 g + t][byte 8 s + 2 h + m]
    for _ in range(64):
        T, c, g, t, s, h, m = (int(torch.randint(0, n, (1,), generator=gen)) for n in (tiles, G // 8, 8, 4, 2, 4, 2))
        r = 32 * T + g + 8 * h
        want = (int(codes[r, 8 * c + 4 * s + t, m]) & 255) if r < N else 0
        assert int(v[T, c, 4 * g + t, 8 * s + 2 * h + m]) == want


def test_pack_rejects_bad_codes():
    with pytest.raises(ValueError, match="codes"):
        pack_2x8_mma(torch.zeros(4, 12, 2, dtype=torch.int8))  # G % 8 != 0
    with pytest.raises(ValueError, match="codes"):
        pack_2x8_mma(torch.zeros(4, 8, 2, dtype=torch.int16))
    with pytest.raises(ValueError, match="buf"):
        unpack_2x8_mma(torch.zeros(10, dtype=torch.uint8), 4, 8)


def test_weight_reference_is_the_dequantization_rounded_once():
    gen = torch.Generator().manual_seed(1)
    codes, cb, sc, _ = part(53, 16, gen)
    w = mma_weight_reference(codes, cb, sc)
    exact = dequantize_aqlm(codes, cb, sc, torch.float64)
    assert 0 < rel(w, exact) < 2e-3  # one fp16 rounding of the codebook sum
    # the sum itself is an fp16 value: dividing out the scale gives fp16-representable numbers
    s = sc.reshape(-1, 1).double()
    summed = w / s
    assert torch.allclose(summed, summed.half().double(), rtol=1e-6, atol=0)


def test_option_parsing():
    assert KernelOptions().aqlm_kernel == "table"
    assert Options().replace(kernels={"aqlm_kernel": "mma"}).kernels.aqlm_kernel == "mma"
    with pytest.raises(ConfigError, match="aqlm_kernel"):
        KernelOptions(aqlm_kernel="fast")
    assert Options.from_env({"TRAPETUM_AQLM_KERNEL": "mma"}).kernels.aqlm_kernel == "table"  # no variable


def test_packed_shape_errors():
    gen = torch.Generator().manual_seed(2)
    p = part(40, 16, gen)
    with pytest.raises(ValueError, match="parts"):
        PackedMma2x8([p] * 5, tiles_per_block=1)
    with pytest.raises(ValueError, match="parts"):
        PackedMma2x8([p, part(40, 8, gen)], tiles_per_block=1)
    with pytest.raises(ValueError, match="parts"):
        PackedMma2x8([part(40, 12, gen)], tiles_per_block=1)
    with pytest.raises(ValueError, match="tiles_per_block"):
        PackedMma2x8([p], tiles_per_block=0)
    pk = PackedMma2x8([p], tiles_per_block=1)
    assert torch.equal(pk.canonical_codes(0), p[0])
    with pytest.raises(ValueError, match="x"):
        pk.gemv(torch.zeros(2, 64, dtype=torch.float16), torch.zeros(2, 40, dtype=torch.float16))
    with pytest.raises(ValueError, match="out"):
        pk.gemv(torch.zeros(2, 128, dtype=torch.float16), torch.zeros(2, 41, dtype=torch.float16))
    with pytest.raises(ValueError, match="fp16"):
        pk.gemv(torch.zeros(2, 128), torch.zeros(2, 40))
    assert not pk.fuses_gate_up()
    with pytest.raises(ValueError, match="out"):
        PackedMma2x8([p, p], tiles_per_block=1).gemv_planes(torch.zeros(2, 128, dtype=torch.float16),
                                                          torch.zeros(2, 2, 41, dtype=torch.float16))
    with pytest.raises(ValueError, match="equal rows"):
        PackedMma2x8([p, part(8, 16, gen)], tiles_per_block=1).gemv_planes(
            torch.zeros(2, 128, dtype=torch.float16), torch.zeros(2, 2, 40, dtype=torch.float16))


def test_projection_without_the_kernel_keeps_the_fallback():
    """The option on a machine without the kernel (here: the CPU): the projection runs its Triton / torch path."""
    from trapetum.schemes.aqlm import AdditiveLinear, AdditiveProjection
    gen = torch.Generator().manual_seed(3)
    codes, cb, sc, _ = part(40, 8, gen)
    kopts = KernelOptions(aqlm_kernel="mma")
    proj = AdditiveProjection([AdditiveLinear(codes, cb, sc)], "cpu", kopts)
    assert proj.mma is None
    if not CUDA:
        return
    proj = AdditiveProjection([AdditiveLinear(codes, cb, sc)], "cuda", kopts)
    assert proj.mma is not None and proj.packed is None


# ----------------------------------------------------------------------------- GPU: the kernel
@gpu
@pytest.mark.parametrize("N,G", [(1, 8), (3, 16), (53, 24), (97, 8), (257, 40), (1000, 64), (4096, 512)])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 9, 13, 16, 17])
def test_mma_gemv_matches_float64(N, G, M):
    gen = torch.Generator().manual_seed(N + 7 * G + M)
    p = part(N, G, gen, "cuda", bias=N % 2 == 1)
    pk = PackedMma2x8([p])
    x = torch.randn(M, 8 * G, generator=gen).half().cuda()
    res = torch.randn(M, N, generator=gen).half().cuda()
    out = torch.empty(M, N, dtype=torch.float16, device="cuda")
    pk.gemv(x, out, res)
    assert rel(out, mma_gemv_reference(x, [p], res)) < 2e-3
    from trapetum.kernels.additive_gemv import additive_gemv_reference
    assert rel(out, additive_gemv_reference(x, *p, residual=res)) < 4e-3


@gpu
@pytest.mark.parametrize("rows", [[64, 32, 32], [53, 97], [300, 300], [16, 8, 8, 40]])
@pytest.mark.parametrize("tpb", [None, 1, 3])
def test_mma_parts_in_one_launch(rows, tpb):
    gen = torch.Generator().manual_seed(sum(rows))
    G = 32
    parts = [part(n, G, gen, "cuda", bias=i == 1) for i, n in enumerate(rows)]
    pk = PackedMma2x8(parts, tiles_per_block=tpb)
    for M in (1, 4, 16):
        x = torch.randn(M, 8 * G, generator=gen).half().cuda()
        out = torch.empty(M, sum(rows), dtype=torch.float16, device="cuda")
        pk.gemv(x, out)
        assert rel(out, mma_gemv_reference(x, parts)) < 2e-3


@gpu
@pytest.mark.parametrize("N,G", [(97, 24), (4096, 512), (11008, 512)])
def test_mma_rows_are_one_row_calls_bitwise(N, G):
    gen = torch.Generator().manual_seed(N)
    p = part(N, G, gen, "cuda", bias=True)
    pk = PackedMma2x8([p])
    one = {}
    x = torch.randn(16, 8 * G, generator=gen).half().cuda()
    res = torch.randn(16, N, generator=gen).half().cuda()
    for t in range(16):
        y = torch.empty(1, N, dtype=torch.float16, device="cuda")
        one[t] = pk.gemv(x[t:t + 1], y, res[t:t + 1]).clone()
    for M in range(1, 17):
        for trial in range(2):  # the other rows hold other data
            xs = x[:M].clone()
            rs = res[:M].clone()
            t = int(torch.randint(0, M, (1,), generator=gen))
            keep = torch.arange(M) == t
            xs[~keep] = torch.randn(int((~keep).sum()), 8 * G, generator=gen).half().cuda()
            rs[~keep] = torch.randn(int((~keep).sum()), N, generator=gen).half().cuda()
            y = torch.empty(M, N, dtype=torch.float16, device="cuda")
            pk.gemv(xs, y, rs)
            assert torch.equal(y[t:t + 1], one[t]), (M, t)
            if M == 16:  # every row of a full call
                y2 = pk.gemv(x, torch.empty(16, N, dtype=torch.float16, device="cuda"), res)
                assert all(torch.equal(y2[r:r + 1], one[r]) for r in range(16))


@gpu
@pytest.mark.parametrize("M", [1, 3, 8, 16, 19])
def test_mma_planes_are_gemv_columns_bitwise(M):
    gen = torch.Generator().manual_seed(M)
    parts = [part(300, 64, gen, "cuda", bias=i == 0) for i in range(2)]
    pk = PackedMma2x8(parts)
    x = torch.randn(M, 512, generator=gen).half().cuda()
    cols = pk.gemv(x, torch.empty(M, 600, dtype=torch.float16, device="cuda"))
    planes = pk.gemv_planes(x, torch.empty(2, M, 300, dtype=torch.float16, device="cuda"))
    assert torch.equal(planes[0], cols[:, :300]) and torch.equal(planes[1], cols[:, 300:])


# ----------------------------------------------------------------------------- GPU: the engine in "mma" mode
@gpu
@pytest.mark.parametrize("variant", [{}, {"fuse": False}])
def test_engine_verify_rows_are_decode_steps_mma(variant):
    from trapetum.eval.verify_exact import check, engine
    opts = Options().replace(kernels={"aqlm_kernel": "mma"}, **variant)
    eng = engine("aqlm-2x8", opts)
    qkv = [L.attention.qkv for L in eng.model.layers]
    parts = [q for p in qkv for q in getattr(p, "parts", [p])]  # unfused: a ConcatProjection of q, k, v
    assert any(getattr(p, "mma", None) is not None for p in qkv + parts)
    res = check(eng, rows=(1, 2, 4, 8, 16), bases=(6, 56, 1016))
    assert len(res) == 15
    bad = [r for r in res if not r["ok"]]
    assert not bad, bad


@gpu
def test_engine_mma_matches_its_reference(tmp_path):
    from tests.tiny_models import additive_checkpoint
    from trapetum.models.decoder import Decoder
    from trapetum.runtime.engine import GpuEngine
    from trapetum.schemes.aqlm import MmaGateUp
    ck = additive_checkpoint("llama3", tmp_path / "src")
    eng = GpuEngine(ck, 64, options=Options().replace(kernels={"aqlm_kernel": "mma"}))
    assert any(getattr(L.attention.qkv, "mma", None) is not None for L in eng.model.layers)
    assert any(isinstance(getattr(L.mlp, "gate_up", None), MmaGateUp) for L in eng.model.layers)
    ref = Decoder.from_checkpoint(ck, dtype=torch.float32, device="cuda")
    ids = list(range(5, 21))
    want = ref(torch.tensor([ids], device="cuda"))[0]
    eng.prefill(ids[:-1])
    eng.set_position(ids[-1], len(ids) - 1)
    eng.step(greedy=False)
    assert rel(eng.logits, want[-1]) < 3e-3
    rows = eng.verify(torch.tensor(ids[-4:], device="cuda"), len(ids) - 4)
    assert rel(rows[-1], want[-1]) < 3e-3


def test_cli_flag_reaches_the_options():
    import argparse

    from trapetum.commands._common import add_kernel_options, options_of
    p = argparse.ArgumentParser()
    add_kernel_options(p)
    assert options_of(p.parse_args([])) is None
    assert options_of(p.parse_args(["--aqlm-kernel", "mma"])).kernels.aqlm_kernel == "mma"
    with pytest.raises(SystemExit):
        p.parse_args(["--aqlm-kernel", "fast"])


def _lane_model_gemv(x, codes, cb, sc):
    """additive_mma.cu's data flow in float64 (its lane map, code bytes, k permutation and PTX fragment layout of
    mma.m16n8k16: a0 = A[g][2t..], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]; b0 = B[2t..][g],
    b1 = B[2t+8..][g]; D[g][2t, 2t+1], D[g+8][2t, 2t+1]), read from the packed buffer."""
    N, G, _ = codes.shape
    M = x.shape[0]
    buf = pack_2x8_mma(codes).view(-1, G // 8, 32, 16).to(torch.int64)
    C = cb.reshape(2, 256, 8).double()
    xs = x.double().view(M, G, 8)
    y = torch.zeros(M, buf.shape[0] * 32, dtype=torch.float64)
    for tile in range(buf.shape[0]):
        for c in range(G // 8):
            for s in range(2):
                for a in range(2):
                    for j in range(2):
                        A = torch.zeros(16, 16, dtype=torch.float64)
                        B = torch.zeros(16, 8, dtype=torch.float64)
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            q = buf[tile, c, lane]
                            grp = 8 * c + 4 * s + t
                            for e in range(4):
                                u, b = 2 * j + (e >> 1), e & 1
                                w = (u + t) & 3
                                c0, c1 = int(q[4 * (2 * s + a) + 2 * b]), int(q[4 * (2 * s + a) + 2 * b + 1])
                                pair = (C[0, c0, 2 * w:2 * w + 2] + C[1, c1, 2 * w:2 * w + 2]).half().double()
                                kk = 2 * t + 8 * (e >> 1)
                                A[g + 8 * b, kk:kk + 2] = pair
                            for h in range(2):  # b0, b1: k 2t + 8 h <- x word (2j + h + t) & 3 of row g
                                w = (2 * j + h + t) & 3
                                if g < M:
                                    B[2 * t + 8 * h:2 * t + 8 * h + 2, g] = xs[g, grp, 2 * w:2 * w + 2]
                        D = A @ B  # rows 16 a + (0..15) of the tile, activation rows 0..7
                        r0 = tile * 32 + 16 * a
                        y[:, r0:r0 + 16] += D[:, :M].T
    return y[:, :N] * sc.reshape(1, N).double()


@pytest.mark.parametrize("N,G,M", [(40, 16, 3), (7, 8, 1), (33, 24, 8)])
def test_lane_model_of_the_kernel_is_the_gemv(N, G, M):
    gen = torch.Generator().manual_seed(N * G + M)
    codes, cb, sc, _ = part(N, G, gen)
    x = torch.randn(M, 8 * G, generator=gen).half()
    want = mma_gemv_reference(x, [(codes, cb, sc, None)])
    assert torch.allclose(_lane_model_gemv(x, codes, cb, sc), want, rtol=1e-9, atol=1e-9)
