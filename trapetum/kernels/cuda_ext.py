"""The package's CUDA C++ kernels, compiled on first use into one torch extension (cached by torch
under ~/.cache/torch_extensions, rebuilt when a source changes).

Sources (``trapetum/kernels/cuda``): ``codebook_gemv_mma.cu`` (4-/8-bit per-row codebook GEMV on tensor cores for
1..16 activation rows, 4-bit dequantization for prefill) and ``dense_gemv.cu`` (fp16 GEMV of the fp16 path, 1..16
rows), ``expert_gemv_mma.cu`` (the selected experts' 4-/8-bit GEMVs, built on the first file's device code);
all include ``pdl.cuh`` (programmatic dependent launch on sm_90+) and ``act.cuh`` (the gated activations of
the fused gate/up epilogues); the tensor-core GEMVs ``ptx.cuh`` (their code loads, shared loads and mma.sync). The decode launchers take a ``pdl`` argument (``KernelOptions.pdl_cuda``); the
prefill dequantization is launched without PDL.
Each source guards its torch launchers with ``TRAPETUM_TORCH_LAUNCHER``. ``available()`` is
False without CUDA, below compute capability 8.0, or with kernel options whose ``cuda`` is off; callers then fall back to
Triton or torch. A build failure is reported once as a warning and remembered (``error()``). ``Extension`` is the one loader:
other extensions (the 2-bit GEMVs, experiments under ``cuda/experimental``) are ``Extension`` objects of their own, so
that the production build does not compile them and a failure in one leaves the others alone.
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from ..settings import DEFAULT_KERNELS, KernelOptions

_DIR = Path(__file__).with_name("cuda")
SOURCES = ("codebook_gemv_mma.cu", "dense_gemv.cu", "expert_gemv_mma.cu")
HEADERS = ("pdl.cuh", "act.cuh", "ptx.cuh", "codebook_gemv_groups.cuh", "sparse_split.cuh",
           "sparse_split_args.cuh", "smem_once.cuh", "lut4.cuh")  # included by the sources (PDL, epilogue activations, PTX
# helpers, the grouped codebook GEMV, the split sparse GEMV's ending and launcher checks, the shared-memory attributes,
# the 4-bit codebook's register lookups)
_DECLS = """
void cb_gemv_mma(torch::Tensor x, torch::Tensor codes, torch::Tensor cb, torch::Tensor res, torch::Tensor y,
                 int64_t bits, int64_t epi, int64_t has_res, int64_t f, int64_t tiled, int64_t pdl,
                 int64_t x_frag, int64_t y_pt, int64_t gpb);
void cb_dequant4(torch::Tensor codes, torch::Tensor cb, torch::Tensor w);
void dense_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor res, torch::Tensor y, int64_t epi,
                int64_t has_res, int64_t f, int64_t pdl);
void cb_expert_gate_up(torch::Tensor x, torch::Tensor idx, torch::Tensor codes, torch::Tensor cb, torch::Tensor h,
                       int64_t bits, int64_t epi, int64_t f, int64_t tiled, int64_t pdl);
void cb_expert_down(torch::Tensor h, torch::Tensor idx, torch::Tensor weights, torch::Tensor codes, torch::Tensor cb,
                    torch::Tensor res, torch::Tensor part, torch::Tensor y, int64_t bits, int64_t has_res,
                    int64_t tiled, int64_t pdl);
"""
_FUNCTIONS = ["cb_gemv_mma", "cb_dequant4", "dense_gemv", "cb_expert_gate_up", "cb_expert_down"]



def available(device: torch.device | None = None, kopts: KernelOptions = DEFAULT_KERNELS) -> bool:
    """True if the CUDA kernels may run on `device` (CUDA, sm_80+, kernel options' ``cuda`` on)."""
    if not kopts.cuda or not torch.cuda.is_available():
        return False
    device = device or torch.device("cuda")
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


class Extension:
    """One torch extension built from sources of ``trapetum/kernels/cuda`` on first use (``load()``), its build
    failure remembered and warned once (``error()``): the callers keep their Triton / torch fallbacks."""

    def __init__(self, name: str, sources: tuple[str, ...], decls: str, functions: list[str],
                 cuda_flags: tuple[str, ...] = ()):
        self.name, self.sources, self.decls, self.functions = name, tuple(sources), decls, list(functions)
        self.cuda_flags = tuple(cuda_flags)  # e.g. an arch of its own (torch then adds none)
        self._lock = threading.Lock()
        self._ext = None
        self._err: str | None = None

    def present(self) -> bool:
        return all((_DIR / s).exists() for s in self.sources + HEADERS)

    def load(self):
        """The compiled extension module, or None if it cannot be built here (see ``error()``)."""
        if self._ext is not None or self._err is not None:
            return self._ext
        with self._lock:
            if self._ext is not None or self._err is not None:
                return self._ext
            try:
                from torch.utils.cpp_extension import load_inline
                self._ext = load_inline(name=self.name, cpp_sources=self.decls, cuda_sources=cuda_source(self.sources),
                                        functions=self.functions, extra_cuda_cflags=["-O3", "-lineinfo", *self.cuda_flags],
                                        extra_include_paths=[str(_DIR)], verbose=False)
            except Exception as e:  # keep the Triton / torch fallbacks, but say why
                self._err = f"{type(e).__name__}: {e}"
                import warnings
                warnings.warn(f"trapetum: CUDA kernels {self.name} unavailable, using fallbacks ({self._err[:300]})")
        return self._ext

    def error(self) -> str | None:
        """Why the extension could not be built (None if it was, or was never tried)."""
        return self._err

    def ready(self, device: torch.device | None = None, kopts: KernelOptions = DEFAULT_KERNELS):
        """The extension if it may run on `device` (``available``) and builds, else None."""
        return self.load() if available(device, kopts) and self.present() else None


MAIN = Extension("trapetum_cuda_kernels", SOURCES, _DECLS, _FUNCTIONS)


def load():
    """The package's main extension (codebook and dense GEMVs), or None if it cannot be built here."""
    return MAIN.load()


def cuda_source(sources) -> str:
    """The text given to ``load_inline`` for `sources` (files of ``trapetum/kernels/cuda``): their torch
    launchers switched on, and the headers they include (``HEADERS``) named with a hash of their text, so
    that torch's build cache (keyed on this text) rebuilds when a header changes."""
    import hashlib
    tag = hashlib.sha256("".join((_DIR / h).read_text() for h in HEADERS).encode()).hexdigest()[:16]
    return (f"// headers {', '.join(HEADERS)}: {tag}\n#define TRAPETUM_TORCH_LAUNCHER 1\n"
            + "\n".join((_DIR / s).read_text() for s in sources))


def error() -> str | None:
    """Why the main extension could not be built (None if it was, or was never tried)."""
    return MAIN.error()


def ready(device: torch.device | None = None, kopts: KernelOptions = DEFAULT_KERNELS):
    """The main extension if it is available for `device` (and `kopts`) and builds, else None."""
    return MAIN.ready(device, kopts)
