"""``trapetum bench load``: the serving load benchmark (see trapetum/eval/loadbench.py).

The ``bench`` command lives in bench.py; this module adds its ``load`` subcommand (the CLI
imports command modules in name order, so ``bench`` is registered first) and the same thing as
a top-level ``trapetum loadbench``.
"""
from __future__ import annotations

import argparse

HELP = "serving load benchmark: TTFT, inter-token latency and throughput for N concurrent streaming clients"


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Add ``load`` under ``trapetum bench`` (bench.py may call this itself)."""
    p = bench_subparsers.add_parser("load", help=HELP, description=HELP)
    _configure(p)
    return p


def _configure(p) -> None:
    from ..eval.loadbench import add_arguments
    add_arguments(p)
    p.set_defaults(func=_run)


def _run(args) -> int:
    from ..eval.loadbench import run
    return run(args)


def register(subparsers) -> None:
    _configure(subparsers.add_parser("loadbench", help=HELP, description=HELP))
    bench = subparsers.choices.get("bench")
    if bench is None:
        return
    for action in bench._actions:           # bench's own subcommands (kernels, ...)
        if isinstance(action, argparse._SubParsersAction):
            if "load" not in action.choices:
                add_parser(action)
            return
