"""The additive quantizer with and without the full-Hessian refinement (``--gptq``), whole model, through the real
driver (``quantize_additive_to_cbk``): writes one ``.cbk`` per variant and a JSON report of every projection's
rel. errors and (with --gptq) its Hessian objective against the diagonal start's (``hessian_gain``: the start is
the diagonal variant's result, same seed and settings). Perplexity is measured afterwards with ``trapetum ppl``.
``--table LAYERS`` instead compares the two files already in ``--out-dir`` (diag.cbk, gptq.cbk): per projection of
those layers the relative output error sqrt(E||(W - Q)x||^2 / E||Wx||^2) under the calibration's Hessians
(recomputed from the same calibration settings), and the objective ratio over every projection.

    python scripts/additive_gptq_quality.py --model SRC.gguf --calib valid.txt --iters 1 --kmeans-iters 8 \\
        --calib-seqs 8 --variants diag,gptq --out-dir /tmp/agq
    python scripts/additive_gptq_quality.py --model SRC.gguf --calib valid.txt --calib-seqs 8 --out-dir /tmp/agq \\
        --table 0,10,20,29
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trapetum.quant.additive_driver import AdditiveRecipe, quantize_additive_to_cbk  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--calib", required=True)
    ap.add_argument("--calib-seqs", type=int, default=8)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--scheme", default="aqlm-2x8")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--beam-steps", type=int, default=2)
    ap.add_argument("--kmeans-iters", type=int, default=8)
    ap.add_argument("--gptq-rounds", type=int, default=2)
    ap.add_argument("--variants", default="diag,gptq")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out-dir", default="/tmp/additive_gptq")
    ap.add_argument("--table", default=None, metavar="LAYERS", help="compare diag.cbk and gptq.cbk (see above)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.table is not None:
        return table(args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for v in args.variants.split(","):
        rec = AdditiveRecipe(scheme=args.scheme, calib=args.calib, calib_seqs=args.calib_seqs,
                             calib_len=args.calib_len, beam=args.beam, iters=args.iters, beam_steps=args.beam_steps,
                             kmeans_iters=args.kmeans_iters, gptq=v == "gptq", gptq_rounds=args.gptq_rounds)
        logs: list[str] = []

        def log(s):
            logs.append(s)
            print(f"[{v}] {s}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        path, qm = quantize_additive_to_cbk(args.model, out / f"{v}.cbk", rec, progress=False, log=log)
        wall = time.perf_counter() - t0
        rows = [r for r in qm.report if r["name"].startswith("model.layers.")]
        res = {"variant": v, "file": str(path), "bytes": path.stat().st_size, "seconds": wall, "logs": logs,
               "recipe": rec.to_dict(), "projections": rows}
        (out / f"{v}.json").write_text(json.dumps(res, indent=1))
        gains = [r["hessian_gain"] for r in rows if "hessian_gain" in r]
        print(f"{v}: {path} {res['bytes']} bytes, {wall:.1f} s"
              + (f", hessian objective / diagonal start: mean {sum(gains) / len(gains):.4f}" if gains else ""),
              flush=True)
    return 0


def table(args) -> int:
    import statistics

    from trapetum.formats.detect import load_checkpoint
    from trapetum.quant import calibrate
    from trapetum.quant.gptq import hessian_objective
    from trapetum.schemes.registry import dequantize

    out = Path(args.out_dir)
    src, fd, fg = (load_checkpoint(str(p)) for p in (args.model, out / "diag.cbk", out / "gptq.cbk"))
    toks = calibrate.file_calibration_tokens(src.tokenizer, args.calib, args.calib_seqs, args.calib_len)
    hess = calibrate.collect_input_stats_layerwise(src, toks, progress=False, hessians=True).hessians
    layers = {int(x) for x in args.table.split(",")}
    print("| projection | shape | output err, diagonal | output err, --gptq | objective ratio |\n|---|---|---|---|---|")
    ratios, sq_d, sq_g = [], [], []
    for name, H in hess.items():
        W = src.tensors[name + ".weight"].float()
        od = float(hessian_objective(W, dequantize(fd.tensors[name + ".weight"]), H).sum())
        og = float(hessian_objective(W, dequantize(fg.tensors[name + ".weight"]), H).sum())
        tot = float(hessian_objective(W, torch.zeros_like(W), H).sum())
        ratios.append(og / od)
        sq_d.append(od / tot)
        sq_g.append(og / tot)
        i = int(name.split(".")[2])
        if i in layers:
            print(f"| L{i}.{name.split('.', 3)[3]} | {W.shape[0]}x{W.shape[1]} | {(od / tot) ** 0.5:.4f} | "
                  f"{(og / tot) ** 0.5:.4f} | {og / od:.3f} |")
    print(f"{len(ratios)} projections: objective ratio mean {statistics.mean(ratios):.4f}, median "
          f"{statistics.median(ratios):.4f}, range {min(ratios):.4f}-{max(ratios):.4f}; mean relative squared output "
          f"error {statistics.mean(sq_d):.4f} (diagonal) against {statistics.mean(sq_g):.4f} (--gptq)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
