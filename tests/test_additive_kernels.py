"""Additive-codebook GEMV kernels (2x8 lookup table, 1x16 gather) vs the float64 reference.

CPU: Triton interpreter at small shapes; GPU: the same tests at real sizes (the CUDA kernels take the
fp16 calls they support, Triton the rest), the CUDA kernels forced over many random shapes, 100-run
determinism, CUDA graph vs eager."""
from __future__ import annotations

import importlib
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kernels_conftest import DEVICE, ON_GPU, TOL, rel_err, requires_cuda
from shapes import AWKWARD, gemv_shapes
import trapetum.kernels.additive_gemv as ag
from trapetum.quant.additive import AdditiveLinear, index_to_codes

if not ON_GPU:
    ag = importlib.reload(ag)  # pick up TRITON_INTERPRET=1 set by kernels_conftest

N_RANDOM = 210
LAYOUTS = [(2, 8), (1, 16), (2, 8), (1, 16), (1, 8), (3, 8), (4, 8)]


def _weights(n, g, M, nbits, gen, scale=0.05):
    K = 1 << nbits
    codes = index_to_codes(torch.randint(0, K, (n, g, M), generator=gen), nbits)
    cb = (torch.randn(M, K, 1, 8, generator=gen)).half()
    sc = (torch.rand(n, 1, 1, 1, generator=gen) * scale + 0.01).half()
    return codes.to(DEVICE), cb.to(DEVICE), sc.to(DEVICE)


def _case(seed):
    r = random.Random(seed)
    M, nbits = r.choice(LAYOUTS)
    T = r.choice([1, 1, 1, 2, 3, 8])
    if ON_GPU:
        g = r.choice([a for a in AWKWARD if a < 3000] + [r.randint(1, 1200)])
        n = r.choice(AWKWARD + [r.randint(1, 5000)])
    else:
        g = r.choice([1, 3, 7, 16, 17, r.randint(1, 40)])
        n = r.choice([1, 3, 53, 97, r.randint(1, 80)])
    dtype = r.choice([torch.float16, torch.float16, torch.float32])
    return M, nbits, T, g, n, dtype, r.random() < 0.3, r.random() < 0.3


