"""The scalar quantizer's recipe (``Recipe``) and its command-line helpers; ``quantize.py`` carries it out (its
docstring describes what each field does)."""
from __future__ import annotations

import fnmatch
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import ConfigError
from ..kernels.pack import SUPPORTED_BITS
from ..schemes.codebook_store import STORAGES

__all__ = ["Recipe", "bits_choices", "parse_bits_overrides"]


@dataclass
class Recipe:
    bits: int = 4
    head_bits: int | None = 8  # None: keep the LM head fp16
    embed_bits: int | None | str = "auto"  # None: fp16; "auto": source_bits.auto_embed_bits
    weighted: bool = True  # E[x^2]-weighted k-means (False: plain k-means, no calibration)
    calib: str | None = None  # text file; None: sampled from the model itself; "none": no calibration
    calib_seqs: int = 32
    calib_len: int = 512  # file windows; sampled sequences use calib_sample_len
    calib_sample_len: int = 256
    seed: int = 0
    iters: int = 60
    starts: tuple[str, ...] = ("cuberoot", "grid")
    keep_fp16: list[str] = field(default_factory=list)
    bits_overrides: list[tuple[str, int]] = field(default_factory=list)
    codebook: str = "u8"  # the layers' codebook storage (schemes/codebook_store.py): f16 | u8 | shared
    head_codebook: str = "shared"  # the embedding's / LM head's
    head_group_rows: int = 512  # rows per shared table ("shared")
    gptq: bool = False  # error-compensated assignments and Hessian refits of the layers' codebooks (gptq.py)
    gptq_rounds: int = 2
    gptq_block: int = 128
    gptq_damp: float = 0.01
    codebook8: str = "shared"  # the storage of 8-bit layer projections (a 256-entry table per row costs 3.6 bits
    #                            per weight at 576 inputs in u8, 7.1 in fp16)
    target_bpw: float | None = None  # mixed precision (allocate.py): bits per weight of the layer projections
    target_mb: float | None = None  # ... or the whole file's size in MB (10^6 bytes)
    alloc_bits: tuple[int, ...] = (2, 3, 4, 8)  # the widths the allocation chooses from
    allocation: dict | None = None  # filled by allocate.plan_bits: what was chosen and measured

    def storage_for(self, bits: int | None) -> str:
        """The codebook storage of a layer projection of this width."""
        return self.codebook8 if bits == 8 else self.codebook

    def validate(self) -> "Recipe":
        if self.target_bpw is not None and self.target_mb is not None:
            raise ConfigError("give --target-bpw or --target-size, not both")
        for what, v in [("--target-bpw", self.target_bpw), ("--target-size", self.target_mb)]:
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{what} must be a positive number, got {v!r}")
        if not self.alloc_bits or any(b not in SUPPORTED_BITS for b in self.alloc_bits):
            raise ConfigError(f"the allocation's widths must be among {bits_choices()}, got {self.alloc_bits!r}")
        for what, st in [("--codebook", self.codebook), ("--head-codebook", self.head_codebook),
                         ("codebook8", self.codebook8)]:
            if st not in STORAGES:
                raise ConfigError(f"{what} must be one of {', '.join(STORAGES)}, got {st!r}")
        if self.gptq and (not self.weighted or self.calib == "none"):
            raise ConfigError("--gptq needs calibration (its Hessians): not --calib none")
        if self.gptq and self.codebook == "shared":
            raise ConfigError("--gptq refits per-row codebooks: use --codebook u8 or f16, not shared")
        if self.gptq_rounds < 1 or self.gptq_block < 1 or not self.gptq_damp > 0:
            raise ConfigError("--gptq-rounds and the block must be >= 1, the damping > 0")
        if not isinstance(self.head_group_rows, int) or self.head_group_rows < 1:
            raise ConfigError(f"--head-group-rows must be a positive integer, got {self.head_group_rows!r}")
        for what, b in [("--bits", self.bits), ("--head-bits", self.head_bits), ("--embed-bits", self.embed_bits)]:
            if b is not None and b != "auto" and b not in SUPPORTED_BITS:
                raise ConfigError(f"{what} must be {bits_choices()}, got {b}")
        for pat, b in self.bits_overrides:
            if b not in SUPPORTED_BITS:
                raise ConfigError(f"--layer-bits {pat}={b}: bits must be {bits_choices()}")
        if self.iters < 0:
            raise ConfigError(f"--iters must be >= 0, got {self.iters}")
        return self

    def bits_for(self, name: str) -> int | None:
        """Bits for a projection (canonical name without .weight); None = keep fp16."""
        if any(fnmatch.fnmatchcase(name, p) for p in self.keep_fp16):
            return None
        for pat, b in self.bits_overrides:
            if fnmatch.fnmatchcase(name, pat):
                return b
        return self.head_bits if name == "lm_head" else self.bits

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["starts"] = list(self.starts)
        d["bits_overrides"] = [list(x) for x in self.bits_overrides]
        d["alloc_bits"] = list(self.alloc_bits)
        d["method"] = ("per-row scalar codebook, " + ("E[x^2]-weighted" if self.weighted else "unweighted")
                       + " k-means, best of starts " + "/".join(self.starts) + f", up to {self.iters} Lloyd iterations"
                       + f"; codebooks stored {self.codebook}, head/embedding {self.head_codebook}"
                       + (f" (tables of {self.head_group_rows} rows)" if self.head_codebook == "shared" else "")
                       + (f"; then GPTQ: {self.gptq_rounds} rounds of error-compensated assignments (input "
                          f"Hessians from calibration, damping {self.gptq_damp}) and Hessian-weighted codebook "
                          "refits, each row keeping its best round" if self.gptq else ""))
        return d


def bits_choices() -> str:
    """'1, 2, 3, 4 or 8': the bit widths of the scalar codebooks, as the help and the errors say them."""
    *head, last = (str(b) for b in SUPPORTED_BITS)
    return f"{', '.join(head)} or {last}"


def parse_bits_overrides(items: list[str]) -> list[tuple[str, int]]:
    """['model.layers.0.*=8', '*down_proj=8'] -> [(pattern, bits)]."""
    out = []
    for it in items:
        pat, sep, b = it.rpartition("=")
        if not sep or not pat:
            raise ConfigError(f"--layer-bits expects PATTERN=BITS, got {it!r}")
        try:
            out.append((pat, int(b)))
        except ValueError:
            raise ConfigError(f"--layer-bits {it!r}: bits must be an integer") from None
    return out
