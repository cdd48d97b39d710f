"""Is the source already quantized? ``already_quantized`` reads the stored formats of a checkpoint's projections
(a GGUF's ``Q4_1``, ``Q4_K``, ``IQ3_S``, ...) and says so when most of them use no more bits per weight than
``quantize`` is asked for: re-quantizing such a file adds a second rounding on top of the first, and the
``.cbk`` need not come out smaller (a Q4 GGUF holds about 4.5-5 bits per weight with its scales)."""
from __future__ import annotations

import re
from collections import Counter

_GGUF_BITS = re.compile(r"^(?:I?Q|TQ)(\d)")  # Q4_1 -> 4, Q8_0 -> 8, IQ2_XS -> 2, TQ1_0 -> 1


def nominal_bits(fmt: str) -> int | None:
    """Index bits of a stored quantized format name (``Q4_K`` -> 4), None for float formats."""
    m = _GGUF_BITS.match(fmt.upper())
    return int(m.group(1)) if m else None


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
