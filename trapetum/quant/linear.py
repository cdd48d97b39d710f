"""Quantized linear modules that replace dense projections in the decoder.

``CodebookLinear`` holds a per-row scalar codebook: packed indices ``codes`` (canonical layout,
see ``pack.py``) and fp16 centroids ``codebook`` [out, 2**bits]. Every module here follows the
projection contract of ``trapetum.models.decoder``: ``in_features``, ``out_features``,
``weight`` [out, in] (dequantized on access), ``bias``, ``forward(x[..., in])`` and
``dequantize() -> Tensor[out, in]``.

``build_linear(record)`` is what loaders call for a checkpoint entry that is a QuantRecord; it
checks every tensor against the record's declared shape and bits and raises FormatError
(never a crash or a huge allocation) when they disagree.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FormatError, UnsupportedError
from .pack import SUPPORTED_BITS, pack_codes, packed_width, unpack_codes
from ..schemes.record import QuantRecord

__all__ = ["CodebookLinear", "CodebookEmbedding", "build_linear", "build_embedding", "record_bits_per_weight"]


class CodebookLinear(nn.Module):
    """y = x W^T + b with W[o, i] = codebook[o, codes[o, i]] (per output row codebook)."""

    def __init__(self, codes: torch.Tensor, codebook: torch.Tensor, in_features: int, bits: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(codebook.shape[0])
        self.bits = int(bits)
        self.register_buffer("codes", codes.contiguous())  # uint8 [out, packed_width(in, bits)]
        self.register_buffer("codebook", codebook.contiguous())  # fp16 [out, 2**bits]
        self.register_buffer("bias", None if bias is None else bias.contiguous())

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_weight(cls, W: torch.Tensor, bits: int = 4, importance: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, **kmeans_kwargs) -> "CodebookLinear":
        """Quantize a dense weight [out, in] with weighted k-means (see ``kmeans.kmeans_rows``)."""
        from .kmeans import kmeans_rows

        res = kmeans_rows(W, 1 << bits, importance, **kmeans_kwargs)
        return cls(pack_codes(res.codes, bits), res.codebook, W.shape[1], bits,
                   None if bias is None else bias.detach().to(torch.float16))

    def to_record(self) -> QuantRecord:
        return QuantRecord(scheme="codebook", shape=(self.out_features, self.in_features),
                           params={"bits": self.bits},
                           tensors={"codes": self.codes.cpu(), "codebook": self.codebook.cpu()},
                           bias=None if self.bias is None else self.bias.cpu())

    # -- the projection contract ---------------------------------------------------------------
    def indices(self) -> torch.Tensor:
        """Unpacked indices, int64 [out, in]."""
        return unpack_codes(self.codes, self.bits, self.in_features).long()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact weight this module multiplies by: [out, in] (fp16 centroids cast to dtype)."""
        return torch.gather(self.codebook.to(dtype), 1, self.indices())

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize(torch.float32)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` of the weight (for a quantized embedding table): [..., in]."""
        flat = ids.reshape(-1)
        codes = unpack_codes(self.codes[flat], self.bits, self.in_features).long()
        rows = torch.gather(self.codebook[flat].to(dtype), 1, codes)
        return rows.view(*ids.shape, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            y = self._cuda_forward(x)
            if y is not None:
                return y
        # Reference path (CPU, or CUDA before the kernels land): dequantize once, then matmul.
        # The dense copy is cached: the reference path trades memory for speed (decode on the
        # CPU would otherwise unpack every weight at every token).
        cached = self.__dict__.get("_dense")
        if cached is None or cached.dtype != x.dtype or cached.device != x.device:
            cached = self.__dict__["_dense"] = self.dequantize(x.dtype).to(x.device)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, cached, b)

    def _cuda_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Hook for the fused GPU kernels: ``trapetum.kernels.codebook_gemv.codebook_linear(x,
        codes, codebook, bits, in_features, bias)`` when it exists and accepts this case
        (it returns None to decline); TRAPETUM_KERNELS=0 forces the reference path."""
        if os.environ.get("TRAPETUM_KERNELS", "1") == "0":
            return None
        try:
            from ..kernels import codebook_gemv
        except ImportError:
            return None
        fn = getattr(codebook_gemv, "codebook_linear", None)
        if fn is None:
            return None
        return fn(x, self.codes, self.codebook, self.bits, self.in_features, self.bias)

    # -- accounting --------------------------------------------------------------------------
    def storage_bytes(self) -> int:
        n = self.codes.numel() * self.codes.element_size() + self.codebook.numel() * self.codebook.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def bits_per_weight(self) -> float:
        """Index bits + codebook bits per weight (bias excluded)."""
        n = self.codes.numel() * 8 + self.codebook.numel() * self.codebook.element_size() * 8
        return n / (self.out_features * self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"bias={self.bias is not None}")


def record_bits_per_weight(record: QuantRecord) -> float:
    """Stored bits per logical weight of a record (all its tensors, bias excluded)."""
    out_f, in_f = record.shape
    n = sum(t.numel() * t.element_size() * 8 for t in record.tensors.values())
    return n / max(1, out_f * in_f)


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise FormatError(f"quantized tensor {name}: {msg}")


def _shape_of(record: QuantRecord, name: str) -> tuple[int, int]:
    shape = record.shape
    _check(isinstance(shape, (tuple, list)) and len(shape) == 2
           and all(isinstance(s, int) and not isinstance(s, bool) and 0 < s < 1 << 31 for s in shape),
           name, f"logical shape must be two positive integers, got {shape!r}")
    return int(shape[0]), int(shape[1])


def _check_bias(record: QuantRecord, out_f: int, name: str) -> torch.Tensor | None:
    b = record.bias
    if b is None:
        return None
    _check(isinstance(b, torch.Tensor) and b.dim() == 1 and b.shape[0] == out_f, name,
           f"bias must have shape [{out_f}], got {tuple(getattr(b, 'shape', ()))}")
    _check(b.is_floating_point(), name, f"bias must be floating point, got {b.dtype}")
    return b


def build_linear(record: QuantRecord, name: str = "?", *, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> nn.Module:
    """Turn a stored QuantRecord into the module that replaces the projection.

    scheme "codebook": params {"bits": 1|2|3|4|8}; tensors "codes" uint8 [out, packed width]
    and "codebook" fp16 [out, 2**bits]. scheme "rtn": see ``rtn.py`` (evaluation baseline).
    scheme "aqlm": delegated to ``trapetum.quant.additive.build_linear`` when present.
    Raises FormatError when tensors do not match the record's shape, dtype or parameters.
    ``dtype`` is the compute dtype of the model (the bias is cast to it; codebooks stay fp16 and
    are cast per forward to the input's dtype); ``device`` is where the module's buffers go.
    """
    mod = _build(record, name)
    if dtype is not None and getattr(mod, "bias", None) is not None:
        mod.bias = mod.bias.to(dtype)
    return mod.to(device) if device is not None else mod


def build_embedding(record: QuantRecord, name: str = "model.embed_tokens.weight", *,
                    dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> nn.Module:
    """A quantized embedding table [vocab, hidden] (scheme "codebook"): forward(ids) gathers rows."""
    if not isinstance(record, QuantRecord) or record.scheme != "codebook":
        raise FormatError(f"quantized tensor {name}: embeddings support only the codebook scheme, "
                          f"got {getattr(record, 'scheme', type(record).__name__)!r}")
    if record.bias is not None:
        raise FormatError(f"quantized tensor {name}: an embedding has no bias")
    lin = _build(record, name)
    emb = CodebookEmbedding(lin.codes, lin.codebook, lin.in_features, lin.bits, dtype=dtype or torch.float32)
    return emb.to(device) if device is not None else emb


class CodebookEmbedding(CodebookLinear):
    """Embedding table stored as a per-row codebook: forward(ids [...]) -> [..., hidden]."""

    def __init__(self, codes, codebook, in_features, bits, dtype: torch.dtype = torch.float32):
        super().__init__(codes, codebook, in_features, bits, None)
        self.num_embeddings, self.embedding_dim = self.out_features, self.in_features
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids, self.dtype)

    def as_linear(self) -> CodebookLinear:
        """The tied LM head: a projection sharing this table's codes and codebook (no copy)."""
        return CodebookLinear(self.codes, self.codebook, self.in_features, self.bits, None)


def _build(record: QuantRecord, name: str) -> nn.Module:
    if not isinstance(record, QuantRecord):
        raise FormatError(f"quantized tensor {name}: expected a QuantRecord, got {type(record).__name__}")
    scheme = record.scheme
    if scheme == "codebook":
        out_f, in_f = _shape_of(record, name)
        bits = record.params.get("bits") if isinstance(record.params, dict) else None
        _check(isinstance(bits, int) and not isinstance(bits, bool) and bits in SUPPORTED_BITS, name,
               f"codebook bits must be one of {SUPPORTED_BITS}, got {bits!r}")
        extra = set(record.tensors) - {"codes", "codebook"}
        _check({"codes", "codebook"} <= set(record.tensors), name,
               f"codebook scheme needs tensors 'codes' and 'codebook', got {sorted(record.tensors)}")
        _check(not extra, name, f"unexpected tensors {sorted(extra)} for the codebook scheme")
        codes, cb = record.tensors["codes"], record.tensors["codebook"]
        _check(isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8, name,
               f"codes must be uint8, got {getattr(codes, 'dtype', type(codes).__name__)}")
        _check(isinstance(cb, torch.Tensor) and cb.dtype == torch.float16, name,
               f"codebook must be float16, got {getattr(cb, 'dtype', type(cb).__name__)}")
        want_codes = (out_f, packed_width(in_f, bits))
        _check(tuple(codes.shape) == want_codes, name,
               f"codes shape {tuple(codes.shape)} != {want_codes} for a {bits}-bit {out_f}x{in_f} matrix")
        want_cb = (out_f, 1 << bits)
        _check(tuple(cb.shape) == want_cb, name, f"codebook shape {tuple(cb.shape)} != {want_cb}")
        _check(bool(torch.isfinite(cb).all()), name, "codebook holds non-finite values")
        return CodebookLinear(codes, cb, in_f, bits, _check_bias(record, out_f, name))
    if scheme == "rtn":
        from .rtn import RTNLinear

        return RTNLinear.from_record(record, name)
    if scheme == "aqlm":
        try:
            from .additive import build_linear as build_additive
        except ImportError:
            raise UnsupportedError(f"quantized tensor {name}: this build cannot run the 'aqlm' scheme") from None
        return build_additive(record)
    raise FormatError(f"quantized tensor {name}: unknown quantization scheme {scheme!r} "
                      f"(this build reads: codebook, rtn, aqlm)")
