"""``trapetum quantize SRC -o OUT.cbk [--bits 4] [--head-bits 8] [--calib FILE]``."""
from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("quantize", help="compress a checkpoint into a .cbk file (per-row codebooks)",
                       description="Quantize every projection to a per-row scalar codebook (E[x^2]-weighted "
                                   "k-means), the LM head to 8 bits, and write a .cbk file atomically.")
    p.add_argument("src", help="HF directory, .gguf or .cbk")
    p.add_argument("-o", "--output", required=True, metavar="OUT.cbk")
    p.add_argument("--bits", type=int, default=4, help="index bits of the projections (2, 3, 4 or 8; default 4)")
    p.add_argument("--head-bits", default="8", metavar="BITS|fp16",
                   help="LM head: codebook bits, or fp16 to keep it dense (default 8)")
    p.add_argument("--embed-bits", default="auto", metavar="BITS|fp16|auto",
                   help="embedding table: codebook bits, or fp16; auto (default): a tied model shares the "
                        "head's quantized table, an untied one keeps its embedding fp16")
    p.add_argument("--calib", default=None, metavar="FILE|none",
                   help="calibration text for E[x^2] (e.g. wikitext-2 valid.txt); default: text sampled "
                        "from the model itself; 'none': unweighted k-means")
    p.add_argument("--calib-seqs", type=int, default=32, metavar="N", help="calibration sequences (default 32)")
    p.add_argument("--keep-fp16", action="append", default=[], metavar="PATTERN",
                   help="keep matching projections dense, e.g. lm_head or 'model.layers.0.*' (repeatable)")
    p.add_argument("--layer-bits", action="append", default=[], metavar="PATTERN=BITS",
                   help="bits for matching projections, e.g. '*.mlp.down_proj=8' (repeatable, first match wins)")
    p.add_argument("--iters", type=int, default=60, help="Lloyd iterations per start (default 60)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--scheme", default="scalar", choices=["scalar", "aqlm-2x8", "aqlm-1x16"],
                   help="per-row scalar codebooks (default) or 2-bit additive codebooks in the AQLM layout")
    p.set_defaults(func=run)


def _bits_or_none(s: str, what: str) -> int | None:
    from ..errors import ConfigError

    if s.lower() in ("fp16", "none", "dense"):
        return None
    try:
        return int(s)
    except ValueError:
        raise ConfigError(f"{what} must be a number of bits or fp16, got {s!r}") from None


def run(args: argparse.Namespace) -> int:
    import torch

    from ..quant.quantize import Recipe, parse_bits_overrides, quantize_to_cbk

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.scheme != "scalar":  # additive codebooks: trapetum/quant/additive_driver.py
        from ..quant.additive_driver import run_cli
        return run_cli(args, device)
    calib = args.calib
    recipe = Recipe(bits=args.bits, head_bits=_bits_or_none(args.head_bits, "--head-bits"),
                    embed_bits="auto" if args.embed_bits == "auto" else _bits_or_none(args.embed_bits, "--embed-bits"),
                    weighted=calib != "none", calib=calib, calib_seqs=args.calib_seqs, iters=args.iters,
                    keep_fp16=list(args.keep_fp16), bits_overrides=parse_bits_overrides(args.layer_bits)).validate()
    path, qm = quantize_to_cbk(args.src, args.output, recipe, device=device, progress=not args.quiet)
    size = path.stat().st_size
    print(f"wrote {path}  {size / 1e6:.1f} MB  {qm.bits_per_weight('projections'):.3f} bits/weight (projections, "
          f"codebooks included)  {qm.bits_per_weight('all'):.3f} bits/weight (all tensors)  {qm.seconds:.1f} s")
    return 0
