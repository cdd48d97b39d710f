"""Session 15 experiment: ablations, occupancy variants and x reuse across two weight tiles (xr2*) of the grouped
4-bit codebook GEMV (``cuda/experimental/codebook_gemv_ablation.cu``; scripts/dev/gemv_ablation.py times them). No
production path calls them.

Built without torch's extension machinery: ``nvcc -shared`` per part (parts compiled in parallel; the sources carry
no torch headers), cached under `build_dir` by a hash of the sources and flags, called through ctypes on torch's
current stream (so CUDA-graph capture records them). Variants: ``VARIANTS`` (name -> index, exact, what it does);
"exact" ones must give the production kernel's bits, the others are timing ablations with wrong results.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_CUDA = Path(__file__).resolve().parents[1] / "cuda"
SOURCE = _CUDA / "experimental" / "codebook_gemv_ablation.cu"
DEPS = ("codebook_gemv_mma.cu", "codebook_gemv_groups.cuh", "pdl.cuh", "act.cuh", "ptx.cuh", "lut4.cuh",
        "experimental/codebook_gemv_xr2.cuh")
NPARTS = 8

# name -> (variant index of the C entry point, exact (production bits), description)
VARIANTS: dict[str, tuple[int, bool, str]] = {
    "prod": (-1, True, "production cb_gemv_mma_groups_kernel<4,0,2>"),
    "prod16": (-2, True, "production cb_gemv_mma_kernel<4,2,0,tiled,frag> (the M 9..16 dispatch)"),
    "copy": (0, True, "the experimental copy, no switch (control)"),
    "occ3": (1, True, "__launch_bounds__(256,3), carveout 86%"),
    "no_lut": (2, False, "no table LDS (A = PRMT addresses)"),
    "no_x": (3, False, "no x loads (B constant)"),
    "no_mma": (4, False, "mma -> one XOR of A and B"),
    "no_red": (5, False, "no cross-warp reduction / store"),
    "no_table": (6, False, "no table build (no codebook loads, no STS)"),
    "loads_only": (7, False, "no LDS, no mma: code + x loads and the reduction"),
    "mma_codes": (8, False, "no LDS, no x loads: code loads + mma"),
    "codes2": (9, True, "codes two chunks ahead"),
    "pfx2": (10, True, "prefetch.global.L1 x 2 pieces ahead"),
    "pfx4": (11, True, "prefetch.global.L1 x 4 pieces (a chunk) ahead"),
    "occ3_pfx2": (12, True, "occ3 + pfx2"),
    "skeleton": (13, False, "no LDS, no x, no mma: code loads, table build, reduction"),
    "prod8": (-3, True, "production cb_gemv_mma_kernel<4,1,0,tiled,frag> (the M 3..8 dispatch)"),
    "prod1": (-4, True, "production cb_gemv_mma_kernel<4,1,0,tiled,row-major x> (the M 1..2 dispatch)"),
    "xr2": (14, True, "x reuse: 2 weight tiles a warp, 2 groups (GB 2), two 64 KB tables, 1 block/SM"),
    "xr2_g1": (15, True, "x reuse: 2 weight tiles a warp, 1 group (GB 1, NT 2)"),
    "xr2_n1": (16, True, "x reuse: 2 weight tiles a warp, 1 group, n-tile 0 only (M <= 8)"),
    "xr2p": (17, True, "xr2 persistent (grid = SMs): next item's codebooks / first codes loaded ahead"),
    "xr2p_g1": (18, True, "xr2_g1 persistent"),
}
# Row counts a variant takes (others are skipped): the production M <= 16 kernels only where the dispatch runs them.
ROWS: dict[str, tuple[int, int]] = {"prod16": (9, 16), "prod8": (3, 8), "prod1": (1, 2), "xr2_n1": (1, 8)}
# Variants fed x row-major (the others take the group-wise fragment order).
ROW_MAJOR_X = frozenset({"prod1"})


def takes_rows(name: str, m: int) -> bool:
    lo, hi = ROWS.get(name, (1, 256))
    return lo <= m <= hi


def source_hash(extra: str = "") -> str:
    """sha256 (16 hex) of the ablation source, the production sources it includes and `extra` (the flags)."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for d in DEPS:
        h.update((_CUDA / d).read_bytes())
    h.update(extra.encode())
    return h.hexdigest()[:16]


