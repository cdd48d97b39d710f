"""Is the source already quantized? ``already_quantized`` reads the stored formats of a checkpoint's projections
(a GGUF's ``Q4_1``, ``Q4_K``, ``IQ3_S``, ...) and says so when most of them use no more bits per weight than
``quantize`` is asked for: re-quantizing such a file adds a second rounding on top of the first, and the
``.cbk`` need not come out smaller (a Q4 GGUF holds about 4.5-5 bits per weight with its scales).
``larger_than_source`` says so before the work when the planned file outgrows its source (an untied embedding kept
fp16 triples a Q5_0 table's bytes). ``auto_embed_bits`` is what ``--embed-bits auto`` stores, from the embedding's
stored format: an 8-bit codebook where the source holds it at 8 bits or fewer, so that fp16 never inflates it."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

_GGUF_BITS = re.compile(r"^(?:I?Q|TQ)(\d)")  # Q4_1 -> 4, Q8_0 -> 8, IQ2_XS -> 2, TQ1_0 -> 1


def nominal_bits(fmt: str) -> int | None:
    """Index bits of a stored quantized format name (``Q4_K`` -> 4), None for float formats."""
    m = _GGUF_BITS.match(fmt.upper())
    return int(m.group(1)) if m else None


def auto_embed_bits(tied: bool, head_bits: int | None, embed_format: str | None) -> int | None:
    """Bits of the embedding under ``--embed-bits auto`` (None: fp16). Tied: the head's (``head_bits``: one table
    serves both). Untied: 8 when the source stores the embedding at 8 bits or fewer (``embed_format`` a quantized
    GGUF type: Q5_0, Q8_0, Q4_K...), the ``--embed-bits 8`` codebook; an F16 / BF16 / F32 source (or a .cbk's
    "codebook-8bit", or an unknown format) keeps it fp16, as before."""
    if tied:
        return head_bits
    b = nominal_bits(embed_format) if embed_format else None
    return 8 if b is not None and b <= 8 else None


def already_quantized(formats: dict[str, str], bits: int) -> str | None:
    """A warning when most projection weights (``model.layers.*.weight`` of a quantized format) are stored at
    ``bits`` or fewer, else None. ``formats``: canonical tensor name -> stored format (Checkpoint.tensor_formats)."""
    proj = {n: f for n, f in formats.items() if n.startswith("model.layers.") and n.endswith("_proj.weight")}
    low = Counter(f for f in proj.values() if (b := nominal_bits(f)) is not None and b <= bits)
    if not proj or sum(low.values()) * 2 <= len(proj):
        return None
    kinds = ", ".join(f"{f} x{n}" for f, n in low.most_common(3))
    return (f"warning: the source is already quantized ({kinds} of {len(proj)} projections, at most {bits} bits "
            f"each): quantizing it again to {bits} bits adds a second rounding, and the .cbk may come out no "
            "smaller; the original fp16/bf16 checkpoint gives a better file")


def source_bytes(path: str) -> int | None:
    """Bytes of a checkpoint's source: the file, or a directory's weight files (*.safetensors, *.bin, *.gguf);
    None when there is nothing to measure."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    if p.is_dir():
        n = sum(f.stat().st_size for f in p.iterdir() if f.is_file() and f.suffix in (".safetensors", ".bin", ".gguf"))
        return n or None
    return None


def larger_than_source(planned: int, source: int | None, embed_dense: bool) -> str | None:
    """A warning when the planned .cbk (``planned`` bytes) exceeds its source (``source`` bytes), else None;
    ``embed_dense``: the plan keeps the embedding fp16, so ``--embed-bits 8`` is the lever to name."""
    if source is None or planned <= source:
        return None
    hint = (" the embedding stays fp16 (--embed-bits auto keeps an untied fp16/bf16/fp32 source's); --embed-bits 8 "
            "stores it as an 8-bit codebook" if embed_dense else " fewer --bits / --head-bits or --target-size MB make it smaller")
    return (f"warning: the .cbk will be about {planned / 1e6:.1f} MB, larger than its {source / 1e6:.1f} MB source;"
            + hint)
