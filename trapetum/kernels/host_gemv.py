"""Host (CPU) GEMV of per-row scalar codebooks (4- and 8-bit), decoding the stored codes in place.

    codebook_gemv_host(x [M, K] fp32, codes uint8 [N, packed_width(K, bits)], tables, bits)
        -> y fp32 [M, N],  y[m, n] = sum_k x[m, k] * table_n[idx(n, k)]

The codes are the canonical packing of kernels/pack.py (what a ``.cbk`` stores; no copy, no dense weight).
``tables``, in either storage of a ``.cbk`` (schemes/codebook_store.py), read as stored:
  * per-row: an fp16 tensor [N, 2**bits], row n's table ``table_n = codebook[n]``;
  * shared: ``SharedTables(shared fp16 [ceil(N / G), 2**bits], scale fp16 [N], G)``, row n's table
    ``fp16(float32(scale[n]) * float32(shared[n // G]))`` (round to nearest even) formed in C per row, never
    stored: bitwise ``decode_shared``'s tables, so the results are bitwise the per-row call's on the decoded
    tables (same code path), while a pass reads the codes, the groups' tables and 2 bytes a row (``nbytes``).
Contracts (host/codebook_host.c, tests/test_host_gemv.py): row m of y is bitwise the
M = 1 result for every M (batch invariance); output rows are split over ``threads`` threads (default
``torch.get_num_threads()``), each element computed by one thread in a fixed order, so results are identical
for every thread count and run to run. Code paths (``PATHS``): AVX-512 with FP16 and VBMI, AVX-512 with VBMI,
AVX-512, AVX2 or portable C, the best the CPU runs unless ``path`` names a lower one (they differ only in rounding,
except that avx512vbmi gives avx512's 4-bit and avx512fp16's 8-bit bits; the two table storages give the same bits on
each). ``reference``: float64 dequantize-and-multiply.
``HostGemv``: one weight, checked once; its ``matmul`` serves many rows (prefill) from blocks of rows
dequantized in C into a temporary (``dequantize``, exact) and multiplied by torch.

The C sources ship in the package (kernels/host/codebook_host.c with its AVX-512 paths in codebook_host_512.c and
their shared codebook_host.h, the thread pool host_pool.c, and cpu_step.c: the
decode step's small ops of kernels/host_ops.py, one library) and are compiled at first use with the system's C compiler (gcc or cc, about a
second) into ``~/.cache/trapetum/host/``, keyed on the source texts and the compiler; no compiler or a failed build is reported once as a warning (``error()``) and ``available()``
turns False: callers keep their torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from .pack import packed_width, unpack_codes

SOURCE = Path(__file__).resolve().parent / "host" / "codebook_host.c"
SOURCES = (SOURCE, SOURCE.parent / "codebook_host_512.c", SOURCE.parent / "codebook_host_q8.c",
           SOURCE.parent / "host_pool.c", SOURCE.parent / "cpu_step.c", SOURCE.parent / "ggml_host.c")  # one library:
# the GEMVs (codebook_host.h shared; codebook_host_q8.c: the int8 numerics; ggml_host.c: GGUF's legacy block types,
# kernels/ggml_host.py), their thread pool, the decode step's small ops
FLAGS = ["-O3", "-shared", "-fPIC", "-pthread", "-ffp-contract=off"]
PATHS = ("c", "avx2", "avx512", "avx512vbmi", "avx512fp16")
NUMERICS = ("fp32", "int8")  # Options.host_numerics: fp32 x times the fp16 tables (the default), or the int8 dot  # index = the C side's path number (avx512vbmi:
# avx512's 4-bit results bit for bit, the 8-bit lookup by byte permutes in its own column order; avx512fp16: the
# same with the shared tables formed by fp16 multiplies, bitwise avx512vbmi's)
HOST_BITS = (4, 8)
GEMV_ROWS = 16  # CodebookLinear: rows up to this many take the GEMV (decode, verify), more the dequantized matmul

_lock = threading.Lock()
_lib = None
_err: str | None = None
_tried = False


def cache_dir() -> Path:
    return Path.home() / ".cache" / "trapetum" / "host"


def _compiler() -> str | None:
    for cc in ("gcc", "cc"):
        p = shutil.which(cc)
        if p:
            return p
    return None


def compile_library(name: str, sources, link: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The shared library ``name`` built from ``sources`` with FLAGS by the system's C compiler, cached in
    ``cache_dir()`` under a key of the source texts (the headers beside them included), the compiler version and the
    flags (every host library of the package is built so)."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (gcc or cc on PATH); install gcc for the host kernels")
    headers = sorted({h for p in sources for h in Path(p).parent.glob("*.h")})
    src = b"".join(Path(p).read_bytes() for p in [*sources, *headers])
    ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(src + ver.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    out = cache_dir() / f"{name}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, sources), *link], capture_output=True, text=True,
                               timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed on {', '.join(p.name for p in sources)}: "
                                   f"{(r.stderr or r.stdout).strip()[:400]}")
            os.replace(tmp, out)  # atomic: concurrent first uses each build, one file wins
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(out))


def _build() -> ctypes.CDLL:
    lib = compile_library("codebook_host", SOURCES, ("-lm",))
    lib.tp_path.restype = ctypes.c_int
    lib.tp_path.argtypes = []
    lib.tp_limit_path.restype = ctypes.c_int
    lib.tp_limit_path.argtypes = [ctypes.c_int]
    L, P, I = ctypes.c_long, ctypes.c_void_p, ctypes.c_int
    lib.tp_codebook_gemv.restype = I
    lib.tp_codebook_gemv.argtypes = [P, L, L, L, P, L, P, P, L, L, I, P, L, I, I]
    lib.tp_codebook_dequant.restype = I
    lib.tp_codebook_dequant.argtypes = [P, L, P, P, L, L, L, L, I, P, L]
    lib.tp_gemv_multi.restype = I
    lib.tp_gemv_multi.argtypes = [P, L, L, L, I, P, I, P, L, P, P, L, I, I, I]
    F = ctypes.c_float
    lib.tp_gemv_multi_norm.restype = I
    lib.tp_gemv_multi_norm.argtypes = [P, L, L, L, P, F, F, I, P, I, P, L, P, P, L, I, I, I]
    lib.tp_gemv_multi_list.restype = I
    lib.tp_gemv_multi_list.argtypes = [P, L]
    lib.tp_q8_prepare.restype = I
    lib.tp_q8_prepare.argtypes = [P, L, L, L, I, P, P, P]
    lib.tp_q8_no_vnni.restype = I
    lib.tp_q8_no_vnni.argtypes = [I]
    lib.tp_dense_layer.restype = I
    lib.tp_dense_layer.argtypes = [P, P, L, L, P, L, L, I, P, P, P, P, L, L, L, I]
    lib.tp_rmsnorm.restype = I
    lib.tp_rmsnorm.argtypes = [P, L, L, L, P, F, F, P, L]
    lib.tp_rope_kv.restype = I
    lib.tp_rope_kv.argtypes = [P, L, P, L, P, L, L, L, L, L, L, I, P, P, P, P, L, L, L, P]
    lib.tp_attend.restype = I
    lib.tp_attend.argtypes = [P, L, P, L, P, L, L, L, L, L, L, I, P, P, P, P, L, L, L, L, F, F, P, P, L, I]
    lib.tp_ggml_gemv.restype = I
    lib.tp_ggml_gemv.argtypes = [P, L, L, L, P, L, I, L, P, L, I, I]
    lib.tp_ggml_dequant.restype = I
    lib.tp_ggml_dequant.argtypes = [P, L, I, L, L, L, P, L]
    return lib


def _load():
    global _lib, _err, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _err = str(e)
                import warnings
                warnings.warn(f"trapetum: host kernels unavailable, the CPU dequantizes and multiplies ({_err})")
            _tried = True
    return _lib


def library():
    """The loaded library (ctypes), or None when unavailable (kernels/host_ops.py calls its step ops)."""
    return _load()


def available() -> bool:
    """Whether the host kernels are built (building them on first call)."""
    return _load() is not None


def error() -> str | None:
    """Why the host kernels are unavailable (None when they are, or were not tried yet)."""
    return _err


def best_path() -> str:
    """The code path of calls that name none (one of ``PATHS``): the best this CPU runs, unless ``limit_path`` caps
    it; the kernels must be available."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"host kernels unavailable: {_err}")
    return PATHS[lib.tp_path()]


