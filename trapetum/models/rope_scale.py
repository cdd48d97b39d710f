"""The scalar factors of YaRN RoPE scaling, without torch (the GGUF reader's config needs them; ``rope.py`` computes
the frequencies)."""
from __future__ import annotations

import math


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor of a scaling ``scale`` (1 at or below 1): 0.1 mscale ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_mscale(scaling: dict | None) -> float:
    """DeepSeek's extra softmax-scale factor of a YaRN config: mscale(factor, mscale_all_dim)^2 (1 without it)."""
    if not scaling or scaling.get("rope_type", "default") == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    f, m = scaling.get("factor"), scaling.get("mscale_all_dim")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (f, m)):
        return 1.0  # not numbers: ModelConfig.validate refuses the scaling, naming the field
    m = yarn_mscale(float(f), float(m))
    return m * m