def nvcc_command(nvcc: str, arch: str, part: int, nparts: int, out: str) -> list[str]:
    """The nvcc command line of one part (a shared library)."""
    return [nvcc, "-std=c++17", "-O3", "-lineinfo", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC",
            "-diag-suppress", "20280", "-Xptxas", "-v", "-I", str(_CUDA), f"-DABL_PART={part}",
            f"-DABL_NPARTS={nparts}", str(SOURCE), "-o", out]


def build(build_dir: str | os.PathLike, arch: str, nparts: int = NPARTS, nvcc: str | None = None) -> tuple[list[Path], str]:
    """Compile (or reuse) the `nparts` libraries for `arch` (e.g. sm_90); returns (paths, ptxas report). Raises
    RuntimeError with nvcc's output if a part fails."""
    nvcc = nvcc or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    tag = source_hash(f"{arch} {nparts} {' '.join(nvcc_command('nvcc', arch, 0, nparts, 'x'))}")
    d = Path(build_dir) / f"abl-{tag}"
    d.mkdir(parents=True, exist_ok=True)
    paths = [d / f"part{k}.so" for k in range(nparts)]
    logs = [d / f"part{k}.log" for k in range(nparts)]

    def one(k: int) -> tuple[int, str]:
        if paths[k].exists() and logs[k].exists():
            return 0, logs[k].read_text()
        tmp = str(paths[k]) + f".tmp{os.getpid()}"
        r = subprocess.run(nvcc_command(nvcc, arch, k, nparts, tmp), capture_output=True, text=True)
        if r.returncode == 0:
            os.replace(tmp, paths[k])
            logs[k].write_text(r.stdout + r.stderr)
        return r.returncode, r.stdout + r.stderr

    with ThreadPoolExecutor(max_workers=nparts) as ex:
        res = list(ex.map(one, range(nparts)))
    bad = [(k, log) for k, (rc, log) in enumerate(res) if rc]
    if bad:
        raise RuntimeError("nvcc failed for part(s) " + ", ".join(str(k) for k, _ in bad) + ":\n" + bad[0][1][-4000:])
    return paths, "".join(log for _, log in res)


class Lib:
    """The built parts, loaded with ctypes: ``launch`` / ``info`` by variant name, ``frag`` (x -> group-wise
    fragment order)."""

    def __init__(self, paths):
        self.parts = [ctypes.CDLL(str(p)) for p in paths]
        for lib in self.parts:
            lib.trapetum_abl_has.argtypes = [ctypes.c_int]
            lib.trapetum_abl_launch.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 + [
                ctypes.c_void_p]
            lib.trapetum_abl_info.argtypes = [ctypes.c_int] + [ctypes.POINTER(ctypes.c_int)] * 3
            lib.trapetum_abl_frag.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                              ctypes.c_void_p]
        self._of = {}
        for name, (v, _, _) in VARIANTS.items():
            owners = [lib for lib in self.parts if lib.trapetum_abl_has(v)]
            if len(owners) != 1:
                raise RuntimeError(f"variant {name} ({v}): found in {len(owners)} parts, expected 1")
            self._of[name] = owners[0]

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what}: error {rc} ({'argument check' if rc > 999 else 'cudaError_t'})")

    @staticmethod
    def _stream() -> int:
        import torch
        return torch.cuda.current_stream().cuda_stream

    def launch(self, name: str, xf, codes, cb, y) -> None:
        """y [M, N] = variant `name` on fragment-order xf [M, K], tiled codes, codebooks (no checks beyond the C
        side's: the script owns the tensors)."""
        v = VARIANTS[name][0]
        M, K = xf.shape
        rc = self._of[name].trapetum_abl_launch(v, xf.data_ptr(), codes.data_ptr(), cb.data_ptr(), y.data_ptr(),
                                                M, y.shape[1], K, codes.shape[1], self._stream())
        self._check(rc, f"launch {name}")

    def info(self, name: str) -> dict:
        """Registers, local bytes (spills) a thread and resident blocks an SM, as the launch configures it."""
        r, lb, b = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        self._check(self._of[name].trapetum_abl_info(VARIANTS[name][0], r, lb, b), f"info {name}")
        return {"regs": r.value, "local_bytes": lb.value, "blocks_per_sm": b.value}

    def frag(self, x):
        """x fp16 [M, K] (contiguous, CUDA) -> the group-wise fragment order (a new tensor)."""
        import torch
        xf = torch.empty_like(x)
        self._check(self.parts[0].trapetum_abl_frag(x.data_ptr(), xf.data_ptr(), x.shape[0], x.shape[1],
                                                    self._stream()), "frag")
        return xf