def limit_path(path: str | None) -> str:
    """Cap, for this process, the code path of every later host call that names none (the CPU step's, the decode's)
    at ``path`` (one of ``PATHS``; None removes the cap). For benchmarks: a lower path's speed on this CPU, e.g. what
    an AVX2-only machine runs, measured on an AVX-512 one (``bench_cpu --host-path``). Returns the path such calls
    take now (``best_path``); a path above this CPU's best leaves its best."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"host kernels unavailable: {_err}")
    if path is not None and path not in PATHS:
        raise ValueError(f"host path: expected one of {', '.join(PATHS)}, got {path!r}")
    return PATHS[lib.tp_limit_path(-1 if path is None else PATHS.index(path))]


def supports(bits: int) -> bool:
    return bits in HOST_BITS


class SharedTables(NamedTuple):
    """The shared storage of a weight's tables (module docstring): rows of group g = n // group_rows share
    ``shared[g]``, scaled by ``scale[n]``."""
    shared: torch.Tensor  # fp16 [ceil(N / G), 2**bits]
    scale: torch.Tensor  # fp16 [N]
    group_rows: int


class Int8Tables(NamedTuple):
    """A 4-bit weight's tables in the int8 numerics (``NUMERICS`` "int8", host/codebook_host_q8.c's file comment):
    row n's weights are ``scale[n] * q[n, e]``, q = round(c / scale), scale = max |c| / 127 of the row's fp16
    centroids c (``int8_tables``, made once when the weight is loaded); ``source``: the tables they were made
    from (fp16 [N, 16] or ``SharedTables``), kept for the checks of the modules that hold them."""
    q: torch.Tensor  # int8 [N, 16]
    scale: torch.Tensor  # fp32 [N]
    source: object


class Int8Weights(NamedTuple):
    """An 8-bit weight in the int8 numerics (host/codebook_host_q8.c's file comment, its dense form): its 256-entry
    tables rounded to int8 as ``Int8Tables`` rounds 16-entry ones (q, scale), then looked up once when the weight is
    loaded (``int8_weights``) into ``w[n, k] = q[n, idx(n, k)]``, int8 [N, Kq] (Kq: K rounded up to 128, zeros
    past K) in the q8 order (per 128 columns the 64 even then the 64 odd: ``q8_order``): the same bytes as the
    codes, read by an int8 dot with no lookup (the codes are not read). ``source``: the tables they were made from."""
    w: torch.Tensor  # int8 [N, Kq]
    scale: torch.Tensor  # fp32 [N]
    source: object


def q8_order(K: int) -> torch.Tensor:
    """int64 [Kq]: the natural column at each place of the q8 order (Kq = K rounded up to 128; per 128 columns the
    64 even columns, then the 64 odd ones)."""
    Kq = -(-K // 128) * 128
    p = torch.arange(Kq)
    return (p // 128) * 128 + (p % 128 % 64) * 2 + (p % 128) // 64


def _int8_rows(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, s fp32 [N]) of fp32 centroids c [N, E]: s = max |c| / 127, q = round(c / s) (0 where s is 0)."""
    s = c.abs().amax(1) / 127.0
    q = torch.where(s.unsqueeze(1) > 0, torch.round(c / s.unsqueeze(1).clamp_min(torch.finfo(torch.float32).tiny)),
                    torch.zeros(()))
    return q.clamp(-127, 127).to(torch.int8).contiguous(), s.contiguous()


def int8_weights(codes: torch.Tensor, tables, in_features: int, rows: int = 4096) -> Int8Weights:
    """The int8 numerics' dense form of an 8-bit weight (``Int8Weights``), looked up ``rows`` rows at a time."""
    K, N = int(in_features), int(codes.shape[0])
    check_weight(codes, tables, 8, K)
    order = q8_order(K)
    Kq = order.numel()
    w = torch.zeros(N, Kq, dtype=torch.int8)
    scale = torch.empty(N, dtype=torch.float32)
    valid = order < K
    src = order.clamp_max(K - 1)
    for n0 in range(0, N, rows):
        n1 = min(n0 + rows, N)
        q, scale[n0:n1] = _int8_rows(row_centroids(tables, N, 8, n0, n1))
        idx = codes[n0:n1, :K].long()
        wn = torch.gather(q, 1, idx)  # [rows, K] natural order
        w[n0:n1] = torch.where(valid, wn[:, src], torch.zeros((), dtype=torch.int8))
    return Int8Weights(w, scale, tables)


def int8_form(codes: torch.Tensor, tables, bits: int, in_features: int):
    """The int8 numerics' form of a weight: ``Int8Tables`` (4-bit) or ``Int8Weights`` (8-bit)."""
    if bits == 8:
        return int8_weights(codes, tables, in_features)
    return int8_tables(tables, bits)


def row_centroids(tables, N: int, bits: int, n0: int = 0, n1: int | None = None) -> torch.Tensor:
    """fp32 [n1 - n0, 2**bits]: rows n0 .. n1 - 1's centroids (default all N; shared storage: fp16(scale * shared)
    as the C forms them)."""
    n1 = N if n1 is None else n1
    if isinstance(tables, SharedTables):
        g = torch.arange(n0, n1) // tables.group_rows
        return (tables.scale[n0:n1].float().unsqueeze(1) * tables.shared.float()[g]).to(torch.float16).float()
    return tables[n0:n1].float()


def int8_tables(tables, bits: int) -> Int8Tables:
    """The int8 numerics' tables of a 4-bit weight's ``tables`` (either storage): per row s = max |c| / 127 (fp32),
    q = round(c / s) (fp32 division, nearest even; 0 where s is 0)."""
    if bits != 4:
        raise ValueError(f"host GEMV: the int8 numerics take 4-bit codebooks, got {bits}-bit")
    N = int(tables.scale.shape[0] if isinstance(tables, SharedTables) else tables.shape[0])
    q, s = _int8_rows(row_centroids(tables, N, bits))
    return Int8Tables(q, s, tables)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 numerics' activations of x fp32 [M, K] (torch, the C prepare's definition): (xq int8 [M, K],
    d fp32 [M, ceil(K / 32)]), per block of 32 columns d = max |x| / 127, xq = round(x / d) (0 where d is 0)."""
    x = x.to(torch.float32)
    M, K = x.shape
    nb = -(-K // 32)
    xp = torch.zeros(M, nb * 32)
    xp[:, :K] = x
    xb = xp.view(M, nb, 32)
    d = xb.abs().amax(2) / 127.0
    q = torch.where(d.unsqueeze(2) > 0, torch.round(xb / d.unsqueeze(2).clamp_min(torch.finfo(torch.float32).tiny)),
                    torch.zeros(()))
    return q.clamp(-127, 127).to(torch.int8).view(M, nb * 32)[:, :K], d


def table_bytes(tables) -> int:
    """Bytes of ``tables`` as stored (what a pass over the weight reads beside its codes)."""
    ts = tables[:2] if isinstance(tables, (SharedTables, Int8Tables, Int8Weights)) else (tables,)
    return sum(t.numel() * t.element_size() for t in ts)


def table_args(tables) -> tuple[int, int | None, int]:
    """(table pointer, row-scale pointer or None, G) of the C entry points (the fp32 numerics)."""
    if isinstance(tables, SharedTables):
        return tables.shared.data_ptr(), tables.scale.data_ptr(), int(tables.group_rows)
    return tables.data_ptr(), None, 0


def segment(codes: torch.Tensor, tables) -> list[int]:
    """One weight as a segment of ``tp_gemv_multi`` (8 longs: codes, ldc, table, N, row scale or 0, G, int8 table
    or 0, int8 row scale or 0)."""
    if isinstance(tables, Int8Tables):
        return [codes.data_ptr(), codes.stride(0), 0, int(codes.shape[0]), 0, 0, tables.q.data_ptr(),
                tables.scale.data_ptr()]
    if isinstance(tables, Int8Weights):  # the dense form: its weights stand for the codes
        w = tables.w
        return [w.data_ptr(), w.stride(0), 0, int(w.shape[0]), 0, 0, w.data_ptr(), tables.scale.data_ptr()]
    tab, scale, G = table_args(tables)
    return [codes.data_ptr(), codes.stride(0), tab, int(codes.shape[0]), scale or 0, G, 0, 0]


def _check_fp16(name: str, t, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float16 or tuple(t.shape) != shape \
            or not t.is_contiguous():
        raise ValueError(f"host GEMV: {name} must be contiguous fp16 {list(shape)}, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.device.type != "cpu":
        raise ValueError("host GEMV: tensors must be on the CPU")


def check_weight(codes: torch.Tensor, tables, bits: int, in_features: int) -> int:
    """The weight's arguments of ``codebook_gemv_host`` checked (ValueError naming the one that is wrong), without
    running a GEMV; its output rows N."""
    if bits not in HOST_BITS:
        raise ValueError(f"host GEMV: {bits}-bit codes are not supported (supported: {HOST_BITS})")
    K, N = int(in_features), int(codes.shape[0])
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] != packed_width(K, bits) \
            or codes.stride(1) != 1:
        raise ValueError(f"host GEMV: codes must be uint8 [{N}, {packed_width(K, bits)}] with unit column stride, "
                         f"got {codes.dtype} {tuple(codes.shape)}")
    if codes.device.type != "cpu":
        raise ValueError("host GEMV: tensors must be on the CPU")
    if isinstance(tables, Int8Tables):
        if bits != 4:
            raise ValueError(f"host GEMV: the int8 numerics take 4-bit codes, got {bits}-bit")
        q, sc = tables.q, tables.scale
        if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or tuple(q.shape) != (N, 16) \
                or not q.is_contiguous() or not isinstance(sc, torch.Tensor) or sc.dtype != torch.float32 \
                or tuple(sc.shape) != (N,) or not sc.is_contiguous():
            raise ValueError(f"host GEMV: int8 tables must be contiguous int8 [{N}, 16] and fp32 [{N}]")
        if q.device.type != "cpu" or sc.device.type != "cpu":
            raise ValueError("host GEMV: tensors must be on the CPU")
    elif isinstance(tables, Int8Weights):
        if bits != 8:
            raise ValueError(f"host GEMV: int8 dense weights stand for 8-bit codes, got {bits}-bit")
        w, sc, Kq = tables.w, tables.scale, -(-K // 128) * 128
        if not isinstance(w, torch.Tensor) or w.dtype != torch.int8 or tuple(w.shape) != (N, Kq) \
                or not w.is_contiguous() or not isinstance(sc, torch.Tensor) or sc.dtype != torch.float32 \
                or tuple(sc.shape) != (N,) or not sc.is_contiguous():
            raise ValueError(f"host GEMV: int8 weights must be contiguous int8 [{N}, {Kq}] and fp32 [{N}]")
        if w.device.type != "cpu" or sc.device.type != "cpu":
            raise ValueError("host GEMV: tensors must be on the CPU")
    elif isinstance(tables, SharedTables):
        G = tables.group_rows
        if not isinstance(G, int) or isinstance(G, bool) or G < 1:
            raise ValueError(f"host GEMV: group_rows must be a positive integer, got {G!r}")
        _check_fp16("shared tables", tables.shared, (-(-N // G), 1 << bits))
        _check_fp16("row scales", tables.scale, (N,))
    else:
        _check_fp16("codebook", tables, (N, 1 << bits))
    return N


def codebook_gemv_host(x: torch.Tensor, codes: torch.Tensor, tables, bits: int,
                       in_features: int | None = None, *, threads: int | None = None, out: torch.Tensor | None = None,
                       path: str | None = None) -> torch.Tensor:
    """y = x W^T, W[n, k] = table_n[idx(n, k)] (module docstring: ``tables`` per-row fp16 or ``SharedTables``);
    x fp32 [M, K] (any row stride, unit column stride; other dtypes are converted), out fp32 [M, N] or None.
    Raises RuntimeError when the kernels are unavailable (check ``available()``)."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"host kernels unavailable: {_err}")
    K = int(in_features if in_features is not None else x.shape[-1])
    N = check_weight(codes, tables, bits, K)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"host GEMV: x must be [M, {K}], got {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError("host GEMV: tensors must be on the CPU")
    if x.dtype != torch.float32 or x.stride(1) != 1:
        x = x.to(torch.float32).contiguous()
    M = int(x.shape[0])
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (M, N) or out.stride(1) != 1 or out.device.type != "cpu":
        raise ValueError(f"host GEMV: out must be fp32 [{M}, {N}] on the CPU with unit column stride")
    t = torch.get_num_threads() if threads is None else int(threads)
    if t < 1:
        raise ValueError(f"host GEMV: threads must be at least 1, got {t}")
    p = -1 if path is None else PATHS.index(path)
    if isinstance(tables, (Int8Tables, Int8Weights)):
        segs = (ctypes.c_long * 8)(*segment(codes, tables))
        rc = lib.tp_gemv_multi(x.data_ptr(), x.stride(0), M, K, 1, segs, bits, out.data_ptr(), out.stride(0), None,
                               None, 0, 0, t, p)
    else:
        rc = lib.tp_codebook_gemv(x.data_ptr(), x.stride(0), M, K, codes.data_ptr(), codes.stride(0),
                                  *table_args(tables), N, bits, out.data_ptr(), out.stride(0), t, p)
    if rc != 0:
        raise RuntimeError(f"host GEMV failed (code {rc})")
    return out


