"""One command for the QUALITY.md tables: reference vs codebooks vs RTN int4 g128, per model.

    python scripts/quality.py --model SmolLM2-135M-Instruct=PATH.gguf [--model NAME=PATH ...] \
        --text ../shared/data/wikitext-2-raw/wiki.test.raw \
        --calib ../shared/data/wikitext-2-valid-tokenized/valid.txt \
        --windows 30 --all-windows --device cuda --out QUALITY.md

For every model it builds the variants below, writes each codebook variant to a ``.cbk`` file
and reads it back (so the figures are those of the file), then measures: bits per weight
(codebooks / scales included) of the layer projections and of all stored tensors, file size,
perplexity on the first N windows and on all windows (``trapetum.eval.perplexity``), and greedy
agreement with the reference on a few prompts (tokens equal to the reference's greedy
continuation before the first difference, summed over prompts).

Variants: reference (dequantized source) / RTN int4 g128 (head kept at the reference) /
4-bit unweighted k-means + 8-bit head / 4-bit E[x^2]-weighted with file calibration, self-sampled
calibration, a second calibration file / the seed's recipe (grid start, 10 iterations) /
3- and 2-bit weighted / 4-bit weighted with an 8-bit embedding.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trapetum.api import load_checkpoint  # noqa: E402
from trapetum.eval.perplexity import agreement, perplexity, tokenize_file  # noqa: E402
from trapetum.eval.perplexity import greedy_tokens as greedy  # noqa: E402
from trapetum.formats.cbk import write_cbk  # noqa: E402
from trapetum.models.decoder import Decoder  # noqa: E402
from trapetum.quant.quantize import PROJ_SUFFIXES, Recipe, calibration_stats, quantize_checkpoint  # noqa: E402
from trapetum.quant.rtn import RTNLinear, rtn_bits_per_weight  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three most important inventions of the twentieth century are"]
GREEDY_TOKENS = 32


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)




def layer_bpw_dense(cfg, nbits: float) -> float:
    return nbits


def rtn_decoder(ckpt, device):
    dec = Decoder.from_checkpoint(ckpt, dtype=torch.float32, device=device).eval()
    for i in range(ckpt.config.num_layers):
        for suf in PROJ_SUFFIXES:
            name = f"model.layers.{i}.{suf}"
            m = dec.get_submodule(name)
            b = getattr(m, "bias", None)
            dec.set_submodule(name, RTNLinear.from_weight(m.dequantize().float(), 4, 128,
                                                          None if b is None else b.detach()).to(device))
    return dec


def count_params(ckpt) -> tuple[int, int]:
    """(layer projection weights, all weights) of the source."""
    cfg = ckpt.config
    from trapetum.models.schema import expected_shapes
    shapes = expected_shapes(cfg)
    proj = sum(math.prod(s) for n, s in shapes.items() if n.startswith("model.layers.") and n.endswith("_proj.weight"))
    total = sum(math.prod(s) for s in shapes.values())
    return proj, total


def run_model(label: str, path: str, args, results: dict) -> dict:
    dev = args.device
    log(f"{label}: loading {path}")
    ckpt = load_checkpoint(path)
    ids = tokenize_file(ckpt.tokenizer, args.text)
    n_all = ids.numel() // args.ctx
    log(f"{label}: {ids.numel()} test tokens, {n_all} windows of {args.ctx}")
    prompts = [ckpt.tokenizer.encode(p) for p in PROMPTS]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    n_proj, n_total = count_params(ckpt)
    rows: list[dict] = []
    model_res = {"path": os.path.basename(path), "test_tokens": int(ids.numel()), "windows_all": n_all,
                 "params_layers": n_proj, "params_total": n_total, "rows": rows,
                 "source_bytes": os.path.getsize(path) if os.path.isfile(path) else None}
    results[label] = model_res

    def evaluate(name: str, dec, extra: dict):
        t0 = time.perf_counter()
        r30 = perplexity(dec, ids, args.ctx, args.windows, progress=False)
        row = {"variant": name, **extra, "ppl_n": r30.ppl, "nll_n": r30.nll, "tokens_n": r30.tokens,
               "windows_n": r30.windows}
        if args.all_windows:
            ra = perplexity(dec, ids, args.ctx, None, progress=False)
            row.update(ppl_all=ra.ppl, nll_all=ra.nll, tokens_all=ra.tokens, windows_all=ra.windows)
        outs = [greedy(dec, p, GREEDY_TOKENS) for p in prompts]
        row["greedy"] = outs
        row["eval_seconds"] = time.perf_counter() - t0
        if rows and rows[0]["variant"].startswith("reference"):
            row["agree"] = agreement(rows[0]["greedy"], outs)
        else:
            row["agree"] = (sum(len(o) for o in outs), sum(len(o) for o in outs))
        rows.append(row)
        log(f"{label} | {name}: PPL {r30.ppl:.3f} ({r30.windows} win)"
            + (f", all {row['ppl_all']:.3f}" if "ppl_all" in row else "")
            + f", greedy {row['agree'][0]}/{row['agree'][1]}, {row['eval_seconds']:.1f} s")
        Path(args.json).write_text(json.dumps(results, indent=1))

    # reference
    ref = Decoder.from_checkpoint(ckpt, dtype=torch.float32, device=dev).eval()
    evaluate("reference (dequantized source)", ref, {"bpw_layers": 16.0, "bpw_all": 16.0, "file_bytes": None})

    # calibration statistics, computed once per source on the reference decoder
    stats = {}
    t0 = time.perf_counter()
    for key, calib in [("valid", args.calib), ("self", None), ("alt", args.calib2)]:
        if key == "alt" and not calib:
            continue
        rec = Recipe(calib=calib, calib_seqs=args.calib_seqs, seed=0)
        stats[key] = calibration_stats(ckpt, rec, device=dev, decoder=ref, progress=False, log=log)
    model_res["calibration_seconds"] = time.perf_counter() - t0
    del ref
    torch.cuda.empty_cache() if dev.startswith("cuda") else None

    # RTN int4 g128 (layer projections; LM head and embedding stay at the reference)
    dec = rtn_decoder(ckpt, dev)
    evaluate("RTN int4 g128 (head at reference)", dec,
             {"bpw_layers": rtn_bits_per_weight(4, 128),
              "bpw_all": (rtn_bits_per_weight(4, 128) * n_proj + 16 * (n_total - n_proj)) / n_total, "file_bytes": None})
    del dec

    calib_name = Path(args.calib).name
    alt_name = Path(args.calib2).name if args.calib2 else None
    variants = [
        ("4-bit codebook, unweighted k-means, 8-bit head", Recipe(weighted=False, calib="none", embed_bits=None), None),
        (f"4-bit codebook, E[x²]-weighted ({calib_name}), 8-bit head", Recipe(embed_bits=None), "valid"),
        ("4-bit codebook, E[x²]-weighted (self-sampled, default), 8-bit head", Recipe(embed_bits=None), "self"),
    ]
    if alt_name:
        variants.append((f"4-bit codebook, E[x²]-weighted ({alt_name}), 8-bit head", Recipe(embed_bits=None), "alt"))
    variants += [
        (f"4-bit codebook, seed recipe: weighted ({calib_name}), grid start, 10 iterations, 8-bit head",
         Recipe(iters=10, starts=("grid",), embed_bits=None), "valid"),
        (f"4-bit codebook, weighted ({calib_name}), 8-bit head + 8-bit embedding", Recipe(embed_bits=8), "valid"),
        (f"3-bit codebook, weighted ({calib_name}), 8-bit head", Recipe(bits=3, embed_bits=None), "valid"),
        (f"2-bit codebook, weighted ({calib_name}), 8-bit head", Recipe(bits=2, embed_bits=None), "valid"),
    ]
    if args.only:
        variants = [v for v in variants if any(s in v[0] for s in args.only)]
    for name, recipe, skey in variants:
        try:
            qm = quantize_checkpoint(ckpt, recipe, device=dev, stats=stats.get(skey) if skey else None,
                                     progress=False, log=lambda s: None)
            out = workdir / f"{label}-{len(rows)}.cbk"
            write_cbk(out, config=qm.config, dense=qm.dense, quantized=qm.quantized, tokenizer=ckpt.tokenizer,
                      recipe=recipe.to_dict(), provenance={"source": os.path.basename(path)})
            size = out.stat().st_size
            q = load_checkpoint(str(out))
            dec = Decoder.from_checkpoint(q, dtype=torch.float32, device=dev).eval()
            evaluate(name, dec, {"bpw_layers": qm.bits_per_weight("projections"), "bpw_all": qm.bits_per_weight("all"),
                                 "file_bytes": size, "quantize_seconds": qm.seconds})
            del dec, q, qm
            out.unlink()
        except Exception as e:  # keep the other variants
            import traceback
            traceback.print_exc()
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"})
    return model_res


def fmt_size(b) -> str:
    return "-" if not b else f"{b / 1e6:.1f} MB"


def render(results: dict, args, argv: list[str]) -> str:
    L = []
    for label, m in results.items():
        L.append(f"### {label}\n")
        L.append(f"Source `{m['path']}` ({fmt_size(m['source_bytes'])}); its dequantized weights are the reference "
                 f"(the source is already a 4-bit-class GGUF). {m['params_layers'] / 1e6:.1f} M of "
                 f"{m['params_total'] / 1e6:.1f} M weights are in layer projections. Test text: "
                 f"{m['test_tokens']:,} tokens.\n")
        n = args.windows
        head = (f"| variant | bits/weight, layers | bits/weight, all tensors | file | PPL, first {n} windows "
                f"| PPL, all {m['windows_all']} windows | greedy agreement |")
        L.append(head)
        L.append("|---|---|---|---|---|---|---|")
        for r in m["rows"]:
            if "error" in r:
                L.append(f"| {r['variant']} | failed: {r['error'][:80]} | | | | | |")
                continue
            ppl_all = f"{r['ppl_all']:.3f}" if "ppl_all" in r else "not run"
            bl = "16 (fp32 compute)" if r["variant"].startswith("reference") else f"{r['bpw_layers']:.3f}"
            ba = "-" if r["variant"].startswith("reference") else f"{r['bpw_all']:.3f}"
            ag = "-" if r["variant"].startswith("reference") else f"{r['agree'][0]}/{r['agree'][1]}"
            L.append(f"| {r['variant']} | {bl} | {ba} | {fmt_size(r['file_bytes'])} | {r['ppl_n']:.3f} | "
                     f"{ppl_all} | {ag} |")
        r0 = m["rows"][0]
        L.append("")
        L.append(f"PPL protocol: {r0['windows_n']} windows = {r0['tokens_n']:,} scored tokens"
                 + (f"; all windows = {r0['windows_all']} windows, {r0['tokens_all']:,} scored tokens" if "tokens_all" in r0 else "")
                 + ". Quantize times (device below): "
                 + ", ".join(f"{r['variant'].split(',')[0]} {r['quantize_seconds']:.1f} s" for r in m["rows"]
                             if "quantize_seconds" in r)
                 + f"; calibration statistics {m.get('calibration_seconds', 0):.1f} s for all sources.\n")
    return "\n".join(L)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, metavar="LABEL=PATH")
    ap.add_argument("--text", required=True)
    ap.add_argument("--calib", required=True, help="calibration text (never the test text)")
    ap.add_argument("--calib2", default=None, help="a second calibration text for the comparison")
    ap.add_argument("--calib-seqs", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=30)
    ap.add_argument("--all-windows", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", action="append", default=[], help="run only variants whose name contains this")
    ap.add_argument("--workdir", default="out/quality")
    ap.add_argument("--json", default="out/quality/results.json")
    ap.add_argument("--out", default="out/quality/QUALITY-tables.md")
    args = ap.parse_args(argv)
    if Path(args.text).resolve() == Path(args.calib).resolve():
        ap.error("calibration text must not be the evaluation text")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    t0 = time.perf_counter()
    for spec in args.model:
        label, _, path = spec.partition("=")
        run_model(label, path, args, results)
        Path(args.out).write_text(render(results, args, argv))
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    text = render(results, args, argv) + (f"\nMeasured on {dev}, fp32 compute, {time.perf_counter() - t0:.0f} s in all; "
                                          f"command: `python scripts/quality.py {' '.join(argv)}`\n")
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
