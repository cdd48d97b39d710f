"""Additive-codebook GEMV kernels (2x8 lookup table, 1x16 gather) vs the float64 reference, and batch invariance.

CPU: Triton interpreter at small shapes; GPU: the same tests at real sizes (the CUDA kernels take the
fp16 calls they support, Triton the rest), the CUDA kernels forced over many random shapes, 100-run
determinism, CUDA graph vs eager, and every row of an M-row call (M = 1..16) bitwise the M = 1 call."""
from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kernels_conftest import DEVICE, ON_GPU, TOL, rel_err, requires_cuda
from shapes import AWKWARD, gemv_shapes
import trapetum.kernels.additive_gemv as ag
import trapetum.kernels.additive_layout as L
from trapetum.errors import ConfigError
from trapetum.kernels.additive_layout import index_to_codes
from trapetum.schemes.aqlm import AdditiveLinear, AdditiveProjection
from trapetum.settings import KernelOptions, Options

N_RANDOM = 210
LAYOUTS = [(2, 8), (1, 16), (2, 8), (1, 16), (1, 8), (3, 8), (4, 8)]
TRITON_ONLY = KernelOptions(cuda=False)


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


def _rows_problem(seed, M, nbits, T, n, g, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    codes, cb, sc = _weights(n, g, M, nbits, gen)
    x = (torch.randn(T, g * 8, generator=gen) * 3).to(dtype).to(DEVICE)  # rows of unlike magnitudes
    x[T // 2] *= 100
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    res = torch.randn(T, n, generator=gen).to(dtype).to(DEVICE)
    return codes, cb, sc, x, bias, res


def _assert_rows_invariant(call, x, res, what):
    """Each row of call(x, res) is bitwise call(x[t:t+1], res[t:t+1])."""
    y = call(x, res)
    for t in range(x.shape[0]):
        one = call(x[t:t + 1].clone(), None if res is None else res[t:t + 1].clone())
        assert torch.equal(y[t:t + 1], one), f"{what}: row {t} of {x.shape[0]} differs from its one-row call"
    return y


@pytest.mark.parametrize("M,nbits,n,g,every_T", [(2, 8, 53, 17, False), (1, 16, 97, 3, True),
                                                 pytest.param(2, 8, 257, 8, False, marks=pytest.mark.slow),
                                                 pytest.param(2, 8, 9, 2, True, marks=pytest.mark.slow),
                                                 (1, 16, 3, 40, False),
                                                 pytest.param(4, 8, 1, 7, False, marks=pytest.mark.slow),
                                                 (1, 8, 20, 1, False)])  # slow: 18-40 s each on the CPU
def test_rows_batch_invariant(M, nbits, n, g, every_T):
    """Every row of a T-row call (T = 1..16, rows of unlike magnitudes, bias and residual) has exactly the bits
    of the call with that row alone: Triton here (CPU interpreter), the backend the call picks on the GPU."""
    for T in (range(1, 17) if ON_GPU or every_T else (1, 2, 3, 5, 16)):
        codes, cb, sc, x, bias, res = _rows_problem(T * 31 + n, M, nbits, T, n, g)
        for b, r in ((bias, res), (None, None)):
            y = _assert_rows_invariant(lambda xx, rr: ag.additive_gemv(xx, codes, cb, sc, b, rr), x, r,
                                       f"{M}x{nbits} T={T}")
            assert rel_err(y, ag.additive_gemv_reference(x, codes, cb, sc, b, r)) < TOL[torch.float16]


def test_triton_rows_past_the_table_chunk():
    """More rows than the Triton lookup-table chunk (4) and a workspace sized by workspace_need(rows=16)."""
    codes, cb, sc, x, bias, res = _rows_problem(5, 2, 8, 11, 29, 9)
    ws = ag.AdditiveWorkspace(DEVICE, ag.workspace_need(codes, cb, rows=16))
    assert ag.workspace_need(codes, cb, rows=16, backend="triton") == 4 * 9 * 2 * 256
    assert ag.workspace_need(codes, cb, rows=16, backend="cuda") == 16 * 1 * 32
    y = ag.additive_gemv(x, codes, cb, sc, bias, res, workspace=ws, backend="triton")
    assert rel_err(y, ag.additive_gemv_reference(x, codes, cb, sc, bias, res)) < TOL[torch.float16]
    for t in (0, 4, 10):
        assert torch.equal(y[t:t + 1], ag.additive_gemv(x[t:t + 1], codes, cb, sc, bias, res[t:t + 1], workspace=ws,
                                                       backend="triton"))


def test_bad_shapes_raise():
    gen = torch.Generator().manual_seed(3)
    codes, cb, sc = _weights(10, 4, 2, 8, gen)
    c1, cb1, sc1 = _weights(10, 4, 1, 8, gen)  # 1x8: Triton only
    c3, cb3, sc3 = _weights(10, 3, 2, 8, gen)  # in 24: the 2x8 CUDA kernel needs in % 64 == 0
    x = torch.randn(1, 32).half().to(DEVICE)
    h = lambda *shape: torch.zeros(*shape).half().to(DEVICE)  # noqa: E731
    cases = [
        ("last dimension", lambda: ag.additive_gemv(torch.randn(1, 33).half().to(DEVICE), codes, cb, sc)),
        ("dtype", lambda: ag.additive_gemv(x, codes.to(torch.int16), cb, sc)),
        ("scales", lambda: ag.additive_gemv(x, codes, cb, sc[:5])),
        ("unsupported", lambda: ag.additive_gemv(x, codes, cb.view(2, 256, 2, 4), sc)),
        ("codebooks per group", lambda: ag.additive_gemv(x, codes[..., :1], cb, sc)),
        ("bias", lambda: ag.additive_gemv(x, codes, cb, sc, h(3))),
        ("residual", lambda: ag.additive_gemv(x, codes, cb, sc, None, h(1, 3))),
        ("out", lambda: ag.additive_gemv(x, codes, cb, sc, out=h(2, 10))),
        ("backend", lambda: ag.additive_gemv(x, codes, cb, sc, backend="mma")),
        ("block_r", lambda: ag.additive_gemv(x, codes, cb, sc, block_r=48)),
        ("workspace", lambda: ag.additive_gemv(x, codes, cb, sc, workspace=ag.AdditiveWorkspace(DEVICE, 10))),
        ("backend", lambda: ag.workspace_need(codes, cb, backend="rows")),
        ("rows", lambda: ag.workspace_need(codes, cb, rows=0)),
        ("cuda", lambda: ag.additive_gemv(x.float(), codes, cb, sc, backend="cuda")),  # the CUDA kernels take fp16
        ("cuda", lambda: ag.additive_gemv(x, codes, cb, sc, backend="cuda", kopts=TRITON_ONLY)),  # switched off
        ("cuda", lambda: ag.additive_gemv(x, c1, cb1, sc1, backend="cuda")),
        ("cuda", lambda: ag.additive_gemv(torch.randn(1, 24).half().to(DEVICE), c3, cb3, sc3, backend="cuda")),
    ]
    for match, call in cases:
        with pytest.raises(ValueError, match=match):
            call()
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
        y1 = ag.additive_linear(x, mod.codes, mod.codebooks, mod.scales)
        assert rel_err(y1, mod.dequantize(torch.float64) @ x.double().T.reshape(-1)) < 2e-3


# ----------------------------------------------------------------------------- CUDA kernels (GPU only)
def _cuda_case(seed):
    r = random.Random(1000 + seed)
    M, nbits = r.choice([(2, 8), (1, 16)])
    T = r.choice([1, 1, 1, 2, 4, 7, 16, 19])
    g = r.choice([8, 16, 24, 40, 136, 512, 1376, 8 * r.randint(1, 400)]) if M == 2 else r.choice(AWKWARD + [512, 1376])
    n = r.choice(AWKWARD + [8, 4096, r.randint(1, 6000)])
    return M, nbits, T, g, n, r.random() < 0.4, r.random() < 0.4


@requires_cuda
def test_cuda_extension_builds_gpu():
    assert ag.cuda_available() and ag.EXT.load() is not None, ag.EXT.error()
    assert not ag.cuda_available(kopts=TRITON_ONLY)


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
    for t in {0, T - 1}:  # rows of a multi-row launch (and of a second launch past 16) are the one-row bits
        one = ag.additive_gemv(x[t:t + 1], codes, cb, sc, bias, None if res is None else res[t:t + 1], backend="cuda")
        assert torch.equal(y[t:t + 1], one), (M, T, t)


@requires_cuda
@pytest.mark.parametrize("M,nbits", [(2, 8), (1, 16)])
def test_cuda_bitwise_deterministic_gpu(M, nbits):
    gen = torch.Generator().manual_seed(9)
    codes, cb, sc = _weights(28672, 1024, M, nbits, gen)
    x = torch.randn(1, 8192, generator=gen).half().cuda()
    bias, res = torch.randn(28672, generator=gen).half().cuda(), torch.randn(1, 28672, generator=gen).half().cuda()
    first = ag.additive_gemv(x, codes, cb, sc, bias, res, backend="cuda")
    for _ in range(99):
        assert torch.equal(ag.additive_gemv(x, codes, cb, sc, bias, res, backend="cuda"), first)
    if M == 2:  # the 2x8 sums do not depend on how the work is split between blocks
        for bps in (1, 3):
            k = KernelOptions(aqlm_blocks_per_sm=bps)
            assert torch.equal(ag.additive_gemv(x, codes, cb, sc, bias, res, backend="cuda", kopts=k), first)
    for pdl in ("off", "all"):
        k = KernelOptions(pdl=pdl)
        assert torch.equal(ag.additive_gemv(x, codes, cb, sc, bias, res, backend="cuda", kopts=k), first)


def _graph_equal_eager(call, outs, reps=10):
    """call() captured in a CUDA graph (after a side-stream warm-up) replays to the eager outputs."""
    call()
    torch.cuda.synchronize()
    eager = [o.clone() for o in outs]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on a side stream, as before any capture
        call()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for _ in range(reps):
        for o in outs:
            o.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, e) for o, e in zip(outs, eager))
    return eager