@pytest.mark.parametrize("seed", range(N_RANDOM))
def test_random_shapes(seed):
    M, nbits, T, g, n, dtype, with_bias, with_res = _case(seed)
    gen = torch.Generator().manual_seed(seed)
    codes, cb, sc = _weights(n, g, M, nbits, gen)
    x = torch.randn(T, g * 8, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    res = torch.randn(T, n, generator=gen).to(dtype).to(DEVICE) if with_res else None
    y = ag.additive_gemv(x, codes, cb, sc, bias, res)
    ref = ag.additive_gemv_reference(x, codes, cb, sc, bias, res)
    assert y.dtype == dtype and y.shape == (T, n)
    err = rel_err(y, ref)
    assert err < TOL[dtype], f"{M}x{nbits} T={T} in={g * 8} out={n} {dtype}: rel err {err:.2e}"


def test_lut_matches_reference():
    gen = torch.Generator().manual_seed(1)
    codes, cb, sc = _weights(5, 13, 2, 8, gen)
    x = torch.randn(2, 13 * 8, generator=gen).half().to(DEVICE)
    ws = ag.AdditiveWorkspace(DEVICE, ag.workspace_need(codes, cb, rows=2))
    ag.additive_gemv(x, codes, cb, sc, workspace=ws, backend="triton")
    ref = ag.lut_reference(x, cb).reshape(-1)
    assert rel_err(ws.scratch[:ref.numel()], ref) < 1e-6


@pytest.mark.parametrize("M,nbits", [(2, 8), (1, 16)])
def test_bitwise_deterministic(M, nbits):
    runs = 100 if ON_GPU else 5
    gen = torch.Generator().manual_seed(7)
    n, g = (8192, 3584) if ON_GPU else (70, 33)
    codes, cb, sc = _weights(n, g, M, nbits, gen)
    x = torch.randn(1, g * 8, generator=gen).half().to(DEVICE)
    first = ag.additive_gemv(x, codes, cb, sc)
    for _ in range(runs - 1):
        assert torch.equal(ag.additive_gemv(x, codes, cb, sc), first)


def test_bad_shapes_raise():
    gen = torch.Generator().manual_seed(3)
    codes, cb, sc = _weights(10, 4, 2, 8, gen)
    x = torch.randn(1, 32).half().to(DEVICE)
    with pytest.raises(ValueError, match="last dimension"):
        ag.additive_gemv(torch.randn(1, 33).half().to(DEVICE), codes, cb, sc)
    with pytest.raises(ValueError, match="dtype"):
        ag.additive_gemv(x, codes.to(torch.int16), cb, sc)
    with pytest.raises(ValueError, match="scales"):
        ag.additive_gemv(x, codes, cb, sc[:5])
    with pytest.raises(ValueError, match="unsupported"):
        ag.additive_gemv(x, codes, cb.view(2, 256, 2, 4), sc)
    with pytest.raises(ValueError, match="codebooks per group"):
        ag.additive_gemv(x, codes[..., :1], cb, sc)
    with pytest.raises(ValueError, match="bias"):
        ag.additive_gemv(x, codes, cb, sc, torch.zeros(3).half().to(DEVICE))
    with pytest.raises(ValueError, match="residual"):
        ag.additive_gemv(x, codes, cb, sc, None, torch.zeros(1, 3).half().to(DEVICE))
    with pytest.raises(ValueError, match="backend"):
        ag.additive_gemv(x, codes, cb, sc, backend="mma")
    with pytest.raises(ValueError, match="workspace"):
        ag.additive_gemv(x, codes, cb, sc, workspace=ag.AdditiveWorkspace(DEVICE, 10))
    with pytest.raises(ValueError, match="cuda"):  # fp32 activations: the CUDA kernels take fp16
        ag.additive_gemv(x.float(), codes, cb, sc, backend="cuda")
    c1, cb1, sc1 = _weights(10, 4, 1, 8, gen)  # 1x8: Triton only
    with pytest.raises(ValueError, match="cuda"):
        ag.additive_gemv(x, c1, cb1, sc1, backend="cuda")
    with pytest.raises(ValueError, match="cuda"):  # 2x8 needs in % 64 == 0 on the CUDA path
        c3, cb3, sc3 = _weights(10, 3, 2, 8, gen)
        ag.additive_gemv(torch.randn(1, 24).half().to(DEVICE), c3, cb3, sc3, backend="cuda")
    assert ag.additive_linear(x, codes, cb.view(2, 256, 2, 4), sc) is None  # the module falls back


@requires_cuda
@pytest.mark.parametrize("model", ["llama-2-7b", "llama-2-70b", "qwen2.5-0.5b"])
@pytest.mark.parametrize("M,nbits", [(2, 8), (1, 16)])
def test_real_shapes_gpu(model, M, nbits):
    gen = torch.Generator().manual_seed(0)
    for k, n in gemv_shapes(model):
        codes, cb, sc = _weights(n, k // 8, M, nbits, gen)
        x = torch.randn(1, k, generator=gen).half().cuda()
        res = torch.randn(1, n, generator=gen).half().cuda()
        y = ag.additive_gemv(x, codes, cb, sc, None, res)
        assert rel_err(y, ag.additive_gemv_reference(x, codes, cb, sc, None, res)) < TOL[torch.float16]
        mod = AdditiveLinear(codes, cb, sc).cuda()
        assert rel_err(mod(x), mod.dequantize(torch.float64) @ x.double().T.reshape(-1)) < 2e-3


# ----------------------------------------------------------------------------- CUDA kernels (GPU only)
def _cuda_case(seed):
    r = random.Random(1000 + seed)
    M, nbits = r.choice([(2, 8), (1, 16)])
    T = r.choice([1, 1, 1, 2, 4]) if M == 2 else 1
    g = r.choice([8, 16, 24, 40, 136, 512, 1376, 8 * r.randint(1, 400)]) if M == 2 else r.choice(AWKWARD + [512, 1376])
    n = r.choice(AWKWARD + [8, 4096, r.randint(1, 6000)])
    return M, nbits, T, g, n, r.random() < 0.4, r.random() < 0.4


@requires_cuda
def test_cuda_extension_builds_gpu():
    assert ag.cuda_available() and ag._load_ext() is not None, ag._EXT_ERR


@requires_cuda
@pytest.mark.parametrize("seed", range(80))
def test_cuda_random_shapes_gpu(seed):
    M, nbits, T, g, n, with_bias, with_res = _cuda_case(seed)
    gen = torch.Generator().manual_seed(seed)
    codes, cb, sc = _weights(n, g, M, nbits, gen)
    x = torch.randn(T, g * 8, generator=gen).half().cuda()
    bias = torch.randn(n, generator=gen).half().cuda() if with_bias else None
    res = torch.randn(T, n, generator=gen).half().cuda() if with_res else None
    ws = ag.AdditiveWorkspace("cuda", ag.workspace_need(codes, cb, T))
    y = ag.additive_gemv(x, codes, cb, sc, bias, res, workspace=ws, backend="cuda")
    err = rel_err(y, ag.additive_gemv_reference(x, codes, cb, sc, bias, res))
    assert err < TOL[torch.float16], f"{M}x{nbits} T={T} in={g * 8} out={n}: rel err {err:.2e}"


@requires_cuda
@pytest.mark.parametrize("M,nbits", [(2, 8), (1, 16)])
def test_cuda_bitwise_deterministic_gpu(M, nbits, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    codes, cb, sc = _weights(28672, 1024, M, nbits, gen)
    x = torch.randn(1, 8192, generator=gen).half().cuda()
    bias, res = torch.randn(28672, generator=gen).half().cuda(), torch.randn(1, 28672, generator=gen).half().cuda()
    first = ag.additive_gemv(x, codes, cb, sc, bias, res, backend="cuda")
    for _ in range(99):
        assert torch.equal(ag.additive_gemv(x, codes, cb, sc, bias, res, backend="cuda"), first)
    if M == 2:  # the 2x8 sums do not depend on how the work is split between blocks
        for bps in ("1", "3"):
            monkeypatch.setenv("TRAPETUM_AQLM_BPS", bps)
            assert torch.equal(ag.additive_gemv(x, codes, cb, sc, bias, res, backend="cuda"), first)


@requires_cuda
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("M,nbits", [(2, 8), (1, 16)])
def test_cuda_graph_bitwise_gpu(M, nbits, backend):
    gen = torch.Generator().manual_seed(5)
    codes, cb, sc = _weights(4096, 512, M, nbits, gen)
    x = torch.randn(1, 4096, generator=gen).half().cuda()
    res = torch.randn(1, 4096, generator=gen).half().cuda()
    out = torch.empty(1, 4096, dtype=torch.float16, device="cuda")
    ws = ag.AdditiveWorkspace("cuda", ag.workspace_need(codes, cb))
    ag.additive_gemv(x, codes, cb, sc, None, res, out=out, workspace=ws, backend=backend)
    eager = out.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on a side stream, as before any capture
        ag.additive_gemv(x, codes, cb, sc, None, res, out=out, workspace=ws, backend=backend)
    torch.cuda.current_stream().wait_stream(s)
    g, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ag.additive_gemv(x, codes, cb, sc, None, res, out=out, workspace=ws, backend=backend)
    out2 = torch.empty_like(out)
    with torch.cuda.graph(g2):  # no workspace given: one is allocated inside the capture
        ag.additive_gemv(x, codes, cb, sc, None, res, out=out2, backend=backend)
    for _ in range(10):
        out.zero_()
        out2.zero_()
        g.replay()
        g2.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and torch.equal(out2, eager)
    assert rel_err(eager, ag.additive_gemv_reference(x, codes, cb, sc, None, res)) < TOL[torch.float16]


@requires_cuda
def test_tc0_forces_triton_gpu(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    codes, cb, sc = _weights(300, 64, 2, 8, gen)
    x = torch.randn(1, 512, generator=gen).half().cuda()
    y = torch.empty(1, 300, dtype=torch.float16, device="cuda")
    assert ag._cuda_refusal(x, codes, cb, sc, None, None, y) is None
    monkeypatch.setenv("TRAPETUM_TC", "0")
    assert ag._cuda_refusal(x, codes, cb, sc, None, None, y) is not None
    ref = ag.additive_gemv_reference(x, codes, cb, sc)
    assert rel_err(ag.additive_gemv(x, codes, cb, sc), ref) < TOL[torch.float16]


def test_engine_projection_mixed_parts():
    """runtime.projections: q/k/v-style group of additive parts (2x8 and 1x16 mixed), residual, prefill."""
    import trapetum.runtime.projections as P

    importlib.reload(P)
    gen = torch.Generator().manual_seed(11)
    mods = [AdditiveLinear(*[t.cpu() for t in _weights(n, 6, M, nb, gen)]) for n, M, nb in
            [(20, 2, 8), (9, 1, 16), (9, 2, 8)]]
    proj = P.make_proj(mods, DEVICE)
    assert isinstance(proj, P.AdditiveProj) and proj.out_features == 38
    x = torch.randn(48, generator=gen).half().to(DEVICE)
    res = torch.randn(38, generator=gen).half().to(DEVICE)
    out = torch.empty(38, dtype=torch.float16, device=DEVICE)
    proj.gemv(x, out, residual=res)
    W = torch.cat([m.dequantize(torch.float64) for m in mods]).to(DEVICE)
    assert rel_err(out, W @ x.double() + res.double()) < TOL[torch.float16]
    xs = torch.randn(5, 48, generator=gen).to(DEVICE)
    assert rel_err(proj.matmul(xs.half()), xs.double() @ W.T) < 2e-3


@requires_cuda
def test_engine_projection_packed_and_kill_switch_gpu(monkeypatch):
    """q/k/v-style 2x8 parts packed into one launch; TRAPETUM_TC=0 afterwards takes the per-part Triton
    path on unpacked codes (the switch is honoured after the engine was built); prefill unpacks."""
    import trapetum.runtime.projections as P

    gen = torch.Generator().manual_seed(12)
    mods = [AdditiveLinear(*[t.cpu() for t in _weights(n, 64, 2, 8, gen)]) for n in (512, 128, 128)]
    proj = P.make_proj(mods, "cuda")
    assert proj.packed is not None and proj.sources == mods
    x = torch.randn(512, generator=gen).half().cuda()
    res = torch.randn(768, generator=gen).half().cuda()
    W = torch.cat([m.dequantize(torch.float64) for m in mods]).cuda()
    ref = W @ x.double() + res.double()
    out = torch.empty(768, dtype=torch.float16, device="cuda")
    proj.gemv(x, out, residual=res)
    assert rel_err(out, ref) < TOL[torch.float16]
    monkeypatch.setenv("TRAPETUM_TC", "0")
    off = torch.empty_like(out)
    proj.gemv(x, off, residual=res)
    assert rel_err(off, ref) < TOL[torch.float16] and len(proj._unpacked) == 3
    monkeypatch.delenv("TRAPETUM_TC")
    xs = torch.randn(5, 512, generator=gen).cuda()
    assert rel_err(proj.matmul(xs.half()), xs.double() @ W.T) < 2e-3


_CUDA_SRC = Path(__file__).resolve().parents[1] / "trapetum" / "kernels" / "cuda"
_HOST_CHECK = Path(__file__).parent / "cuda" / "additive_2x8_host_check.cu"


def _nvcc():
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("needs nvcc")
    return nvcc


def _host_check_cmd(exe, kernel_src=None):
    """nvcc command building tests/cuda/additive_2x8_host_check.cu as host C++ (the 2x8 kernels run on the
    CPU), against the kernel source or an altered copy of it."""
    cmd = [_nvcc(), "-x", "c++", "-std=c++17", "-O2", "-I", str(_CUDA_SRC), "-o", str(exe), str(_HOST_CHECK)]
    if kernel_src is not None:
        cmd.insert(-1, f'-DTRAPETUM_AQLM_CU="{kernel_src}"')
    return cmd


@pytest.fixture(scope="module")
def host_check(tmp_path_factory):
    exe = tmp_path_factory.mktemp("host_check") / "check"
    r = subprocess.run(_host_check_cmd(exe), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return exe


def test_2x8_lane_maps_host(host_check):
    """The 2x8 CUDA kernels on the CPU (tests/cuda/additive_2x8_host_check.cu): lane maps (banks of every
    table store, lookup and ring read), then the kernels themselves, one coroutine per thread, with late
    cp.async landings, against float64, packed == canonical bitwise, grid-independent bits."""
    r = subprocess.run([str(host_check)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("all ok"), r.stdout[-3000:]


def test_pack_2x8_matches_kernel_lane_map(host_check):
    """pack_2x8's byte permutation of a 16-row unit is the kernel's packed_pos."""
    r = subprocess.run([str(host_check), "--packed-pos"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout[-2000:]
    assert [int(v) for v in r.stdout.split()] == ag._packed_pos().tolist()


# (name, text in additive_gemv.cu, replacement): each altered kernel must fail the host check
_MUTATIONS = [
    ("half_swap by row octet halves: canonical LDS.64 ring reads conflict",
     "return ((r >> 1) ^ (r >> 2)) & 1; }", "return (r >> 2) & 1; }"),
    ("tab_col XOR of the old map: lookup bank conflicts", "(p ^ (4 * (j >> 1)))", "(p ^ (8 * (j >> 1)))"),
    ("build stores without the half swap: build bank conflicts", "h = (t >> 1) ^ second;", "h = second;"),
    ("packed layout without the odd-chunk exchange", "return 512 * ((rr >> 3) ^ ((b >> 4) & 1))",
     "return 512 * (rr >> 3)"),
    ("transpose-reduce selects in the packed layout too", "const bool swap = !kPacked && odd;",
     "const bool swap = odd;"),
    ("waits for one group too few", "cp_async_wait<kRing - 1>();  // this unit's group has landed",
     "cp_async_wait<kRing>();"),
    ("the loop does not alternate its ring entries", "      entry ^= ring_toggle;\n", "\n"),
    ("steady loop refills canonical rows past N", "const int lim = kPacked ? gb : min(gb, P.N / kUnitRows);",
     "const int lim = gb;"),
    ("the last units' loop stops one unit early", "(max(0, gb - g + kWarps - 1) / kWarps)",
     "(max(0, gb - g) / kWarps)"),
    ("the last units' refills not checked against the segment end", "const bool ok = gc < gb && chunk_ok;",
     "const bool ok = chunk_ok;"),
    ("partials not padded to whole units", "t.floats += (long long)nslices * kUnitRows * P.groups;",
     "t.floats += (long long)nslices * P.N;"),
]


@pytest.mark.skipif(ON_GPU, reason="host-only (CPU) check; it runs in the CPU test session, not on device time")
def test_2x8_host_check_catches_mutations(tmp_path):
    """Each altered kernel (built and run concurrently) must fail the host check."""
    src = (_CUDA_SRC / "additive_gemv.cu").read_text()
    builds = []
    for i, (name, old, new) in enumerate(_MUTATIONS):
        assert src.count(old) == 1, f"mutation '{name}': its text is no longer in additive_gemv.cu once"
        d = tmp_path / f"m{i}"
        d.mkdir()
        (d / "additive_gemv.cu").write_text(src.replace(old, new))
        cmd = _host_check_cmd(d / "check", d / "additive_gemv.cu")
        builds.append((name, d, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    runs = []
    for name, d, proc in builds:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"mutation '{name}' does not build:\n{err[-2000:]}"
        runs.append((name, subprocess.Popen([str(d / "check"), "--quick"], stdout=subprocess.PIPE, text=True)))
    missed = []
    for name, proc in runs:
        out, _ = proc.communicate(timeout=600)
        if not (proc.returncode != 0 and ("FAIL" in out or proc.returncode < 0)):  # a FAIL line, or it crashed
            missed.append(f"{name}:\n{out[-1000:]}")
    assert not missed, "mutations not caught:\n" + "\n".join(missed)


# ----------------------------------------------------------------------------- packed 2x8 (one launch, several parts)
@pytest.mark.parametrize("n,g", [(1, 8), (13, 40), (64, 32), (9, 33), (100, 96), (16, 32), (17, 64)])
def test_pack_2x8_round_trip(n, g):
    """The kernel's "slices" layout holds every code byte once, zeros elsewhere, and unpacks exactly."""
    gen = torch.Generator().manual_seed(n * 1000 + g)
    codes, _, _ = _weights(n, g, 2, 8, gen)
    codes = codes.cpu()
    for layout in ag.LAYOUTS_2X8:
        buf = ag.pack_2x8(codes, layout)
        assert torch.equal(ag.unpack_2x8(buf, n, g, layout), codes)
        nbytes = -(-g // 32) * (-(-n // 16) * 16) * 64 if layout == "slices" else n * g * 2
        assert buf.dtype == torch.uint8 and buf.numel() == nbytes
    # slice 0, unit 0, in canonical row order through the permutation: row 0's first 64 code bytes
    packed = ag.pack_2x8(codes, "slices").view(-(-g // 32), -(-n // 16), 1024)
    unit = packed[0, 0, ag._packed_pos()].view(16, 64)
    assert torch.equal(unit[0, : min(64, 2 * g)], codes[0].reshape(-1)[:64].view(torch.uint8))
    assert int(packed.long().sum()) == int(codes.view(torch.uint8).long().sum())  # padding is zero


def test_packed_pos_is_the_lane_layout():
    """Lane (r, j) copies bytes 16 lane .. + 15 of slot e: chunk j of row 8 (e ^ (j & 1)) + r, halves
    swapped for rows 2..5 (independent of the host check: the layout the kernel's lanes assume)."""
    pos = ag._packed_pos().view(16, 64)
    assert sorted(pos.reshape(-1).tolist()) == list(range(1024))
    for rr in range(16):
        for b in range(64):
            e, within = divmod(int(pos[rr, b]), 512)
            lane, byte = divmod(within, 16)
            r, j = lane >> 2, lane & 3
            assert (rr, b // 16) == (8 * (e ^ (j & 1)) + r, j)
            assert byte == (b % 16) ^ (8 if r in (2, 3, 4, 5) else 0)


def test_2x8_workspace_and_meta():
    """Partial sums are padded to 16-row units; packed parts say so in the launcher meta (column 4)."""
    gen = torch.Generator().manual_seed(4)
    parts = [_weights(n, 40, 2, 8, gen) + (None,) for n in (17, 16, 1)]
    assert ag._need(20001, 8, 2, 256) == 20016  # one slice of 20,001 rows (the Triton tables take 4,096)
    for layout, flag in (("slices", 1), ("rows", 0)):
        p = ag.Packed2x8(parts, layout=layout)
        assert p.meta.shape == (3, 5) and p.meta[:, 4].tolist() == [flag] * 3
        assert p.need == 2 * (32 + 16 + 16)
        if layout == "slices":
            assert p.meta[:, 2].tolist() == [64] * 3 and p.meta[:, 3].tolist() == [2048, 1024, 1024]
        else:
            assert p.meta[:, 2].tolist() == [80] * 3 and p.meta[:, 3].tolist() == [64] * 3


def test_packed_2x8_bad_parts():
    gen = torch.Generator().manual_seed(3)
    a, b = _weights(16, 8, 2, 8, gen), _weights(16, 16, 2, 8, gen)
    with pytest.raises(ValueError, match="codes"):
        ag.Packed2x8([a + (None,), b + (None,)], layout="rows")
    with pytest.raises(ValueError, match="layout"):
        ag.Packed2x8([a + (None,)], layout="columns")
    with pytest.raises(ValueError, match="TRAPETUM_AQLM_LAYOUT"):
        import os
        os.environ["TRAPETUM_AQLM_LAYOUT"] = "diagonal"
        try:
            ag.layout_2x8()
        finally:
            del os.environ["TRAPETUM_AQLM_LAYOUT"]


@requires_cuda
@pytest.mark.parametrize("layout", ["slices", "rows"])
@pytest.mark.parametrize("seed", range(40))
def test_packed_2x8_parts_gpu(seed, layout):
    """1-4 parts of unequal rows in one launch (q/k/v, gate/up), with bias and residual, vs float64."""
    r = random.Random(seed)
    g = r.choice([8, 16, 24, 40, 64, 120, 512, 1024, r.randint(1, 400) * 8])
    rows = [r.choice([1, 7, 8, 9, 64, 100, 1024, r.randint(1, 3000)]) for _ in range(r.randint(1, 4))]
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for n in rows:
        codes, cb, sc = _weights(n, g, 2, 8, gen)
        bias = torch.randn(n, generator=gen).half().cuda() if r.random() < 0.3 else None
        parts.append((codes, cb, sc, bias))
    x = torch.randn(g * 8, generator=gen).half().cuda()
    res = torch.randn(sum(rows), generator=gen).half().cuda() if r.random() < 0.5 else None
    packed = ag.Packed2x8(parts, layout=layout)
    out = torch.empty(sum(rows), dtype=torch.float16, device="cuda")
    packed.gemv(x, out, res)
    ref = torch.cat([ag.additive_gemv_reference(x, *p) for p in parts])
    if res is not None:
        ref = ref + res.double()
    assert rel_err(out, ref) < TOL[torch.float16], (rows, g, layout)
    for i, (codes, _, _, _) in enumerate(parts):
        assert torch.equal(packed.canonical_codes(i), codes)
    first = out.clone()
    for _ in range(5):
        packed.gemv(x, out, res)
        assert torch.equal(out, first)
    # the same bits as one canonical launch per part (sums in the same order, whatever the split)
    lo = 0
    for codes, cb, sc, b in parts:
        n = codes.shape[0]
        y = ag.additive_gemv(x.view(1, -1), codes, cb, sc, b, None if res is None else res[lo:lo + n],
                             backend="cuda")
        assert torch.equal(y.view(-1), first[lo:lo + n])
        lo += n


@requires_cuda
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("layout", ["slices", "rows"])
@pytest.mark.parametrize("seed", range(6))
def test_packed_2x8_gate_up_gpu(seed, layout, act):
    """act(gate) * up in the reduction kernel: the same as act_mul on the pair's fp16 outputs (one fp16
    rounding apart at most), float64 agreement, bitwise repeatable; bad pairings are refused."""
    from trapetum.kernels.fused import act_mul, act_mul_reference
    r = random.Random(seed)
    g, n = r.choice([8, 64, 512, 1024]), r.choice([1, 17, 256, 1000, 11008])
    gen = torch.Generator().manual_seed(seed)
    parts = [_weights(n, g, 2, 8, gen) + ((torch.randn(n, generator=gen).half().cuda() if seed % 2 else None),)
             for _ in range(2)]
    x = torch.randn(g * 8, generator=gen).half().cuda()
    packed = ag.Packed2x8(parts, layout=layout)
    both = torch.empty(2 * n, dtype=torch.float16, device="cuda")
    packed.gemv(x, both)
    want = act_mul(both[:n], both[n:], act)
    out = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
    packed.gemv_gate_up(x, out, act)
    assert (out.float() - want.float()).abs().max() <= 2e-3 * want.float().abs().max() + 1e-6, (n, g, act)
    ref = act_mul_reference(*(ag.additive_gemv_reference(x, *p).view(-1).half() for p in parts), act)
    assert rel_err(out, ref) < TOL[torch.float16]
    first = out.clone()
    for _ in range(3):
        packed.gemv_gate_up(x, out, act)
        assert torch.equal(out, first)
    with pytest.raises(ValueError, match="act"):
        packed.gemv_gate_up(x, out, "relu")
    uneven = ag.Packed2x8([parts[0], _weights(n + 16, g, 2, 8, gen) + (None,)], layout=layout)
    with pytest.raises(ValueError, match="equal rows"):
        uneven.gemv_gate_up(x, out, act)


@requires_cuda
def test_packed_2x8_graph_and_bps_gpu(monkeypatch):
    gen = torch.Generator().manual_seed(11)
    parts = [_weights(n, 1024, 2, 8, gen) + (None,) for n in (8192, 1024, 1024)]
    x = torch.randn(8192, generator=gen).half().cuda()
    packed = ag.Packed2x8(parts, layout="slices")
    outs = []
    for bps in ("1", "2", "3"):
        monkeypatch.setenv("TRAPETUM_AQLM_BPS", bps)
        out = torch.empty(10240, dtype=torch.float16, device="cuda")
        packed.gemv(x, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    ws = ag.AdditiveWorkspace("cuda", packed.need)
    out = torch.empty(10240, dtype=torch.float16, device="cuda")
    packed.gemv(x, out, workspace=ws)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        packed.gemv(x, out, workspace=ws)
    for _ in range(10):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, outs[0])
