"""2-bit quality: our additive quantizer (AQLM 2x8 / 1x16) against scalar per-row codebooks.

Two modes, one command each; both write a Markdown report (default ``QUALITY_2BIT.md``).

Layer mode (CPU-friendly, the default): for the projections of ``--layers`` of a real model, the
E[x^2]-weighted relative weight error ||(W - Wq) diag(sqrt(h))|| / ||W diag(sqrt(h))|| (h = E[x^2] of
the input channel from calibration text, never the test file) of a 2-bit and a 4-bit scalar codebook,
of 2x8 and optionally 1x16, with bits per weight; then, with ``--windows N``, the perplexity on
wiki.test.raw of the model with exactly those layers replaced by each scheme (others unchanged):

    python scripts/quality_2bit.py --layers 0,15,29 --windows 4 --ctx 512

Full mode (the GPU machine): every scheme on the whole model through the real commands' code
(``quantize_to_cbk`` / ``quantize_additive_to_cbk``), file sizes, bits per weight and perplexity of
each ``.cbk`` read back from disk:

    python scripts/quality_2bit.py --full --device cuda --model SRC --windows 0 -o QUALITY_2BIT.md
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trapetum.quant.additive import AdditiveLinear, quantize_additive  # noqa: E402
from trapetum.quant.kmeans import kmeans_rows, weighted_error  # noqa: E402
from trapetum.schemes.codebook import CodebookLinear  # noqa: E402
from trapetum.kernels.pack import pack_codes  # noqa: E402
from trapetum.quant.quantize import PROJ_SUFFIXES, Recipe, calibration_stats  # noqa: E402

DATA = Path("/work/shared/data")
CALIB = DATA / "wikitext-2-valid-tokenized" / "valid.txt"
TEST = DATA / "wikitext-2-raw" / "wiki.test.raw"


def scalar(W, imp, bits, bias=None):
    r = kmeans_rows(W, 1 << bits, imp)
    return CodebookLinear(pack_codes(r.codes, bits), r.codebook, W.shape[1], bits, bias)


def additive(W, imp, M, nbits, args, seed, bias=None):
    r = quantize_additive(W, imp, num_codebooks=M, nbits=nbits, beam=args.beam, iters=args.iters,
                          beam_steps=args.beam_steps, kmeans_iters=args.kmeans_iters, seed=seed, device=args.device)
    return AdditiveLinear(r.codes, r.codebooks, r.scales, bias)


def set_module(root, name, mod):
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent), leaf, mod)


def layer_mode(args) -> str:
    from trapetum.api import load_checkpoint
    from trapetum.eval.perplexity import make_windows, perplexity, tokenize_file
    from trapetum.models.decoder import Decoder

    ckpt = load_checkpoint(args.model)
    t0 = time.perf_counter()
    stats = calibration_stats(ckpt, Recipe(calib=str(args.calib), calib_seqs=args.calib_seqs, calib_len=args.calib_len),
                              device=args.device, progress=False, log=print)
    t_cal = time.perf_counter() - t0
    schemes = ["scalar-2bit", "scalar-4bit", "aqlm-2x8"] + (["aqlm-1x16"] if args.with_1x16 else [])
    layers = [int(x) for x in args.layers.split(",")]
    rows, mods = [], {s: {} for s in schemes}
    for i in layers:
        for suf in PROJ_SUFFIXES:
            name = f"model.layers.{i}.{suf}"
            W = ckpt.tensors[name + ".weight"].float()
            imp = stats[name]
            # the projection's bias (Qwen2's q/k/v) stays the source's, as in the whole-model drivers
            b = ckpt.tensors.get(name + ".bias")
            b = None if b is None else b.detach().float()
            row = {"name": name, "shape": tuple(W.shape)}
            for s in schemes:
                t = time.perf_counter()
                if s.startswith("scalar"):
                    m = scalar(W, imp, int(s.split("-")[1][0]), b)
                else:
                    M, nb = (2, 8) if s == "aqlm-2x8" else (1, 16)
                    m = additive(W, imp, M, nb, args, seed=len(rows), bias=b)
                mods[s][name] = m
                row[s] = (weighted_error(W, m.dequantize(torch.float32), imp), m.bits_per_weight(),
                          time.perf_counter() - t)
            rows.append(row)
            print(name, "  ".join(f"{s} {row[s][0]:.4f} ({row[s][1]:.2f} bpw, {row[s][2]:.0f} s)" for s in schemes),
                  flush=True)
    out = ["# 2-bit quality: additive (AQLM layout) vs scalar codebooks\n",
           f"Model: `{Path(ckpt.source).name}` (its dequantized weights are the reference). Calibration: "
           f"{args.calib_seqs} windows x {args.calib_len} tokens of `{args.calib.name}` ({t_cal:.0f} s); never the "
           f"test file. Additive quantizer: beam {args.beam}, {args.iters} rounds of beam search ({args.beam_steps} "
           f"steps) + least-squares codebooks, k-means start {args.kmeans_iters} iterations, device {args.device}.\n",
           "## Weighted relative weight error per projection\n",
           "Error = ||(W - Wq) diag(sqrt(h))||_F / ||W diag(sqrt(h))||_F with h = E[x^2] of the input channel. "
           "Bits per weight include codes, codebooks and scales.\n",
           "| projection | shape | " + " | ".join(schemes) + " |", "|---|---|" + "---|" * len(schemes)]
    for r in rows:
        out.append(f"| {r['name'].replace('model.layers.', 'L')} | {r['shape'][0]}x{r['shape'][1]} | "
                   + " | ".join(f"{r[s][0]:.4f} ({r[s][1]:.2f} b)" for s in schemes) + " |")
    mean = {s: sum(r[s][0] for r in rows) / len(rows) for s in schemes}
    energy = {s: sum(r[s][0] ** 2 for r in rows) / len(rows) for s in schemes}
    out.append("| **mean** | | " + " | ".join(f"**{mean[s]:.4f}**" for s in schemes) + " |\n")
    out.append(f"2x8 vs scalar 2-bit: mean relative error {mean['aqlm-2x8']:.4f} against {mean['scalar-2bit']:.4f} "
               f"({100 * (1 - mean['aqlm-2x8'] / mean['scalar-2bit']):.1f}% lower; squared error "
               f"{100 * (1 - energy['aqlm-2x8'] / energy['scalar-2bit']):.1f}% lower).\n")
    if args.windows:
        ids = tokenize_file(ckpt.tokenizer, TEST)
        win = make_windows(ids, args.ctx, args.windows)
        dec = Decoder.from_checkpoint(ckpt, dtype=torch.float32, device=args.device).eval()
        orig = {n: dec.get_submodule(n) for n in mods[schemes[0]]}
        out.append(f"## Perplexity with layers {args.layers} replaced\n")
        out.append(f"wiki.test.raw, first {win.shape[0]} non-overlapping windows of {args.ctx} tokens, no BOS, "
                   f"{win.shape[0] * (args.ctx - 1)} scored tokens; only the projections of layers {args.layers} are "
                   f"quantized, every other weight is the source's.\n")
        out.append("| weights | PPL | NLL |\n|---|---|---|")
        for s in ["source"] + schemes:
            for n, m in (orig.items() if s == "source" else mods[s].items()):
                set_module(dec, n, m.to(args.device))
            r = perplexity(dec, ids, args.ctx, args.windows, progress=False)
            out.append(f"| {s} | {r.ppl:.3f} | {r.nll:.5f} |")
            print(s, r.line(), flush=True)
        out.append("")
    return "\n".join(out)


def full_mode(args) -> str:
    from trapetum.eval.perplexity import perplexity, tokenize_file
    from trapetum.formats.cbk import open_cbk
    from trapetum.models.decoder import Decoder
    from trapetum.quant.additive_driver import AdditiveRecipe, quantize_additive_to_cbk
    from trapetum.quant.quantize import quantize_to_cbk

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    schemes = ["scalar-4bit", "scalar-2bit", "aqlm-2x8"] + (["aqlm-1x16"] if args.with_1x16 else [])
    out = ["# 2-bit quality, whole model\n",
           f"Model `{args.model}`; calibration {args.calib_seqs} x {args.calib_len} tokens of `{args.calib.name}`; "
           f"perplexity on wiki.test.raw, non-overlapping windows of {args.ctx}, no BOS, "
           f"{'all' if not args.windows else args.windows} windows; LM head 8-bit scalar codebook in every file.\n",
           "| scheme | file bytes | bits/weight (projections) | bits/weight (all) | quantize s | PPL |",
           "|---|---|---|---|---|---|"]
    from trapetum.api import load_checkpoint

    src = load_checkpoint(args.model)  # the reference: the source dequantized (same dtype as the rows)
    dec = Decoder.from_checkpoint(src, dtype=torch.float16 if args.device == "cuda" else torch.float32,
                                  device=args.device).eval()
    r = perplexity(dec, tokenize_file(src.tokenizer, TEST), args.ctx, args.windows or None, progress=False)
    out.append(f"| source (dequantized) | - | - | - | - | {r.ppl:.3f} |")
    print(out[-1], flush=True)
    del dec, src
    for s in schemes:
        path = work / f"{s}.cbk"
        t = time.perf_counter()
        if s.startswith("scalar"):
            quantize_to_cbk(args.model, path, Recipe(bits=int(s.split("-")[1][0]), calib=str(args.calib),
                                                     calib_seqs=args.calib_seqs, calib_len=args.calib_len),
                            device=args.device)
        else:
            quantize_additive_to_cbk(args.model, path, AdditiveRecipe(
                scheme=s, calib=str(args.calib), calib_seqs=args.calib_seqs, calib_len=args.calib_len,
                beam=args.beam, iters=args.iters, beam_steps=args.beam_steps, kmeans_iters=args.kmeans_iters),
                device=args.device)
        secs = time.perf_counter() - t
        f = open_cbk(path)
        bpw = (f.recipe or {}).get("bits_per_weight", {})
        ckpt = f.to_checkpoint()
        dev = args.device
        dec = Decoder.from_checkpoint(ckpt, dtype=torch.float16 if dev == "cuda" else torch.float32, device=dev).eval()
        ids = tokenize_file(ckpt.tokenizer, TEST)
        r = perplexity(dec, ids, args.ctx, args.windows or None, progress=False)
        out.append(f"| {s} | {path.stat().st_size:,} | {bpw.get('projections', float('nan'))} | "
                   f"{bpw.get('all', float('nan'))} | {secs:.0f} | {r.ppl:.3f} |")
        print(out[-1], flush=True)
        del dec
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF dir / .gguf (default: the embedded SmolLM2-135M)")
    ap.add_argument("--full", action="store_true", help="whole-model files and perplexity (GPU machine)")
    ap.add_argument("--layers", default="0,15,29")
    ap.add_argument("--with-1x16", action="store_true")
    ap.add_argument("--calib", type=Path, default=CALIB)
    ap.add_argument("--calib-seqs", type=int, default=16)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--beam-steps", type=int, default=2)
    ap.add_argument("--kmeans-iters", type=int, default=10)
    ap.add_argument("--windows", type=int, default=0, help="perplexity windows (0: none in layer mode, all in full)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", default="/tmp/quality_2bit")
    ap.add_argument("-o", "--output", default="QUALITY_2BIT.md")
    args = ap.parse_args()
    if "wiki.test" in str(args.calib):
        ap.error("never calibrate on the test file")
    text = full_mode(args) if args.full else layer_mode(args)
    Path(args.output).write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