@requires_cuda
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("M,nbits", [(2, 8), (1, 16)])
def test_cuda_graph_bitwise_gpu(M, nbits, backend, T):
    gen = torch.Generator().manual_seed(5)
    codes, cb, sc = _weights(4096, 512, M, nbits, gen)
    x = torch.randn(T, 4096, generator=gen).half().cuda()
    res = torch.randn(T, 4096, generator=gen).half().cuda()
    out = torch.empty(T, 4096, dtype=torch.float16, device="cuda")
    out2 = torch.empty_like(out)
    ws = ag.AdditiveWorkspace("cuda", ag.workspace_need(codes, cb, T))

    def call():
        ag.additive_gemv(x, codes, cb, sc, None, res, out=out, workspace=ws, backend=backend)
        ag.additive_gemv(x, codes, cb, sc, None, res, out=out2, backend=backend)  # in a capture: its own workspace
    eager = _graph_equal_eager(call, [out, out2])
    assert torch.equal(eager[0], eager[1])
    assert rel_err(eager[0], ag.additive_gemv_reference(x, codes, cb, sc, None, res)) < TOL[torch.float16]


@requires_cuda
def test_tc0_forces_triton_gpu():
    gen = torch.Generator().manual_seed(6)
    codes, cb, sc = _weights(300, 64, 2, 8, gen)
    x = torch.randn(1, 512, generator=gen).half().cuda()
    y = torch.empty(1, 300, dtype=torch.float16, device="cuda")
    assert ag._cuda_refusal(x, codes, cb, sc, None, y, KernelOptions()) is None
    assert ag._cuda_refusal(x, codes, cb, sc, None, y, Options.from_env({"TRAPETUM_TC": "0"}).kernels) is not None
    ref = ag.additive_gemv_reference(x, codes, cb, sc)
    assert rel_err(ag.additive_gemv(x, codes, cb, sc, kopts=TRITON_ONLY), ref) < TOL[torch.float16]


