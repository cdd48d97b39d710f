"""Spread of a GGUF's RMSNorm scales, the per-column factors that norm folding (`trapetum rotate`) moves into the
projections that read each norm (issue 23, the Gemma fair source). Prints, for the chosen blocks and the output
norm, min, max and max |w| over the median |w| of each stored norm weight (as stored in the file).

    python3 scripts/dev/gguf_norm_spread.py MODEL.gguf [--blocks 0,9]
"""
import argparse

import numpy as np
from gguf import GGUFReader


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf")
    p.add_argument("--blocks", default="0,9", help="block indices to print (default 0,9)")
    a = p.parse_args()
    keep = tuple(f"blk.{int(b)}." for b in a.blocks.split(",") if b) + ("output_norm",)
    for t in GGUFReader(a.gguf).tensors:
        if t.name.endswith("norm.weight") and t.name.startswith(keep):
            w = np.asarray(t.data, dtype=np.float32)
            print(f"{t.name:34s} n={w.size:5d} min {w.min():9.3f} max {w.max():9.3f} "
                  f"max|w|/median|w| {np.abs(w).max() / np.median(np.abs(w)):7.1f}")


if __name__ == "__main__":
    main()
