"""The mma GEMV on more than 16 rows (batched decode, tiled codes): groups of 16 rows in one launch, up to
``KernelOptions.grouped_gemv_groups`` groups a block sharing each dequantized weight (cuda/codebook_gemv_mma.cu,
cb_gemv_mma_groups_kernel). CPU: the block mapping and the x addressing of the kernel's host-compilable helpers
(compiled here with nvcc when present), the option's checks, the fallback path's agreement with float64. GPU:
random awkward shapes against float64 and against one-row calls; every mode gives the same bits
(tests/test_kernels_gemv.py::test_grouped_rows_bitwise_equal_single_rows_gpu pins the real shapes)."""
from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from trapetum.errors import ConfigError
from trapetum.settings import GROUPED_GEMV_GROUPS, KernelOptions

from kernels_conftest import DEVICE, TOL, codebook_gemv as cg, rel_err, requires_cuda
from shapes import AWKWARD

CUDA_DIR = Path(cg.__file__).with_name("cuda")
KERNELS_OFF = KernelOptions(cuda=False)
M_GROUPED = (17, 31, 32, 48, 63, 64, 65, 100, 128, 256)

HOST_CHECK = Path(__file__).parent / "cuda" / "codebook_groups_host_check.cu"
# (name, text in codebook_gemv_groups.cuh, replacement): each altered helper must fail the host check
MUTATIONS = [("x of a short group read with the stride of a full one", "(size_t)(c * PT + p) * mg) * 4",
              "(size_t)(c * PT + p) * 16) * 4"),
             ("a super-group one group too long", "ng = min(GB, G - g0);", "ng = min(GB + 1, G - g0);"),
             ("a grid one super-group short", "(((M + 15) / 16 + GB - 1) / GB)", "(((M + 15) / 16) / GB)")]


def _nvcc():
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("needs nvcc")
    return nvcc


def _build(exe, cu=None):
    cmd = [_nvcc(), "-std=c++17", "-O1", "-arch=sm_90", "-I", str(CUDA_DIR), "-o", str(exe), str(HOST_CHECK)]
    if cu is not None:
        cmd.insert(-1, f'-DTRAPETUM_CBGEMV_CU="{cu}"')
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_grouped_block_mapping_and_x_addressing_host(tmp_path):
    """The kernel's own helpers (groups_grid, groups_block, groups_x_piece) on the CPU
    (tests/cuda/codebook_groups_host_check.cu): every (tile, group) pair computed by one block of the grid for
    GB = 2, 4 and M = 17..256, and the x each lane reads is its group's fragment-order x; each mutation of the
    helpers fails it."""
    src = (CUDA_DIR / "codebook_gemv_groups.cuh").read_text()
    builds = [("unaltered", tmp_path / "check", _build(tmp_path / "check"))]
    for i, (name, old, new) in enumerate(MUTATIONS):
        assert src.count(old) == 1, f"mutation '{name}': its text is no longer in codebook_gemv_groups.cuh once"
        d = tmp_path / f"m{i}"
        d.mkdir()
        (d / "codebook_gemv_groups.cuh").write_text(src.replace(old, new))
        (d / "codebook_gemv_mma.cu").write_text((CUDA_DIR / "codebook_gemv_mma.cu").read_text())
        builds.append((name, d / "check", _build(d / "check", d / "codebook_gemv_mma.cu")))
    for name, exe, proc in builds:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} does not build:\n{err[-2000:]}"
        out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
        if name == "unaltered":
            assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr
        else:
            assert out.returncode != 0 and "FAIL" in out.stdout, f"mutation '{name}' not caught: {out.stdout}"


def test_grouped_gemv_groups_option():
    """1, 2, 4 groups a block (2 the default); anything else is a ConfigError naming the field."""
    assert KernelOptions().grouped_gemv_groups == 2 and set(GROUPED_GEMV_GROUPS) == {1, 2, 4}
    for g in GROUPED_GEMV_GROUPS:
        assert KernelOptions(grouped_gemv_groups=g).grouped_gemv_groups == g
    for bad in (0, 3, 8, "4"):
        with pytest.raises(ConfigError, match="grouped_gemv_groups"):
            KernelOptions(grouped_gemv_groups=bad)