def test_engine_projection_mixed_parts():
    """schemes.aqlm.AdditiveProjection: q/k/v-style group of additive parts (2x8 and 1x16 mixed), M rows with
    residual (each row its one-row bits), prefill."""
    gen = torch.Generator().manual_seed(11)
    mods = [AdditiveLinear(*[t.cpu() for t in _weights(n, 6, M, nb, gen)]) for n, M, nb in
            [(20, 2, 8), (9, 1, 16), (9, 2, 8)]]
    proj = AdditiveProjection(mods, DEVICE)
    assert proj.out_features == 38
    x = torch.randn(3, 48, generator=gen).half().to(DEVICE)
    res = torch.randn(3, 38, generator=gen).half().to(DEVICE)
    W = torch.cat([m.dequantize(torch.float64) for m in mods]).to(DEVICE)

    def call(xx, rr):
        out = torch.empty(xx.shape[0], 38, dtype=torch.float16, device=DEVICE)
        return proj.gemv(xx, out, residual=rr)
    out = _assert_rows_invariant(call, x, res, "mixed parts")
    assert rel_err(out, x.double() @ W.T + res.double()) < TOL[torch.float16]
    xs = torch.randn(5, 48, generator=gen).to(DEVICE)
    assert rel_err(proj.matmul(xs.half()), xs.double() @ W.T) < 2e-3


