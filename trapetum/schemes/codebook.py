"""Per-row scalar codebooks (scheme "codebook"): 2/3/4/8-bit indices into 2**bits fp16 centroids per output row.

Stored (``QuantRecord("codebook", (out, in), {"bits": b}, {"codes", "codebook"})``):
    codes     uint8 [out, packed_width(in, b)]   canonical packing (kernels/pack.py)
    codebook  fp16  [out, 2**b]                  W[o, i] = codebook[o, idx(o, i)]
or with the codebook stored compactly (params "codebook", .cbk version 2; ``codebook_store.py``), expanded to the
fp16 [out, 2**b] codebook above by ``expand`` before an engine projection is built; the reference modules expand
"u8" and keep "shared" as stored (``host_tables``): the host GEMV forms each row's table from the group's table
and the row scale (kernels/host_gemv.py, bitwise the expanded tables), the other paths decode them on use.
Reference: ``CodebookLinear`` (dequantize, then matmul; the dense copy is cached: reference speed over memory;
``use_host()``: 4/8-bit fp32 inputs on the CPU through kernels/host_gemv.py, no dense copy: up to 16 rows the
batch-invariant GEMV on the stored codes in place, more rows blocks dequantized into a temporary and a matmul) and ``CodebookEmbedding`` (an embedding table stored so; gathers rows). Engine: ``CodebookProjection``: parts
that share an input concatenated along their rows (per-row codebooks make that a plain concatenation), codes in
the tensor-core kernel's tiled layout when the CUDA kernels run (4/8-bit, 64 code bytes per row | in); the
GEMV is batch-invariant (kernels/codebook_gemv.py). Gate/up: ``InterleavedGateUp``, rows interleaved 8 gate /
8 up so that act(gate) * up comes out of the GEMV's epilogue. Prefill dequantizes (exact: the fp16 centroids
are the weights).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FormatError
from ..kernels import codebook_gemv as cg
from ..kernels import cuda_ext
from ..kernels import host_gemv as hg
from ..kernels.codebook_layout import interleave_gate_up, tile_codes, untile_codes
from ..kernels.dequant import dequantize as dequantize16
from ..kernels.pack import SUPPORTED_BITS, packed_width, unpack_codes
from ..kernels import sparse_mma
from ..kernels.sparse_gemv import SPARSE_BITS, input_major_codes, sparse_project
from ..settings import DEFAULT_KERNELS, KernelOptions
from .base import GateUp, Part, Projection, Scheme, cat_bias, residual16
from .codebook_store import check_compact, decode_shared, expand, storage_of
from .record import QuantRecord


def host_tables(record: QuantRecord):
    """A checked codebook record's tables as the host GEMV and ``CodebookLinear`` take them: the fp16 [out, 2**b]
    codebook (storages "f16", "u8": expanded), or ``SharedTables`` for "shared" (kept as stored)."""
    if storage_of(record.params) == "shared":
        t = record.tensors
        return hg.SharedTables(t["codebook_shared"], t["row_scale"], int(record.params["group_rows"]))
    return expand(record).tensors["codebook"]


class CodebookLinear(nn.Module):
    """y = x W^T + b with W[o, i] = table_o[codes[o, i]] (per output row codebook). ``tables``: the fp16
    [out, 2**bits] codebook (buffer ``codebook``) or ``hg.SharedTables`` (buffers ``codebook_shared``,
    ``row_scale``; ``group_rows``), as ``host_tables`` gives them; ``centroids()``: the per-row form."""

    def __init__(self, codes: torch.Tensor, tables, in_features: int, bits: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(codes.shape[0])
        self.bits = int(bits)
        self.register_buffer("codes", codes.contiguous())  # uint8 [out, packed_width(in, bits)]
        self.group_rows: int | None = None
        if isinstance(tables, hg.SharedTables):
            self.register_buffer("codebook_shared", tables.shared.contiguous())  # fp16 [ceil(out / G), 2**bits]
            self.register_buffer("row_scale", tables.scale.contiguous())  # fp16 [out]
            self.group_rows = int(tables.group_rows)
        else:
            self.register_buffer("codebook", tables.contiguous())  # fp16 [out, 2**bits]
        self.register_buffer("bias", None if bias is None else bias.contiguous())
        self.host: hg.HostGemv | None = None  # use_host(): the host GEMV on the CPU
        self.host_threads: int | None = None

    def use_host(self, threads: int | None = None, numerics: str = "fp32") -> bool:
        """Multiply fp32 inputs on the CPU by the host GEMV (kernels/host_gemv.py: the codes decoded in place,
        batch-invariant rows, the same bits for every thread count) and drop the dense copy; ``threads``: None is
        ``torch.get_num_threads()`` at each call. ``numerics`` "int8" (``Options.host_numerics``): a 4-bit weight
        runs the int8 dot on int8 tables, an 8-bit one on int8 weights looked up once (``hg.int8_form``, made
        here; other numbers). False
        (nothing changes) where it does not apply: other bit widths, codes not on the CPU, the kernels unavailable
        (no compiler: warned once)."""
        if numerics not in hg.NUMERICS:
            raise ValueError(f"host numerics: expected one of {', '.join(hg.NUMERICS)}, got {numerics!r}")
        if not hg.supports(self.bits) or self.codes.device.type != "cpu" or not hg.available():
            return False
        tables = self.tables()
        if numerics == "int8":
            tables = hg.int8_form(self.codes, tables, self.bits, self.in_features)
        self.host, self.host_threads = hg.HostGemv(self.codes, tables, self.bits, self.in_features), threads
        self.__dict__.pop("_dense", None)
        return True

    def tables(self):
        """The tables as stored here: the fp16 codebook [out, 2**bits] or ``hg.SharedTables``."""
        if self.group_rows is None:
            return self.codebook
        return hg.SharedTables(self.codebook_shared, self.row_scale, self.group_rows)

    def centroids(self) -> torch.Tensor:
        """fp16 [out, 2**bits]: each row's centroids (shared storage: decoded now, ``decode_shared``)."""
        if self.group_rows is None:
            return self.codebook
        return decode_shared(self.codebook_shared, self.row_scale, self.group_rows)

    def host_current(self) -> bool:
        """Whether ``host`` still reads this module's tensors (not moved or cast since ``use_host``)."""
        h = self.host
        if h is None or h.codes is not self.codes:
            return False
        t = h.tables
        if isinstance(t, (hg.Int8Tables, hg.Int8Weights)):  # the int8 form was made from these
            t = t.source
        if self.group_rows is None:
            return t is self.codebook
        return isinstance(t, hg.SharedTables) and t.shared is self.codebook_shared and t.scale is self.row_scale

    def to_record(self) -> QuantRecord:
        if self.group_rows is None:
            params, tensors = {"bits": self.bits}, {"codebook": self.codebook.cpu()}
        else:
            params = {"bits": self.bits, "codebook": "shared", "group_rows": self.group_rows}
            tensors = {"codebook_shared": self.codebook_shared.cpu(), "row_scale": self.row_scale.cpu()}
        return QuantRecord(scheme="codebook", shape=(self.out_features, self.in_features), params=params,
                           tensors={"codes": self.codes.cpu(), **tensors},
                           bias=None if self.bias is None else self.bias.cpu())

    def indices(self) -> torch.Tensor:
        """Unpacked indices, int64 [out, in]."""
        return unpack_codes(self.codes, self.bits, self.in_features).long()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact weight this module multiplies by: [out, in] (fp16 centroids cast to dtype)."""
        return torch.gather(self.centroids().to(dtype), 1, self.indices())

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize(torch.float32)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` of the weight (for a quantized embedding table): [..., in]."""
        flat = ids.reshape(-1)
        codes = unpack_codes(self.codes[flat], self.bits, self.in_features).long()
        if self.group_rows is None:
            book = self.codebook[flat]
        else:  # the rows' centroids only (decode_shared of the rows' scales and groups' tables)
            book = decode_shared(self.codebook_shared[flat // self.group_rows], self.row_scale[flat], 1)
        rows = torch.gather(book.to(dtype), 1, codes)
        return rows.view(*ids.shape, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        host = self.host
        if host is not None and x.device.type == "cpu" and x.dtype == torch.float32 and self.host_current():
            rows = x.reshape(-1, self.in_features)
            # up to 16 rows (decode, verify): the batch-invariant GEMV; more (prefill): dequantized blocks, matmul
            y = host(rows, self.host_threads) if rows.shape[0] <= hg.GEMV_ROWS else host.matmul(rows)
            if self.bias is not None:
                y.add_(self.bias.to(y.dtype))
            return y.view(*x.shape[:-1], self.out_features)
        # dequantize once, then matmul; the dense copy is cached (the reference path trades memory for speed:
        # decode on the CPU would otherwise unpack every weight at every token)
        cached = self.__dict__.get("_dense")
        if cached is None or cached.dtype != x.dtype or cached.device != x.device:
            cached = self.__dict__["_dense"] = self.dequantize(x.dtype).to(x.device)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, cached, b)

    def storage_bytes(self) -> int:
        n = self.codes.numel() * self.codes.element_size() + hg.table_bytes(self.tables())
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def bits_per_weight(self) -> float:
        """Index bits + table bits per weight (bias excluded), as stored here."""
        n = self.codes.numel() * 8 + hg.table_bytes(self.tables()) * 8
        return n / (self.out_features * self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"bias={self.bias is not None}")


class CodebookEmbedding(CodebookLinear):
    """Embedding table stored as a per-row codebook: forward(ids [...]) -> [..., hidden]."""

    def __init__(self, codes, tables, in_features, bits, dtype: torch.dtype = torch.float32):
        super().__init__(codes, tables, in_features, bits, None)
        self.num_embeddings, self.embedding_dim = self.out_features, self.in_features
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids, self.dtype)

    def use_host(self, threads: int | None = None, numerics: str = "fp32") -> bool:
        return False  # a table gathers rows (its tied head is a CodebookLinear of its own: ``as_linear``)

    def as_linear(self) -> CodebookLinear:
        """The tied LM head: a projection sharing this table's codes and tables (no copy)."""
        return CodebookLinear(self.codes, self.tables(), self.in_features, self.bits, None)


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise FormatError(f"quantized tensor {name}: {msg}")


def record_shape(record: QuantRecord, name: str) -> tuple[int, int]:
    """The record's logical (out, in), checked: two positive integers below 2^31."""
    shape = record.shape
    _check(isinstance(shape, (tuple, list)) and len(shape) == 2
           and all(isinstance(s, int) and not isinstance(s, bool) and 0 < s < 1 << 31 for s in shape),
           name, f"logical shape must be two positive integers, got {shape!r}")
    return int(shape[0]), int(shape[1])


def check_bias(record: QuantRecord, out_f: int, name: str) -> torch.Tensor | None:
    b = record.bias
    if b is None:
        return None
    _check(isinstance(b, torch.Tensor) and b.dim() == 1 and b.shape[0] == out_f, name,
           f"bias must have shape [{out_f}], got {tuple(getattr(b, 'shape', ()))}")
    _check(b.is_floating_point(), name, f"bias must be floating point, got {b.dtype}")
    return b


def _tiled_ok(bits: int, kb: int, device, kopts: KernelOptions) -> bool:
    """Whether the engine keeps these codes in the tensor-core kernel's tiled layout."""
    return bits in (4, 8) and kb % 64 == 0 and cuda_ext.ready(torch.device(device), kopts) is not None


class CodebookProjection(Projection):
    """Engine form: canonical or tiled codes ([ceil(N/16)*16, KB], ``tile_codes``) and fp16 codebooks."""
    kind = "codebook"

    def __init__(self, codes: torch.Tensor, codebook: torch.Tensor, bits: int, in_features: int,
                 bias: torch.Tensor | None, kopts: KernelOptions = DEFAULT_KERNELS, bias_lo=None):
        self.out_features, self.in_features, self.bits = codes.shape[0], in_features, bits
        self.kopts = kopts
        self.tiled = _tiled_ok(bits, codes.shape[1], codes.device, kopts)
        self.codes = tile_codes(codes) if self.tiled else codes.contiguous()
        self.rows_per_call = cg.MAX_GROUPED_ROWS if self.tiled else 16  # mma kernel: groups of 16 in one launch
        self.codebook = codebook.to(torch.float16).contiguous()
        self.bias, self.bias_lo = bias, bias_lo
        self.ct: torch.Tensor | None = None  # input-major codes of the sparse GEMV (enable_sparse)

    @property
    def sparse_ready(self) -> bool:
        return self.ct is not None

    def enable_sparse(self) -> bool:
        """Keep the input-major codes ``ct`` [in, packed_width(out)] (kernels/sparse_gemv.py; for 4-bit under
        sparse_kernel "mma", the default, where the extension runs and in <= sparse_mma.MAX_K, the tile-major uint8
        [ceil(out/128), in, 64] of kernels/sparse_mma.py) beside the dense kernel's codes, for the activation-sparse
        GEMV of DECODE / VERIFY rows: the code bytes twice (the dense codes still serve PREFILL and passes of more
        than ``KernelOptions.sparse_rows`` rows). False (nothing kept) for other bit widths."""
        if self.bits not in SPARSE_BITS:
            return False
        if self.ct is None:
            if self.bits == 4 and self.in_features <= sparse_mma.MAX_K and \
                    sparse_mma.ready(self.codes.device, self.kopts):  # the tensor-core kernel's layout
                self.ct = sparse_mma.tile_codes(self.canonical_codes(), self.in_features)
            else:
                self.ct = input_major_codes(self.canonical_codes(), self.bits, self.in_features)
        return True

    def sparse_gemv(self, x, t, dense, out, residual=None):
        """out fp16 [M, out] = where(|x| > t | dense, x, 0) W^T (+ residual) (+ bias): ``sparse_project``."""
        sparse_project(x, self.ct, self.codebook, self.bits, self.out_features, threshold=t, dense_rows=dense,
                       out=out, residual=residual, kernel=self.kopts.sparse_kernel, kopts=self.kopts)
        return self._add_bias(out)

    def gemv(self, x, out, residual=None):
        cg.codebook_gemv(x, self.codes, self.codebook, self.bits, residual, out=out, tiled=self.tiled,
                         kopts=self.kopts)
        return self._add_bias(out)

    def reads_fragments(self, m):
        return cg.reads_fragments(m, self.bits, self.tiled, self.kopts)

    def canonical_codes(self) -> torch.Tensor:
        return untile_codes(self.codes, self.out_features) if self.tiled else self.codes

    def weight16(self):
        return dequantize16(self.canonical_codes(), self.codebook, self.bits, self.in_features, kopts=self.kopts)

    def nbytes(self):
        n = self.codes.numel() + self.codebook.numel() * 2 + (0 if self.bias is None else self.bias.numel() * 2)
        return n + (0 if self.ct is None else self.ct.numel() * self.ct.element_size())


class InterleavedGateUp(GateUp):
    """act(gate(x)) * up(x) in one GEMV on rows interleaved 8 gate / 8 up (``interleave_gate_up``), the
    activation in the kernel's epilogue."""
    kind = "codebook"

    def __init__(self, proj: CodebookProjection, f: int, act: str):
        self.proj, self.f, self.act = proj, f, act
        self.writes_fragments = proj.tiled  # the mma kernel's epilogue writes them
        self.rows_per_call = proj.rows_per_call

    def gemv(self, x, out, out_frag_bits=None):
        p = self.proj
        return cg.codebook_gemv_gate_up(x, p.codes, p.codebook, p.bits, self.f, self.act, out=out, tiled=p.tiled,
                                        out_frag_bits=out_frag_bits, kopts=p.kopts)

    def reads_fragments(self, m):
        return self.proj.reads_fragments(m)

    @property
    def sparse_ready(self) -> bool:
        return self.proj.ct is not None

    def enable_sparse(self) -> bool:
        return self.proj.enable_sparse()

    def sparse_gemv(self, x, t, dense, out):
        """out fp16 [M, f] = act(gate) * up of where(|x| > t | dense, x, 0): ``sparse_project`` on the interleaved
        rows."""
        p = self.proj
        return sparse_project(x, p.ct, p.codebook, p.bits, p.out_features, threshold=t, dense_rows=dense, out=out,
                              act=self.act, f=self.f, kernel=p.kopts.sparse_kernel, kopts=p.kopts)

    def halves(self, x, linear):
        w = self.proj.weight16().view(-1, 2, 8, self.proj.in_features)  # [fp/8, gate|up, 8, K]
        g = w[:, 0].reshape(-1, self.proj.in_features)[: self.f]
        u = w[:, 1].reshape(-1, self.proj.in_features)[: self.f]
        return linear(x, g), linear(x, u)

    def nbytes(self):
        return self.proj.nbytes()


class CodebookScheme(Scheme):
    name = "codebook"

    def check(self, record: QuantRecord, name: str) -> None:
        out_f, in_f = record_shape(record, name)
        bits = record.params.get("bits") if isinstance(record.params, dict) else None
        _check(isinstance(bits, int) and not isinstance(bits, bool) and bits in SUPPORTED_BITS, name,
               f"codebook bits must be one of {SUPPORTED_BITS}, got {bits!r}")
        record = check_compact(record, name, out_f, 1 << bits)  # "u8" expanded; "shared" checked as stored
        shared = storage_of(record.params) == "shared"
        if not shared:
            extra = set(record.tensors) - {"codes", "codebook"}
            _check({"codes", "codebook"} <= set(record.tensors), name,
                   f"codebook scheme needs tensors 'codes' and 'codebook', got {sorted(record.tensors)}")
            _check(not extra, name, f"unexpected tensors {sorted(extra)} for the codebook scheme")
        codes = record.tensors["codes"]
        _check(isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8, name,
               f"codes must be uint8, got {getattr(codes, 'dtype', type(codes).__name__)}")
        want_codes = (out_f, packed_width(in_f, bits))
        _check(tuple(codes.shape) == want_codes, name,
               f"codes shape {tuple(codes.shape)} != {want_codes} for a {bits}-bit {out_f}x{in_f} matrix")
        if not shared:
            cb = record.tensors["codebook"]
            _check(isinstance(cb, torch.Tensor) and cb.dtype == torch.float16, name,
                   f"codebook must be float16, got {getattr(cb, 'dtype', type(cb).__name__)}")
            want_cb = (out_f, 1 << bits)
            _check(tuple(cb.shape) == want_cb, name, f"codebook shape {tuple(cb.shape)} != {want_cb}")
            _check(bool(torch.isfinite(cb).all()), name, "codebook holds non-finite values")
        check_bias(record, out_f, name)

    def module(self, record: QuantRecord, name: str) -> CodebookLinear:
        self.check(record, name)
        return CodebookLinear(record.tensors["codes"], host_tables(record), record.shape[1], record.params["bits"],
                              record.bias)

    def reference(self, weight, bias, name, dtype, device):
        mod = self.module(weight, name)
        if mod.bias is not None and dtype is not None:
            mod.bias = mod.bias.to(dtype)
        return mod.to(device) if device is not None else mod

    def embedding(self, record: QuantRecord, name: str, dtype, device) -> CodebookEmbedding:
        if record.bias is not None:
            raise FormatError(f"quantized tensor {name}: an embedding has no bias")
        lin = self.module(record, name)
        return CodebookEmbedding(lin.codes, lin.tables(), lin.in_features, lin.bits, dtype=dtype).to(device)

    def can_concat(self, parts: list[Part]) -> bool:
        return len({p.weight.params["bits"] for p in parts}) == 1

    def projection(self, parts: list[Part], device, kopts=DEFAULT_KERNELS, precise=False):
        for p in parts:
            self.check(p.weight, p.name)
        codes = torch.cat([p.weight.tensors["codes"].to(device) for p in parts])
        cb = torch.cat([expand(p.weight).tensors["codebook"].to(device) for p in parts])
        bias, bias_exact = cat_bias(parts, device)
        return CodebookProjection(codes, cb, parts[0].weight.params["bits"], parts[0].in_features, bias, kopts,
                                  residual16(bias_exact, bias) if precise else None)

    def gate_up(self, gate, up, act, device, kopts=DEFAULT_KERNELS, precise=False):
        for p in (gate, up):
            self.check(p.weight, p.name)
        g, u = expand(gate.weight), expand(up.weight)
        if g.params["bits"] != u.params["bits"] or gate.bias is not None or up.bias is not None \
                or tuple(g.shape) != tuple(u.shape):
            return None
        codes, cb, f = interleave_gate_up(g.tensors["codes"].to(device), g.tensors["codebook"].to(device),
                                          u.tensors["codes"].to(device), u.tensors["codebook"].to(device))
        return InterleavedGateUp(CodebookProjection(codes, cb, g.params["bits"], gate.in_features, None, kopts), f, act)

    def dequantize(self, weight, dtype=torch.float32):
        return self.module(weight, "?").dequantize(dtype)


CODEBOOK = CodebookScheme()
