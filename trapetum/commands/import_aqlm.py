"""``trapetum import-aqlm DIR -o OUT.cbk``: a Hugging Face AQLM checkpoint as a .cbk file."""
from __future__ import annotations

import argparse

from ._common import bits_or_none


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("import-aqlm", help="convert a Hugging Face AQLM directory (2x8, 1x16) to .cbk",
                              description="Copy the AQLM codes, codebooks and scales byte for byte into a .cbk "
                                          "file; the LM head becomes an 8-bit per-row scalar codebook; the rest "
                                          "of the model is kept as the source has it.")
    p.add_argument("src", metavar="DIR", help="Hugging Face directory with quantization_config.quant_method 'aqlm'")
    p.add_argument("-o", "--output", required=True, metavar="OUT.cbk")
    p.add_argument("--head-bits", default="8", metavar="BITS|fp16", help="LM head codebook bits, or fp16 (default 8)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..quant.convert_aqlm import import_aqlm

    path = import_aqlm(args.src, args.output, head_bits=bits_or_none(args.head_bits, "--head-bits"))
    print(f"wrote {path}  {path.stat().st_size / 1e6:.1f} MB")
    return 0