@requires_cuda
@pytest.mark.parametrize("layout", ["slices", "rows"])
def test_engine_projection_packed_and_kill_switch_gpu(layout):
    """q/k/v-style 2x8 parts packed into one launch; built with the CUDA kernels off, the same projection takes
    the per-part Triton path on canonical codes; prefill unpacks."""
    gen = torch.Generator().manual_seed(12)
    mods = [AdditiveLinear(*[t.cpu() for t in _weights(n, 64, 2, 8, gen)]) for n in (512, 128, 128)]
    proj = AdditiveProjection(mods, "cuda", KernelOptions(aqlm_layout=layout))
    assert proj.packed is not None and proj.packed.layout == layout
    x = torch.randn(4, 512, generator=gen).half().cuda()
    res = torch.randn(4, 768, generator=gen).half().cuda()
    W = torch.cat([m.dequantize(torch.float64) for m in mods]).cuda()
    ref = x.double() @ W.T + res.double()
    out = torch.empty(4, 768, dtype=torch.float16, device="cuda")
    proj.gemv(x, out, residual=res)
    assert rel_err(out, ref) < TOL[torch.float16]
    off = AdditiveProjection(mods, "cuda", TRITON_ONLY)
    assert off.packed is None
    out2 = torch.empty_like(out)
    off.gemv(x, out2, residual=res)
    assert rel_err(out2, ref) < TOL[torch.float16]
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
    assert [int(v) for v in r.stdout.split()] == L.packed_pos().tolist()


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
    ("every activation row's table built from row 0", "const half* const x = p.x + (size_t)t * 8 * p.G;",
     "const half* const x = p.x;"),
    ("code ranges split as if there were one activation row", "nb = gridDim.x / (unsigned)p.rows;",
     "nb = gridDim.x;"),
    ("the reduction reads row 0's partial sums for every row",
     "const float* const partial = p.partial + (size_t)t * p.floats;\n  half* const y",
     "const float* const partial = p.partial;\n  half* const y"),
]


