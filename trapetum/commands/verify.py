"""``trapetum verify FILE``: check a .cbk file's structure and every tensor's sha256."""
from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("verify", help="check a .cbk file: structure, metadata and every tensor's checksum",
                              description="Validate a .cbk file and recompute the sha256 of every tensor. "
                                          "Prints OK, or each problem and exits 1.")
    p.add_argument("file", help="the .cbk file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """OK line on stdout; a file that is not a .cbk (or cannot be opened) is one error line; each problem that
    verify finds in a .cbk is an error line, then a summary, all on stderr; exit 1 on any problem."""
    from ..formats.cbk_contents import verify_file  # torch only when numpy cannot show the contents sound

    cbk, problems = verify_file(args.file)  # FormatError (one line, naming the file) when it is no readable .cbk
    if problems:
        for line in problems:
            print(f"trapetum: error: {line}", file=sys.stderr)
        print(f"trapetum: error: FAILED {args.file}: {len(problems)} problem{'s' if len(problems) != 1 else ''}",
              file=sys.stderr)
        return 1
    n = len(cbk.tensors_table)
    data = cbk.file_bytes - cbk.header_bytes
    print(f"OK {args.file}: {n} tensors, {data:,} bytes of tensor data ({cbk.file_bytes:,} bytes in all), "
          f"checksums match (.cbk version {cbk.meta['version']})")
    return 0
