"""Command line: ``trapetum <command> ...``.

Each command lives in ``trapetum/commands/<name>.py`` and exposes ``register(subparsers)``,
which adds its parser and sets ``func(args) -> int``. Building the parser imports no heavy module
(torch, numpy, the server): commands import what they need when they run (tests/test_cli_startup.py).
User errors (TrapetumError, and an OSError of a file the user named) print one line to stderr and
exit 1; argument errors print one line and exit 2; no traceback.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

from . import commands
from ._version import __version__
from .commands._args import TrapetumParser
from .errors import TrapetumError


def build_parser() -> TrapetumParser:
    p = TrapetumParser(prog="trapetum", description="Compress LLM checkpoints to .cbk and run them.",
                       epilog="'trapetum COMMAND --help' shows a command's options.")
    p.add_argument("--version", action="version", version=f"trapetum {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=TrapetumParser)
    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{commands.__name__}.{mod.name}").register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or an argument error (already printed)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
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
    except OSError as e:  # a file the user named: unreadable, disk full, ... (its name and the reason)
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"trapetum: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