def _weights(n, k, bits, gen):
    codes = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, generator=gen)
    return codes.to(DEVICE), torch.randn(n, 1 << bits, generator=gen).half().to(DEVICE)


@pytest.mark.parametrize("m,n", [(17, 3), (33, 53), (65, 1)])
def test_grouped_rows_fallback_cpu(m, n):
    """Tiled codes and more than 16 rows without the mma kernel (kernels off; on a CPU the Triton interpreter):
    the fallback agrees with float64."""
    gen = torch.Generator().manual_seed(m + n)
    codes, cb = _weights(n, 128, 4, gen)
    x = torch.randn(m, 128, generator=gen).half().to(DEVICE)
    y = cg.codebook_gemv(x, cg.tile_codes(codes), cb, 4, tiled=True, kopts=KERNELS_OFF)
    assert rel_err(y, cg.codebook_gemv_reference(x, codes, cb, 4)) < TOL[torch.float16]


@requires_cuda
@pytest.mark.parametrize("seed", range(40))
def test_grouped_random_shapes_gpu(seed):
    """Awkward shapes (N in 1, 3, 53, 97, 257, 1025 or random; K one chunk .. many): float64 agreement; the same
    bits in every grouped mode; sampled rows equal their one-row calls."""
    r = random.Random(seed)
    bits = r.choice([4, 4, 8])
    k = (512 // bits) * r.choice([1, 2, 3, r.randint(1, 90)])
    n = r.choice(AWKWARD + [r.randint(1, 5000)])
    m = r.choice(M_GROUPED + (r.randint(17, 256),))
    gen = torch.Generator().manual_seed(seed)
    codes, cb = _weights(n, k, bits, gen)
    x = torch.randn(m, k, generator=gen).half().cuda()
    res = torch.randn(m, n, generator=gen).half().cuda() if r.random() < 0.4 else None
    kc = cg.tile_codes(codes)
    ys = {}
    for g in GROUPED_GEMV_GROUPS:
        y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
        cg.codebook_gemv(x, kc, cb, bits, res, out=y, tiled=True, kopts=KernelOptions(grouped_gemv_groups=g))
        ys[g] = y
    ref = cg.codebook_gemv_reference(x, codes, cb, bits, res)
    assert rel_err(ys[4], ref) < TOL[torch.float16], (bits, m, k, n)
    for g in GROUPED_GEMV_GROUPS:
        assert torch.equal(ys[g], ys[4]), (g, bits, m, k, n)
    for i in sorted({0, 15, 16, m - 1, r.randrange(m)}):
        one = cg.codebook_gemv(x[i:i + 1], kc, cb, bits, None if res is None else res[i:i + 1], tiled=True)
        assert torch.equal(ys[4][i:i + 1], one), (i, bits, m, k, n)


@requires_cuda
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("f", [1, 3, 53, 97, 257])
def test_grouped_gate_up_awkward_gpu(f, act):
    """The gate/up epilogue over grouped rows at awkward F: float64 agreement, one-row bits, every mode alike."""
    gen = torch.Generator().manual_seed(f)
    k = 384
    gc, gb = _weights(f, k, 4, gen)
    uc, ub = _weights(f, k, 4, gen)
    codes, cb, ff = cg.interleave_gate_up(gc, gb, uc, ub)
    kc = cg.tile_codes(codes)
    for m in (17, 64, 65, 130):
        x = torch.randn(m, k, generator=gen).half().cuda()
        ys = [cg.codebook_gemv_gate_up(x, kc, cb, 4, ff, act, tiled=True, kopts=KernelOptions(grouped_gemv_groups=g))
              for g in GROUPED_GEMV_GROUPS]
        ref = cg.codebook_gemv_gate_up_reference(x, codes, cb, 4, ff, act)
        assert rel_err(ys[0], ref) < TOL[torch.float16], (f, m)
        assert all(torch.equal(y, ys[0]) for y in ys[1:]), (f, m)
        singles = torch.cat([cg.codebook_gemv_gate_up(x[i:i + 1], kc, cb, 4, ff, act, tiled=True) for i in range(m)])
        assert torch.equal(ys[0], singles), (f, m)
