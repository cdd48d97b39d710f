"""``trapetum verify FILE``: check a .cbk file's structure and every tensor's sha256."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("verify", help="check a .cbk file: structure, metadata and every tensor's checksum",
                              description="Validate a .cbk file and recompute the sha256 of every tensor. "
                                          "Prints OK, or each problem and exits 1.")
    p.add_argument("file", help="the .cbk file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..formats.cbk import verify_cbk

    cbk, problems = verify_cbk(args.file)
    if problems:
        for line in problems:
            print(line)
        print(f"FAILED {args.file}: {len(problems)} problem{'s' if len(problems) != 1 else ''}")
        return 1
    n = len(cbk.tensors_table)
    data = cbk.file_bytes - cbk.header_bytes
    print(f"OK {args.file}: {n} tensors, {data:,} bytes of tensor data ({cbk.file_bytes:,} bytes in all), "
          f"checksums match (.cbk version {cbk.meta['version']})")
    return 0
