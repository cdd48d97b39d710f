"""``trapetum export-aqlm IN.cbk -o DIR``: a .cbk file with additive layers as a Hugging Face AQLM directory."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export-aqlm", help="write a .cbk with AQLM layers as a Hugging Face AQLM directory",
                              description="AQLM codes, codebooks and scales are written unchanged; other "
                                          "quantized layers (the 8-bit LM head) are dequantized to fp16. The "
                                          "directory loads in transformers with the aqlm package.")
    p.add_argument("src", metavar="IN.cbk")
    p.add_argument("-o", "--output", required=True, metavar="DIR")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..quant.convert_aqlm import export_aqlm

    path = export_aqlm(args.src, args.output)
    print(f"wrote {path}")
    return 0
