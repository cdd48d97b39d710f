"""Command line: ``trapetum <command> ...``.

Each command lives in ``trapetum/commands/<name>.py`` and exposes ``register(subparsers)``,
which adds its parser and sets ``func(args) -> int``. User errors (TrapetumError) print one
line to stderr and exit 1; no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import commands
from ._version import __version__
from .errors import TrapetumError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trapetum", description="Compress LLM checkpoints to .cbk and run them.")
    p.add_argument("--version", action="version", version=f"trapetum {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{commands.__name__}.{mod.name}").register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except TrapetumError as e:
        print(f"trapetum: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
