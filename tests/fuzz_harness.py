"""The fuzzers' process harness (tests/test_hostile_cbk.py, test_hostile_gguf.py): each fuzzer file is also a
script that runs its cases in a fresh process, so that a case's memory is the process's own and measurable.

    fuzz_child(script, *args)   run ``python3 script args``: (its outcome counts, its peak RSS in bytes)
    fuzz_main(argv, run_main)   the script's entry: --seconds S | --cases N, --seed K -> one JSON line
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable


def fuzz_child(script: str | Path, *args: str, timeout: float = 300.0) -> tuple[dict, int]:
    """Run the fuzzer ``script`` in a fresh process: (its outcome counts, its peak RSS in bytes). A case that
    fails raises there and fails here with its message; the process's own memory is what is measured."""
    here = Path(script).resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parents[1]), str(here.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, str(here), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env, cwd=here.parent)
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    try:
        out, err = p.stdout.read(), p.stderr.read()
        _, status, usage = os.wait4(p.pid, 0)
    finally:
        timer.cancel()
    p.returncode = os.waitstatus_to_exitcode(status)
    assert p.returncode == 0, err.decode(errors="replace")[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1]), usage.ru_maxrss * 1024


def fuzz_main(argv: list[str], run_main: Callable[[Path, float, int | None, int], dict]) -> None:
    """python3 tests/FUZZER.py [--seconds S | --cases N] [--seed K]: one JSON line of outcome counts."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=0.0)
    ap.add_argument("--cases", type=int, default=None)
    ap.add_argument("--seed", type=int, default=21)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(run_main(Path(d), a.seconds, a.cases, a.seed)))
