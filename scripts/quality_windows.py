"""Perplexity over the first N windows and over all windows from one pass (QUALITY.md's protocol), for several
models and activation-sparsity settings, on the torch reference decoder in fp32 (the CPU or a GPU).

    python scripts/quality_windows.py --text wiki.test.raw --first 30 --device cuda \\
        smol.cbk smol.cbk@smol-0.25.json qwen.cbk@on ...

A spec is MODEL or MODEL@SPARSITY (a side file of thresholds, or 'on': a .cbk's own section; trapetum sparsify).
Every window of 2,048 tokens scores 2,047, so the first N windows' NLL is the mean of their per-window means,
exactly what ``trapetum ppl --windows N`` computes; one pass over all windows gives both figures. The reference
decoder in fp32 is the path of ``trapetum ppl`` on the CPU (``--device cuda`` runs the same torch code on the GPU:
``Options(engine="reference")``, not the engine's kernels). One line per spec on stdout; ``--json FILE`` appends
one JSON object per spec (per-window NLLs included).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from trapetum.api import load
from trapetum.eval.perplexity import perplexity, tokenize_file
from trapetum.settings import Options


def split_spec(spec: str) -> tuple[str, str | None]:
    """'MODEL@SPARSITY' -> (MODEL, SPARSITY); 'MODEL' -> (MODEL, None)."""
    model, sep, sparsity = spec.rpartition("@")
    return (model, sparsity) if sep and model else (spec, None)


def score(spec: str, text: str, first: int, ctx: int, device: str) -> dict:
    path, sparsity = split_spec(spec)
    t0 = time.perf_counter()
    model = load(path, device=device, dtype=torch.float32, options=Options.from_env().replace(engine="reference"),
                 sparsity=sparsity)
    ids = tokenize_file(model.tokenizer, text)
    r = perplexity(model.decoder, ids, ctx, None, progress=False)
    per = r.nll_per_window
    n = min(first, len(per))
    head = sum(per[:n]) / n
    out = {"spec": spec, "model": path, "sparsity": sparsity, "device": device, "ctx": ctx,
           "first": n, "nll_first": head, "ppl_first": math.exp(head),
           "windows": len(per), "nll_all": r.nll, "ppl_all": r.ppl, "tokens_all": r.tokens,
           "seconds": time.perf_counter() - t0, "nll_per_window": per}
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+", help="MODEL or MODEL@SPARSITY (side file or 'on')")
    ap.add_argument("--text", required=True, help="text to score (never the calibration text)")
    ap.add_argument("--first", type=int, default=30, help="also report the first N windows (default 30)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="append one JSON object per spec to this file")
    a = ap.parse_args(argv)
    if a.first < 1:
        ap.error("--first must be at least 1")
    print(f"| spec | PPL (NLL), first {a.first} windows | PPL (NLL), all windows | windows | s |")
    print("|---|---|---|---|---|")
    for spec in a.specs:
        r = score(spec, a.text, a.first, a.ctx, a.device)
        print(f"| {spec} | {r['ppl_first']:.3f} ({r['nll_first']:.4f}) | {r['ppl_all']:.3f} ({r['nll_all']:.4f}) | "
              f"{r['windows']} | {r['seconds']:.0f} |", flush=True)
        if a.json:
            with open(a.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
