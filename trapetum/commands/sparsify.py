"""``trapetum sparsify MODEL --calib FILE --sparsity S [--site q=..,o=..,gate=..,down=..] [-o OUT]``: activation-
sparsity thresholds (TEAL) from calibration text, into the .cbk or a side file (trapetum/quant/sparsify.py)."""
from __future__ import annotations

import sys

from ..errors import TrapetumError
from ._common import add_device, apply_threads


def register(sub) -> None:
    p = sub.add_parser("sparsify", help="activation-sparsity thresholds from calibration text (TEAL)",
                       description="Per-layer, per-site magnitude thresholds for a target activation sparsity: the "
                                   "S-quantile of |x| of each projection input (q/k/v, o, gate/up, down) over the "
                                   "calibration rows; position 0 stays dense. A .cbk model gets them as its "
                                   "'sparsity' section (rewritten atomically, in place unless -o); a GGUF / HF "
                                   "model a side file MODEL.sparsity.json (or -o FILE.json). Run with "
                                   "--sparsity on (.cbk) or --sparsity FILE.")
    p.add_argument("model", help="HF directory, .gguf or .cbk")
    p.add_argument("--calib", required=True, metavar="FILE", help="calibration text (never the evaluation text)")
    p.add_argument("--sparsity", required=True, type=float, metavar="S", help="target sparsity in [0, 1) of every site")
    p.add_argument("--site", default=None, metavar="q=S,o=S,gate=S,down=S",
                   help="per-site targets overriding --sparsity (q: the q/k/v input, gate: gate/up's, o, down)")
    p.add_argument("-o", "--output", default=None, metavar="OUT",
                   help="output: a .cbk (for a .cbk model) or a .json side file (default: the .cbk in place, or "
                        "MODEL.sparsity.json)")
    p.add_argument("--calib-seqs", type=int, default=16, metavar="N", help="calibration windows (default 16)")
    p.add_argument("--calib-len", type=int, default=512, metavar="L", help="tokens per window (default 512)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..quant.sparsify import sparsify

    apply_threads(args)
    if args.output is not None and not str(args.output).endswith((".cbk", ".json")):
        raise TrapetumError(f"-o {args.output}: the output is a .cbk or a .json side file")
    table, path = sparsify(args.model, args.calib, args.sparsity, args.site, args.output, n_seqs=args.calib_seqs,
                           seq_len=args.calib_len, device=args.device, threads=args.threads,
                           progress=not args.quiet)
    cal = table.calibration
    ach = ", ".join(f"{s} {table.targets[s]:.2f} ({cal['achieved'][s]:.3f})" for s in table.targets)
    print(f"wrote {path}: {len(table.layers)} layers; target (achieved on {cal['rows']} calibration rows): {ach}; "
          f"{cal['seconds']} s", file=sys.stderr)
    return 0