@pytest.mark.skipif(ON_GPU, reason="host-only (CPU) check; it runs in the CPU test session, not on device time")
@pytest.mark.slow  # 31 s of nvcc/g++ builds of mutated kernels; the host check itself stays in the default tier
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
    for layout in L.LAYOUTS_2X8:
        buf = L.pack_2x8(codes, layout)
        assert torch.equal(L.unpack_2x8(buf, n, g, layout), codes)
        nbytes = -(-g // 32) * (-(-n // 16) * 16) * 64 if layout == "slices" else n * g * 2
        assert buf.dtype == torch.uint8 and buf.numel() == nbytes
    # slice 0, unit 0, in canonical row order through the permutation: row 0's first 64 code bytes
    packed = L.pack_2x8(codes, "slices").view(-(-g // 32), -(-n // 16), 1024)
    unit = packed[0, 0, L.packed_pos()].view(16, 64)
    assert torch.equal(unit[0, : min(64, 2 * g)], codes[0].reshape(-1)[:64].view(torch.uint8))
    assert int(packed.long().sum()) == int(codes.view(torch.uint8).long().sum())  # padding is zero
    with pytest.raises(ValueError, match="layout"):
        L.pack_2x8(codes, "columns")
    with pytest.raises(ValueError, match="codes"):
        L.pack_2x8(codes.to(torch.int16))


def test_packed_pos_is_the_lane_layout():
    """Lane (r, j) copies bytes 16 lane .. + 15 of slot e: chunk j of row 8 (e ^ (j & 1)) + r, halves
    swapped for rows 2..5 (independent of the host check: the layout the kernel's lanes assume)."""
    pos = L.packed_pos().view(16, 64)
    assert sorted(pos.reshape(-1).tolist()) == list(range(1024))
    for rr in range(16):
        for b in range(64):
            e, within = divmod(int(pos[rr, b]), 512)
            lane, byte = divmod(within, 16)
            r, j = lane >> 2, lane & 3
            assert (rr, b // 16) == (8 * (e ^ (j & 1)) + r, j)
            assert byte == (b % 16) ^ (8 if r in (2, 3, 4, 5) else 0)


def test_2x8_workspace_and_meta():
    """Partial sums are padded to 16-row units, per activation row; packed parts say so in the launcher meta."""
    gen = torch.Generator().manual_seed(4)
    parts = [_weights(n, 40, 2, 8, gen) + (None,) for n in (17, 16, 1)]
    assert ag._need(20001, 8, 2, 256) == 20016  # one slice of 20,001 rows (the Triton tables take 4,096)
    assert ag._need(20001, 8, 2, 256, rows=16, backend="cuda") == 16 * 20016
    assert ag._need(20001, 8, 2, 256, rows=40, backend="cuda") == 16 * 20016  # launches of 16 rows
    assert ag._need(20001, 8, 1, 65536, rows=16) == 0
    for layout, flag in (("slices", 1), ("rows", 0)):
        p = ag.Packed2x8(parts, layout=layout)
        assert p.meta.shape == (3, 5) and p.meta[:, 4].tolist() == [flag] * 3
        assert p.need == 2 * (32 + 16 + 16) and p.need_for(16) == 16 * p.need and p.need_for(20) == 16 * p.need
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
    with pytest.raises(ValueError, match="parts"):
        ag.Packed2x8([a + (None,)] * 5)
    with pytest.raises(ValueError, match="rows"):
        ag.Packed2x8([a + (None,)], layout="rows").need_for(0)
    with pytest.raises(ConfigError, match="TRAPETUM_AQLM_LAYOUT"):  # the switch is parsed by settings only
        Options.from_env({"TRAPETUM_AQLM_LAYOUT": "diagonal"})
    with pytest.raises(ConfigError, match="aqlm_layout"):
        KernelOptions(aqlm_layout="diagonal")
    assert Options.from_env({"TRAPETUM_AQLM_LAYOUT": "rows", "TRAPETUM_AQLM_BPS": "3"}).kernels == \
        KernelOptions(aqlm_layout="rows", aqlm_blocks_per_sm=3)


def _packed_problem(seed, rows, g, T, with_bias=True):
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for n in rows:
        codes, cb, sc = _weights(n, g, 2, 8, gen)
        parts.append((codes, cb, sc, torch.randn(n, generator=gen).half().cuda() if with_bias else None))
    x = torch.randn(T, g * 8, generator=gen).half().cuda()
    x[T // 2] *= 50
    res = torch.randn(T, sum(rows), generator=gen).half().cuda()
    return parts, x, res


@requires_cuda
@pytest.mark.parametrize("layout", ["slices", "rows"])
@pytest.mark.parametrize("seed", range(40))
def test_packed_2x8_parts_gpu(seed, layout):
    """1-4 parts of unequal rows in one launch (q/k/v, gate/up), 1-16 activation rows, with bias and residual,
    vs float64; each row bitwise its one-row call and the per-part canonical launch."""
    r = random.Random(seed)
    g = r.choice([8, 16, 24, 40, 64, 120, 512, 1024, r.randint(1, 400) * 8])
    rows = [r.choice([1, 7, 8, 9, 64, 100, 1024, r.randint(1, 3000)]) for _ in range(r.randint(1, 4))]
    T = r.choice([1, 1, 2, 3, 8, 16])
    parts, x, res = _packed_problem(seed, rows, g, T, with_bias=r.random() < 0.3)
    res = res if r.random() < 0.5 else None
    packed = ag.Packed2x8(parts, layout=layout)
    out = torch.empty(T, sum(rows), dtype=torch.float16, device="cuda")
    packed.gemv(x, out, res)
    ref = torch.cat([ag.additive_gemv_reference(x, *p) for p in parts], -1)
    if res is not None:
        ref = ref + res.double()
    assert rel_err(out, ref) < TOL[torch.float16], (rows, g, layout, T)
    for i, (codes, _, _, _) in enumerate(parts):
        assert torch.equal(packed.canonical_codes(i), codes)
    first = out.clone()
    for _ in range(3):
        packed.gemv(x, out, res)
        assert torch.equal(out, first)
    for t in range(T):  # the one-row call of every row, and one canonical launch per part (same bits)
        one = torch.empty(1, sum(rows), dtype=torch.float16, device="cuda")
        packed.gemv(x[t:t + 1].clone(), one, None if res is None else res[t:t + 1].clone())
        assert torch.equal(one, first[t:t + 1]), (t, T)
    lo = 0
    for codes, cb, sc, b in parts:
        n = codes.shape[0]
        y = ag.additive_gemv(x, codes, cb, sc, b, None if res is None else res[:, lo:lo + n].contiguous(),
                             backend="cuda")
        assert torch.equal(y, first[:, lo:lo + n])
        lo += n


@requires_cuda
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("layout", ["slices", "rows"])
@pytest.mark.parametrize("seed", range(6))
def test_packed_2x8_gate_up_gpu(seed, layout, act):
    """act(gate) * up in the reduction kernel: the same as act_mul on the pair's fp16 outputs (one fp16
    rounding apart at most), float64 agreement, bitwise repeatable, each row its one-row bits; bad pairings
    are refused."""
    from trapetum.kernels.fused import act_mul, act_mul_reference
    r = random.Random(seed)
    g, n, T = r.choice([8, 64, 512, 1024]), r.choice([1, 17, 256, 1000, 11008]), r.choice([1, 3, 8, 16])
    parts, x, _ = _packed_problem(seed, [n, n], g, T, with_bias=bool(seed % 2))
    x = (x.float() * (g * 8) ** -0.5).half()  # gate and up O(1) (O(50) on the loud row): their product stays finite
    packed = ag.Packed2x8(parts, layout=layout)
    both = torch.empty(T, 2 * n, dtype=torch.float16, device="cuda")
    packed.gemv(x, both)
    want = act_mul(both[:, :n].contiguous(), both[:, n:].contiguous(), act)
    out = torch.full((T, n), float("nan"), dtype=torch.float16, device="cuda")
    packed.gemv_gate_up(x, out, act)
    assert (out.float() - want.float()).abs().max() <= 2e-3 * want.float().abs().max() + 1e-6, (n, g, act)
    ref = act_mul_reference(*(ag.additive_gemv_reference(x, *p).half() for p in parts), act)
    assert rel_err(out, ref) < TOL[torch.float16]
    first = out.clone()
    for _ in range(3):
        packed.gemv_gate_up(x, out, act)
        assert torch.equal(out, first)
    for t in range(T):
        one = torch.empty(1, n, dtype=torch.float16, device="cuda")
        packed.gemv_gate_up(x[t:t + 1].clone(), one, act)
        assert torch.equal(one, first[t:t + 1]), (t, T)
    with pytest.raises(ValueError, match="act"):
        packed.gemv_gate_up(x, out, "relu")
    uneven = ag.Packed2x8([parts[0], _weights(n + 16, g, 2, 8, torch.Generator().manual_seed(1)) + (None,)],
                          layout=layout)
    with pytest.raises(ValueError, match="equal rows"):
        uneven.gemv_gate_up(x, out, act)


@requires_cuda
@pytest.mark.parametrize("T", [1, 5, 16])
def test_packed_2x8_graph_and_bps_gpu(T):
    parts, x, res = _packed_problem(11, [8192, 1024, 1024], 1024, T, with_bias=False)
    packed = ag.Packed2x8(parts, layout="slices")
    outs = []
    for bps in (1, 2, 3):
        out = torch.empty(T, 10240, dtype=torch.float16, device="cuda")
        packed.gemv(x, out, kopts=KernelOptions(aqlm_blocks_per_sm=bps))
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    ws = ag.AdditiveWorkspace("cuda", packed.need_for(16))
    out = torch.empty(T, 10240, dtype=torch.float16, device="cuda")
    eager = _graph_equal_eager(lambda: packed.gemv(x, out, workspace=ws), [out])
    assert torch.equal(eager[0], outs[0])


@requires_cuda
@pytest.mark.parametrize("model", ["llama-2-70b", "llama-2-7b"])
def test_rows_bitwise_real_shapes_gpu(model):
    """The verify contract at real shapes: every row of an M-row call (M = 2..16) is bitwise the M = 1 call, for
    the q/k/v-packed and gate/up-packed 2x8 forms (both layouts), the canonical 2x8 and the 1x16 GEMV, eager and
    graph-captured."""
    h, f = {"llama-2-70b": (8192, 28672), "llama-2-7b": (4096, 11008)}[model]
    kv = 1024 if model == "llama-2-70b" else 4096
    for layout in ("slices", "rows"):
        qkv, x, res = _packed_problem(1, [h, kv, kv], h // 8, 16)
        gu, _, _ = _packed_problem(2, [f, f], h // 8, 1, with_bias=False)
        pq, pg = ag.Packed2x8(qkv, layout=layout), ag.Packed2x8(gu, layout=layout)
        oq, og = (torch.empty(16, n, dtype=torch.float16, device="cuda") for n in (h + 2 * kv, f))
        ref_q, ref_g = torch.empty_like(oq), torch.empty_like(og)
        for t in range(16):
            pq.gemv(x[t:t + 1], ref_q[t:t + 1], res[t:t + 1])
            pg.gemv_gate_up(x[t:t + 1], ref_g[t:t + 1], "silu")
        for M in (2, 3, 4, 5, 8, 13, 16):
            def call(M=M):
                pq.gemv(x[:M], oq[:M], res[:M])
                pg.gemv_gate_up(x[:M], og[:M], "silu")
            _graph_equal_eager(call, [oq[:M], og[:M]], reps=2)
            for t in range(M):
                assert torch.equal(oq[t], ref_q[t]) and torch.equal(og[t], ref_g[t]), (layout, M, t)
    for M_cb, nb in ((2, 8), (1, 16)):
        codes, cb, sc = _weights(h, f // 8, M_cb, nb, torch.Generator().manual_seed(3))
        x = torch.randn(16, f, generator=torch.Generator().manual_seed(4)).half().cuda()
        ones = [ag.additive_gemv(x[t:t + 1], codes, cb, sc, backend="cuda") for t in range(16)]
        for M in (2, 4, 7, 16):
            y = ag.additive_gemv(x[:M], codes, cb, sc, backend="cuda")
            assert all(torch.equal(y[t:t + 1], ones[t]) for t in range(M)), (M_cb, nb, M)