class HostGemv:
    """One weight's host GEMV with its arguments checked once (the per-call cost is a ctypes call): the codes and
    tables (either storage) as ``codebook_gemv_host`` takes them, referenced (not copied) for the object's
    lifetime; ``nbytes``: what one pass reads of them."""

    def __init__(self, codes: torch.Tensor, tables, bits: int, in_features: int):
        lib = _load()
        if lib is None:
            raise RuntimeError(f"host kernels unavailable: {_err}")
        K = int(in_features)
        check_weight(codes, tables, bits, K)
        self.codes, self.tables, self.bits, self.in_features = codes, tables, bits, K
        self.out_features = int(codes.shape[0])
        self.nbytes = (0 if isinstance(tables, Int8Weights) else codes.numel()) + table_bytes(tables)
        self._fn, self._dq = lib.tp_codebook_gemv, lib.tp_codebook_dequant
        self.int8 = isinstance(tables, (Int8Tables, Int8Weights))
        if self.int8:  # one segment of tp_gemv_multi (the int8 numerics)
            self._fn, self._prep = lib.tp_gemv_multi, lib.tp_q8_prepare
            self._segs = (ctypes.c_long * 8)(*segment(codes, tables))
        else:
            self._args = (codes.data_ptr(), codes.stride(0), *table_args(tables), self.out_features, bits)

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """x [M, K] on the CPU -> fp32 [M, N] (a fresh tensor)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1 or x.device.type != "cpu":
            x = x.to(device="cpu", dtype=torch.float32).contiguous()
        M, K = x.shape
        if K != self.in_features:
            raise ValueError(f"host GEMV: x must be [M, {self.in_features}], got {tuple(x.shape)}")
        t = torch.get_num_threads() if threads is None else int(threads)
        if t < 1:
            raise ValueError(f"host GEMV: threads must be at least 1, got {t}")
        out = torch.empty(M, self.out_features, dtype=torch.float32)
        if self.int8:
            rc = self._fn(x.data_ptr(), x.stride(0), M, K, 1, self._segs, self.bits, out.data_ptr(),
                          self.out_features, None, None, 0, 0, t, -1)
        else:
            c, ldc, cb, sc, G, n, bits = self._args
            rc = self._fn(x.data_ptr(), x.stride(0), M, K, c, ldc, cb, sc, G, n, bits, out.data_ptr(),
                          self.out_features, t, -1)
        if rc != 0:
            raise RuntimeError(f"host GEMV failed (code {rc})")
        return out

    def dequantize(self, n0: int = 0, n1: int | None = None) -> torch.Tensor:
        """Weight rows n0 .. n1 - 1 as fp32 [n1 - n0, K] (exact), decoded in C."""
        n1 = self.out_features if n1 is None else n1
        if not 0 <= n0 <= n1 <= self.out_features:
            raise ValueError(f"host GEMV: rows {n0}..{n1} outside 0..{self.out_features}")
        if isinstance(self.tables, Int8Weights):  # s[n] * w[n, k] in the natural order (fp32 products)
            t, K = self.tables, self.in_features
            w = torch.empty(n1 - n0, t.w.shape[1], dtype=torch.float32)
            w[:, q8_order(K)] = t.w[n0:n1].float()
            return w[:, :K] * t.scale[n0:n1].unsqueeze(1)
        if self.int8:  # the int8 numerics' weights s[n] * q[n, e] (fp32 products)
            t = self.tables
            idx = unpack_codes(self.codes[n0:n1], 4, self.in_features).long()
            return torch.gather(t.q[n0:n1].float() * t.scale[n0:n1].unsqueeze(1), 1, idx)
        w = torch.empty(n1 - n0, self.in_features, dtype=torch.float32)
        c, ldc, cb, sc, G, _, bits = self._args
        if self._dq(c, ldc, cb, sc, G, n0, n1, self.in_features, bits, w.data_ptr(), self.in_features) != 0:
            raise RuntimeError("host dequantize failed")
        return w

    def matmul(self, x: torch.Tensor, rows: int = 2048) -> torch.Tensor:
        """x [T, K] -> fp32 [T, N] for many rows (prefill): ``rows`` weight rows at a time dequantized into a
        temporary and multiplied by torch (no dense copy kept; not batch-invariant, unlike the GEMV)."""
        x = x.to(torch.float32)
        if self.int8:  # x quantized as the GEMV quantizes it (the C prepare), then d * xq in fp32
            x = self.quantized_x(x)
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        for n0 in range(0, self.out_features, rows):
            n1 = min(n0 + rows, self.out_features)
            torch.matmul(x, self.dequantize(n0, n1).T, out=out[:, n0:n1])
        return out

    def quantized_x(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 numerics' activations of x fp32 [T, K] as fp32 d * xq (C's tp_q8_prepare, natural order)."""
        T, K = x.shape
        x = x.contiguous()
        Kq = -(-K // 128) * 128
        xq = torch.empty(T, Kq, dtype=torch.int8)
        dg = torch.empty(T, Kq // 8, dtype=torch.float32)
        xc = torch.empty(T, Kq // 8, dtype=torch.int32)
        self._prep(x.data_ptr(), x.stride(0), T, K, 0, xq.data_ptr(), dg.data_ptr(), xc.data_ptr())
        return xq[:, :K].float() * dg.repeat_interleave(8, 1)[:, :K]


def reference_int8(x: torch.Tensor, codes: torch.Tensor, tables,
                   in_features: int | None = None) -> torch.Tensor:
    """float64 reference of the int8 numerics: y[m, n] = s[n] * sum_k d[m, k // 32] * xq[m, k] * q[n, idx(n, k)]
    (``quantize_x``'s xq and d, the tables' q and s; ``Int8Tables`` of 4-bit codes, or ``Int8Weights``, whose
    weights w stand for q[n, idx(n, k)]) -> [M, N]."""
    K = int(in_features if in_features is not None else x.shape[-1])
    xq, d = quantize_x(x)
    if isinstance(tables, Int8Weights):
        w = torch.empty(tables.w.shape, dtype=torch.float64)
        w[:, q8_order(K)] = tables.w.double()
        w = w[:, :K]
    else:
        idx = unpack_codes(codes.contiguous(), 4, K).long()
        w = torch.gather(tables.q.double(), 1, idx)  # [N, K] integers
    xd = xq.double() * d.double().repeat_interleave(32, 1)[:, :K]
    return (xd @ w.T) * tables.scale.double().unsqueeze(0)


def reference(x: torch.Tensor, codes: torch.Tensor, tables, bits: int,
              in_features: int | None = None) -> torch.Tensor:
    """float64 dequantize-and-multiply: [M, N] (shared tables: each row's centroids fp16(scale * shared) in
    float64 arithmetic, the product exact, then rounded to fp16 as the format defines them)."""
    K = int(in_features if in_features is not None else x.shape[-1])
    idx = unpack_codes(codes.contiguous(), bits, K).long()
    if isinstance(tables, SharedTables):
        sh, sc, G = tables
        g = torch.arange(sc.shape[0]) // G
        tables = (sc.double().unsqueeze(1) * sh.double()[g]).to(torch.float16)
    w = torch.gather(tables.double(), 1, idx)
    return x.double() @ w.T
