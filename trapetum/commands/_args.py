"""The CLI's argument parser: one-line errors, options anywhere among the positionals, lazy sub-parsers.

``TrapetumParser`` is the class of every parser and sub-parser of ``trapetum`` (cli.py passes it to
``add_subparsers``; nested sub-parsers inherit it). Keyword arguments of ``add_parser``:

* ``intermixed=True``: options may stand between positionals (``generate MODEL --chat "question" -n 48``):
  parsed with ``parse_known_intermixed_args``;
* ``populate=fn``: ``fn(parser)`` adds the arguments the first time the parser is used (its command was
  chosen, or its help is shown), so that a command whose arguments live in a heavy module (the load and
  speculative benchmarks import torch) costs nothing to ``trapetum --help``.

Errors are one line on stderr, ``trapetum: error: ...``, exit status 2 (argparse's usage block is left out: the
message names the flag, and ``--help`` has the rest).
"""
from __future__ import annotations

import argparse
import sys


class TrapetumParser(argparse.ArgumentParser):
    def __init__(self, *args, intermixed: bool = False, populate=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._intermixed = intermixed
        self._populate = populate
        self._inside = False

    def _ready(self) -> None:
        if self._populate is not None:
            fn, self._populate = self._populate, None
            fn(self)

    def parse_known_args(self, args=None, namespace=None):
        self._ready()
        if not self._intermixed or self._inside:
            return super().parse_known_args(args, namespace)
        self._inside = True  # parse_known_intermixed_args calls parse_known_args itself, twice
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False

    def format_help(self) -> str:
        self._ready()
        return super().format_help()

    def format_usage(self) -> str:
        self._ready()
        return super().format_usage()

    def error(self, message: str):
        self.exit(2, f"trapetum: error: {message} (see '{self.prog} --help')\n")

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            sys.stderr.write(message if message.endswith("\n") else message + "\n")
        sys.exit(status)


def with_default(text: str, default) -> str:
    """A help text ending in its default, e.g. ``with_default("0 = greedy", 0.7)`` -> '0 = greedy (default 0.7)'."""
    return f"{text} (default {default})" if text else f"default {default}"
