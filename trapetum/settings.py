"""Every switch of the package, parsed once, into frozen options that are passed down explicitly.

The environment is read here and nowhere else: ``Options.from_env()`` at the edge (``trapetum.load``, the
CLI, a benchmark's ``main``), then the options travel as arguments (``GpuEngine(..., options=)``, the kernel
entry points' ``kopts=``). Tests and benchmarks build ``Options(...)`` / ``dataclasses.replace`` instead of
editing ``os.environ`` or reloading modules. Library defaults (``Options()``, ``KernelOptions()``) are the
production settings, whatever the environment says.

One truthiness rule for every on/off switch: 1/true/on/yes and 0/false/off/no (any case); unset or empty
means the default; anything else is a ConfigError naming the variable.

| variable                 | field                      | values (default first)                            |
|--------------------------|----------------------------|---------------------------------------------------|
| TRAPETUM_GRAPH           | graph                      | on, off: decode / verify steps as CUDA graphs      |
| TRAPETUM_FUSE            | fuse                       | on, off: fused q/k/v and gate/up GEMVs, residuals  |
| TRAPETUM_ATTN            | attention                  | fused, unfused: RoPE + KV append inside attention  |
| TRAPETUM_ATTN_CONFIG     | attn_config                | '' or an AttnConfig name (kernels/attn_configs.py) |
| TRAPETUM_PREFILL         | prefill                    | default, precise, exact                            |
| TRAPETUM_ENGINE          | engine                     | gpu, reference (torch reference on CUDA)           |
| TRAPETUM_CALIB_MEM_GB    | calib_mem_gb               | unset (half the free memory) or a positive number  |
| TRAPETUM_TC              | kernels.cuda               | on, off: the CUDA C++ kernels (else Triton / torch)|
| TRAPETUM_PDL             | kernels.pdl                | all, cuda, triton, off (programmatic launch)       |
| TRAPETUM_TRITON_GATHER   | kernels.triton_gather      | on, off: tl.gather in the Triton codebook GEMV     |
| TRAPETUM_AQLM_LAYOUT     | kernels.aqlm_layout        | slices, rows: 2x8 codes in the engine              |
| TRAPETUM_AQLM_BPS        | kernels.aqlm_blocks_per_sm | 2, or 1..8: blocks per SM of the 2x8 CUDA kernel   |
| TRAPETUM_API_KEY         | ServeEnv.api_key           | the API key of ``trapetum serve`` (not an Options) |
| OMP_NUM_THREADS          | CpuEnv.omp_threads_set     | set: torch's default (which follows it) is kept    |

Fields without a variable (API and benchmarks): ``kernels.aqlm_kernel`` ("table"): the 2x8 GEMV of decode and
verify, "table" or "mma" (the tensor-core kernel; other numerics, so both modes use it; CLI ``--aqlm-kernel``,
bench_e2e ``--aqlm-kernels``); ``kernels.grouped_gemv_groups`` (2): the 4-/8-bit mma GEMV on more than 16 rows
(batched decode) gives a block 1 group of 16 rows (a block per group), 2 (two an SM) or 4 (one block an SM), each
weight dequantized once for the groups of a block (the same bits in every mode; bench_kernels ``--only rows``
times them: at 64 rows 2 took 0.82-0.88x the time of 1 on the H200, 4 measured slower in the 64-row paged step);
``kernels.many_rows`` ("wgmma"): the 4-bit GEMV on more than 16 rows runs on Hopper's warpgroup MMA where it can
(kernels/codebook_gemm_wgmma.py), "mma" keeps the grouped mma kernel (the same bits);
``host_kernels`` (True): the CPU decodes 4/8-bit codebook
projections with the host GEMV (kernels/host_gemv.py) instead of dequantize-and-multiply; ``cpu_step`` (True,
with ``host_kernels``): passes of 1..16 rows run the CPU executor (models/cpu_ops.py: fused GEMVs, the step's
small ops in C) instead of the reference decoder's torch ops; ``host_numerics`` ("fp32"): the numbers of the host
GEMV of 4- and 8-bit codebooks, "fp32" (fp32 x times the fp16 centroids) or "int8" (an opt-in mode of other numbers:
each row's centroids as int8 times a row scale, x as int8 per 32 columns times a block scale, integer dots:
kernels/host/codebook_host_q8.c; the 8-bit head's int8 table is looked up once at load into int8 weights of the
codes' size; CLI ``--host-numerics``; prompts of more than 16 rows
multiply the same int8 weights and activations in fp32); ``mla`` ("expanded"): the GPU engine's latent attention
caches per-head keys and values ("expanded") or the compressed latent and attends in the absorbed form ("latent":
runtime/engine_latent.py); ``prefill_graph`` (True): the default prefill of a prompt (last-row logits, CUDA) runs padded
to a length bucket (runtime/engine.py ``prefill_bucket``), eagerly the first time a bucket is used (always with
``graph`` off) and as a CUDA graph captured at its second use (the same kernels and shapes: the same bits), so that prompt
processing costs its GPU time and not the host's launches; ``exact_prefill_max`` (128): the default prefill (last-row
logits, CUDA) of a prompt of at most this many tokens on a model whose layer projections are all 4-/8-bit codebooks
runs the exact prefill instead (16-row verify passes, runtime/engine.py ``short_exact``: cheaper there than
dequantizing the model; 0 turns it off); ``gpu_mem_gb`` (None): the GPU engine's memory budget in
GB (CLI ``--gpu-mem``; runtime/placement.py moves the embedding table, then the routed experts, to host RAM until
the rest fits, else refuses; None keeps everything on the GPU).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Mapping

from .errors import ConfigError

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")

PDL_MODES = ("all", "cuda", "triton", "off")
ATTENTION_MODES = ("fused", "unfused")
PREFILL_MODES = ("default", "precise", "exact")
ENGINES = ("gpu", "reference")
MLA_MODES = ("expanded", "latent")
AQLM_LAYOUTS = ("slices", "rows")
AQLM_KERNELS = ("table", "mma")
GROUPED_GEMV_GROUPS = (4, 2, 1)
MANY_ROWS_KERNELS = ("wgmma", "mma")  # KernelOptions.many_rows
HOST_NUMERICS = ("fp32", "int8")  # Options.host_numerics (kernels/host_gemv.py NUMERICS)
SPARSE_KERNELS = ("mma", "compact", "masked")  # KernelOptions.sparse_kernel


def parse_bool(name: str, value: str | None, default: bool) -> bool:
    """The one truthiness rule (module docstring)."""
    if value is None or value.strip() == "":
        return default
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{name}: expected one of {', '.join(_TRUE + _FALSE)}, got {value!r}")


def parse_choice(name: str, value: str | None, choices: tuple[str, ...]) -> str:
    if value is None or value.strip() == "":
        return choices[0]
    v = value.strip().lower()
    if v not in choices:
        raise ConfigError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
    return v


def _parse_number(name: str, value: str | None, kind, lo, hi):
    if value is None or value.strip() == "":
        return None
    try:
        v = kind(value.strip())
    except ValueError:
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if not (lo <= v <= hi):
        raise ConfigError(f"{name}: {v} outside {lo}..{hi}")
    return v


@dataclass(frozen=True)
class KernelOptions:
    """What the kernel entry points may use (``kopts=`` of kernels/*; defaults: production)."""
    cuda: bool = True  # the CUDA C++ kernels where they apply (else Triton, then torch)
    pdl: str = "all"  # programmatic dependent launch: all | cuda (C++ kernels only) | triton | off
    triton_gather: bool = True  # tl.gather of the codebook tile in the Triton codebook GEMV
    aqlm_layout: str = "slices"  # 2x8 codes in the engine: the kernel's "slices" layout or the stored "rows"
    aqlm_blocks_per_sm: int = 2  # the 2x8 CUDA kernel's blocks per SM
    # 2x8 decode and verify GEMV: "table" (fp32 lookup tables, additive_gemv.cu) or "mma" (fp16 codebook sums on
    # tensor cores, additive_mma.cu: other bits, verify M = 8 near one decode step). No variable: pass it.
    aqlm_kernel: str = "table"
    frag_producers: bool = True  # producers of a verify pass's mma-GEMV rows write its fragment order (else it copies)
    # mma GEMV on more than 16 rows (tiled codes): row groups of 16 per block, each weight dequantized once for the
    # groups of a block: 4 (one block an SM), 2 (two an SM) or 1 (a block per group: the session-10 kernel, the
    # default: at 4 the 7B 64-row paged step's GEMVs took 10.3 ms against 8.3 ms, NOTES-kernels.md session 11)
    grouped_gemv_groups: int = 2
    # 4-bit GEMV on more than 16 rows (tiled codes): "wgmma" (Hopper warpgroup MMA, x from shared memory, weights
    # dequantized in registers: kernels/codebook_gemm_wgmma.py) where it runs (sm_90, extension built), else and with
    # "mma" the grouped mma kernel above. The same bits either way (each row its one-row call's).
    many_rows: str = "wgmma"
    # warpgroups a block of the wgmma kernel (64 weight rows each, sharing the block's x stages): 1, 2 or 3, or 0
    # for the kernel's own rule (codebook_gemm_wgmma.warpgroups). Speed only: every choice gives the same bits.
    # CLI: --wgmma-warpgroups (generate, chat, serve)
    wgmma_warpgroups: int = 0
    # activation sparsity: DECODE / VERIFY passes of up to this many rows run the sparse-input GEMV (each row its
    # decode step's bits); more rows, the dense kernel on the thresholded rows. A fixed count, never data-dependent.
    sparse_rows: int = 16
    # "mma": the tensor-core sparse GEMV of 4-bit codes (kernels/sparse_mma.py) where the CUDA extension builds;
    # where it does not, for 8-bit and above sparse_mma.MAX_K inputs, "compact" (else "masked": sparse_gemv.compact_ok).
    # (It beat the deleted first CUDA sparse kernel in every cell end to end on the H200: BENCHMARKS.md session 17.)
    # "compact": Triton, work follows the nonzeros (a per-program index list); "masked": Triton, loads masked.
    # CLI: --sparse-kernel (generate, chat)
    sparse_kernel: str = "mma"

    def __post_init__(self):
        if self.pdl not in PDL_MODES:
            raise ConfigError(f"kernels.pdl: expected one of {', '.join(PDL_MODES)}, got {self.pdl!r}")
        if self.aqlm_layout not in AQLM_LAYOUTS:
            raise ConfigError(f"kernels.aqlm_layout: expected one of {', '.join(AQLM_LAYOUTS)}, got {self.aqlm_layout!r}")
        if self.aqlm_kernel not in AQLM_KERNELS:
            raise ConfigError(f"kernels.aqlm_kernel: expected one of {', '.join(AQLM_KERNELS)}, got {self.aqlm_kernel!r}")
        if self.grouped_gemv_groups not in GROUPED_GEMV_GROUPS:
            raise ConfigError(f"kernels.grouped_gemv_groups: expected one of {GROUPED_GEMV_GROUPS}, "
                              f"got {self.grouped_gemv_groups!r}")
        if self.many_rows not in MANY_ROWS_KERNELS:
            raise ConfigError(f"kernels.many_rows: expected one of {', '.join(MANY_ROWS_KERNELS)}, got {self.many_rows!r}")
        if self.wgmma_warpgroups not in (0, 1, 2, 3):
            raise ConfigError(f"kernels.wgmma_warpgroups: expected 0 (the kernel's rule), 1, 2 or 3, "
                              f"got {self.wgmma_warpgroups!r}")
        if self.sparse_kernel not in SPARSE_KERNELS:
            raise ConfigError(f"kernels.sparse_kernel: expected one of {', '.join(SPARSE_KERNELS)}, "
                              f"got {self.sparse_kernel!r}")
        if not 0 <= int(self.sparse_rows) <= 16:
            raise ConfigError(f"kernels.sparse_rows: {self.sparse_rows} outside 0..16")
        if not 1 <= int(self.aqlm_blocks_per_sm) <= 8:
            raise ConfigError(f"kernels.aqlm_blocks_per_sm: {self.aqlm_blocks_per_sm} outside 1..8")

    @property
    def pdl_cuda(self) -> bool:
        return self.pdl in ("all", "cuda")

    @property
    def pdl_triton(self) -> bool:
        return self.pdl in ("all", "triton")


@dataclass(frozen=True)
class Options:
    """The engine's and the API's switches (module docstring); ``kernels`` is handed to every kernel call."""
    graph: bool = True
    fuse: bool = True
    attention: str = "fused"
    attn_config: str = ""
    prefill: str = "default"
    engine: str = "gpu"
    calib_mem_gb: float | None = None
    host_kernels: bool = True
    cpu_step: bool = True
    host_numerics: str = "fp32"
    mla: str = "expanded"
    prefill_graph: bool = True
    exact_prefill_max: int = 128
    gpu_mem_gb: float | None = None
    kernels: KernelOptions = field(default_factory=KernelOptions)

    def __post_init__(self):
        for name, value, choices in (("attention", self.attention, ATTENTION_MODES),
                                     ("prefill", self.prefill, PREFILL_MODES), ("engine", self.engine, ENGINES),
                                     ("mla", self.mla, MLA_MODES),
                                     ("host_numerics", self.host_numerics, HOST_NUMERICS)):
            if value not in choices:
                raise ConfigError(f"options.{name}: expected one of {', '.join(choices)}, got {value!r}")
        if self.calib_mem_gb is not None and not self.calib_mem_gb > 0:
            raise ConfigError(f"options.calib_mem_gb: must be positive, got {self.calib_mem_gb!r}")
        if self.gpu_mem_gb is not None and not self.gpu_mem_gb > 0:
            raise ConfigError(f"options.gpu_mem_gb (--gpu-mem): must be positive, got {self.gpu_mem_gb!r}")
        if isinstance(self.exact_prefill_max, bool) or not isinstance(self.exact_prefill_max, int) \
                or self.exact_prefill_max < 0:
            raise ConfigError(f"options.exact_prefill_max: a token count >= 0, got {self.exact_prefill_max!r}")

    def replace(self, **changes) -> "Options":
        """A copy with `changes`; ``kernels=dict(...)`` updates fields of the kernel options."""
        k = changes.pop("kernels", None)
        if isinstance(k, dict):
            changes["kernels"] = dataclasses.replace(self.kernels, **k)
        elif k is not None:
            changes["kernels"] = k
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Options":
        """Options from the TRAPETUM_* variables (os.environ unless `environ` is given)."""
        env = os.environ if environ is None else environ
        g = env.get
        bps = _parse_number("TRAPETUM_AQLM_BPS", g("TRAPETUM_AQLM_BPS"), int, 1, 8)
        kernels = KernelOptions(
            cuda=parse_bool("TRAPETUM_TC", g("TRAPETUM_TC"), True),
            pdl=_pdl(g("TRAPETUM_PDL")),
            triton_gather=parse_bool("TRAPETUM_TRITON_GATHER", g("TRAPETUM_TRITON_GATHER"), True),
            aqlm_layout=parse_choice("TRAPETUM_AQLM_LAYOUT", g("TRAPETUM_AQLM_LAYOUT"), AQLM_LAYOUTS),
            aqlm_blocks_per_sm=2 if bps is None else bps)
        return cls(graph=parse_bool("TRAPETUM_GRAPH", g("TRAPETUM_GRAPH"), True),
                   fuse=parse_bool("TRAPETUM_FUSE", g("TRAPETUM_FUSE"), True),
                   attention=parse_choice("TRAPETUM_ATTN", g("TRAPETUM_ATTN"), ATTENTION_MODES),
                   attn_config=(g("TRAPETUM_ATTN_CONFIG") or "").strip(),
                   prefill=parse_choice("TRAPETUM_PREFILL", g("TRAPETUM_PREFILL"), PREFILL_MODES),
                   engine=parse_choice("TRAPETUM_ENGINE", g("TRAPETUM_ENGINE"), ENGINES),
                   calib_mem_gb=_parse_number("TRAPETUM_CALIB_MEM_GB", g("TRAPETUM_CALIB_MEM_GB"), float, 1e-3, 1e6),
                   kernels=kernels)


@dataclass(frozen=True)
class ServeEnv:
    """What ``trapetum serve`` takes from the environment: ``TRAPETUM_API_KEY``, the API key (so that it is not
    on the command line, where ``ps`` shows it to every user of the machine). Unset or empty: none."""
    api_key: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ServeEnv":
        env = os.environ if environ is None else environ
        key = (env.get("TRAPETUM_API_KEY") or "").strip()
        return cls(api_key=key or None)


@dataclass(frozen=True)
class CpuEnv:
    """What the commands take from the environment for their CPU thread count (``cpu_threads.py``): whether
    the standard ``OMP_NUM_THREADS`` is set (then torch's default, which follows it, is kept unless ``--threads``
    is given). The count itself is ``--threads`` or the automatic choice; there is no Trapetum variable for it."""
    omp_threads_set: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "CpuEnv":
        env = os.environ if environ is None else environ
        return cls(omp_threads_set=bool((env.get("OMP_NUM_THREADS") or "").strip()))


def _pdl(value: str | None) -> str:
    """TRAPETUM_PDL: the modes, or the one truthiness rule (on = all, off = off)."""
    if value is not None and value.strip().lower() in PDL_MODES:
        return value.strip().lower()
    return "all" if parse_bool("TRAPETUM_PDL", value, True) else "off"


DEFAULT_KERNELS = KernelOptions()


def triton_interpreted() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1, Triton's own switch: Triton reads it when
    a kernel is decorated, so it is a property of the process, not an option)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
