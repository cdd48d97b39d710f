"""The kill test's writer (tests/test_cbk.py::test_sigkill_during_write_is_atomic).

``python tests/cbk_writer_child.py OUT.cbk [SEED]`` writes one file.
``python tests/cbk_writer_child.py --serve`` is a small fork server: it imports torch and builds the
model once, then for each stdin line ``PATH SEED`` forks a child that writes the file, prints
``pid PID`` at once (so the test can SIGKILL that child at a random moment of its write), waits for
the child and prints ``exit PID STATUS SECONDS`` (STATUS: exit code, or minus the signal number).
Forking from a process that is already warm makes each trial cost the write itself, not an import.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cbk_helpers import big_model, tiny_tokenizer  # noqa: E402
from trapetum.formats.cbk import write_cbk  # noqa: E402

CONFIG, DENSE, QUANTIZED = big_model(0)  # a few MB: a write takes tens of milliseconds
TOKENIZER = tiny_tokenizer()


def write(path: str, seed: int) -> None:
    write_cbk(path, config=CONFIG, dense=DENSE, quantized=QUANTIZED, tokenizer=TOKENIZER, recipe={"seed": seed})


def serve() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        path, seed = line.split()
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                write(path, int(seed))
                code = 0
            finally:
                os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(f"exit {pid} {code} {time.perf_counter() - t0:.6f}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve()
    else:
        write(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
