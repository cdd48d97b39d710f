"""A quantizer-independent check of a fair source (issue 23): every layer projection of each model quantized to a
GGUF block type with gguf-python (round to nearest, no importance matrix) and dequantized, then perplexity on the
CPU (fp32 reference decoder) against the unquantized model. A source whose transform handed the projections' columns
a wide scale spread (Gemma's folded norms before session 18) loses far more to the same block quantizer than the
source it came from.

    python3 scripts/dev/rotate_grid_check.py LABEL=MODEL.gguf [...] --text wiki.test.raw [--windows 2] [--qtype Q4_0]
"""
import argparse
import dataclasses
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from trapetum.eval.perplexity import perplexity, tokenize_file
from trapetum.formats.detect import load_checkpoint
from trapetum.models.decoder import Decoder

PROJ = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
        "down_proj.weight")


def block_roundtrip(w: torch.Tensor, qt: GGMLQuantizationType) -> torch.Tensor:
    a = w.to(torch.float32).numpy()
    back = quants.dequantize(quants.quantize(a, qt), qt).reshape(a.shape)
    return torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="LABEL=PATH")
    p.add_argument("--text", required=True)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--qtype", default="Q4_0")
    a = p.parse_args()
    qt = GGMLQuantizationType[a.qtype]
    torch.set_grad_enabled(False)
    rows = []
    for spec in a.models:
        label, path = spec.split("=", 1)
        ck = load_checkpoint(path)
        ids = tokenize_file(ck.tokenizer, a.text)
        t0 = time.time()
        dense = {n: (ck.tensors[n].to(torch.float32) if isinstance(ck.tensors[n], torch.Tensor) else ck.tensors[n])
                 for n in ck.tensors}
        quant = {n: block_roundtrip(t, qt) if n.endswith(PROJ) else t for n, t in dense.items()}
        ppl = []
        for tensors in (dense, quant):
            dec = Decoder.from_checkpoint(dataclasses.replace(ck, tensors=tensors), dtype=torch.float32,
                                          device="cpu").eval()
            ppl.append(perplexity(dec, ids, a.ctx, a.windows, progress=False).ppl)
            del dec
        rows.append((label, ppl[0], ppl[1], time.time() - t0))
        print(f"{label}: unquantized {ppl[0]:.3f}, {a.qtype} projections {ppl[1]:.3f} ({time.time() - t0:.0f} s)",
              file=sys.stderr)
    print(f"| source | PPL, {a.windows} windows x {a.ctx} | projections {a.qtype} (gguf-python RTN) | ratio |")
    print("|---|---|---|---|")
    for label, p0, p1, _ in rows:
        print(f"| {label} | {p0:.3f} | {p1:.3f} | {p1 / p0:.3f}x |")


if __name__ == "__main__":
    main()
