"""Issue 22 (1): the default CPU thread count (trapetum/cpu_threads.py). The rule is tested on made-up inputs and a
made-up /proc; the measurement of a real busy process, loosely (other work shares this machine). Whether the
choice is fast is measured by `trapetum bench cli` (BENCHMARKS.md)."""
import os
import subprocess
import sys
import time

import pytest

from trapetum import cpu_threads as T
from trapetum.settings import CpuEnv


@pytest.mark.parametrize("cpus,load,cap,want", [
    (2, 0.0, 2, 2), (2, 0.2, 2, 2), (2, 0.3, 2, 1), (2, 0.6, 2, 1), (2, 1.0, 2, 1), (2, 17.0, 2, 1),  # 2 cores
    (1, 0.0, 1, 1), (16, 0.0, 8, 8), (16, 4.0, 16, 12), (16, 4.8, 16, 11), (16, 40.0, 16, 1), (4, -1.0, None, 4)])
def test_auto_threads(cpus, load, cap, want):
    assert T.auto_threads(cpus, load, cap) == want


def test_precedence():
    never = lambda: pytest.fail("measured although the count was given")  # noqa: E731
    assert T.choose_threads(3, True, 2, measure=never) == T.ThreadChoice(3, "--threads")
    assert T.choose_threads(None, True, 2, measure=never) == T.ThreadChoice(None, "OMP_NUM_THREADS")
    c = T.choose_threads(None, False, 2, measure=lambda: (2, 1.0))
    assert c.threads == 1 and c.why == "auto: 2 CPUs, competing load 1.0"
    assert T.default_threads(8, measure=lambda: (16, 2.2)) == T.ThreadChoice(8, "auto: 16 CPUs, competing load 2.2")
    assert T.default_threads(None, measure=lambda: (1, 0.0)).threads == 1


def test_cpu_env():
    """Only the standard OMP_NUM_THREADS counts; there is no Trapetum variable for the thread count."""
    assert CpuEnv.from_env({}) == CpuEnv(False)
    assert CpuEnv.from_env({"OMP_NUM_THREADS": "4"}) == CpuEnv(True)
    assert CpuEnv.from_env({"OMP_NUM_THREADS": " "}) == CpuEnv(False)
    assert CpuEnv.from_env({"TRAPETUM_THREADS": "3"}) == CpuEnv(False)


def _task(proc, pid, tid, state, nice, comm="x) (y"):
    d = proc / str(pid) / "task" / str(tid)
    d.mkdir(parents=True)
    rest = [state, "1"] + ["0"] * 14 + [str(nice)] + ["0"] * 20  # fields 3..: state, ppid, ..., nice is field 19
    (d / "stat").write_bytes(f"{tid} ({comm}) {' '.join(rest)}".encode())


def test_runnable_others_weights_by_nice(tmp_path):
    """Runnable threads of other processes count by scheduler weight against ours; sleeping ones and our own
    process do not count; a name with ') (' in it does not confuse the parse."""
    _task(tmp_path, 100, 100, "R", 0)
    _task(tmp_path, 100, 101, "R", 0)     # a second running thread of the same process
    _task(tmp_path, 200, 200, "R", 10)    # nice 10: 110 / 1024
    _task(tmp_path, 300, 300, "S", 0)     # sleeping
    _task(tmp_path, 400, 400, "R", -5)    # a higher priority counts once, not more
    _task(tmp_path, 999, 999, "R", 0)     # "us"
    (tmp_path / "loadavg").write_text("0 0 0 1/1 1\n")
    got = T._runnable_others(999, T.weight(0), str(tmp_path))
    assert got == pytest.approx(3 + 110 / 1024)
    assert T._runnable_others(999, T.weight(10), str(tmp_path)) == pytest.approx(4)
    assert T.competing_load(3, 0.0, str(tmp_path), me=999, nice=0) == pytest.approx(got)


def test_a_busy_process_is_seen():
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert T.competing_load() >= 0.5
    finally:
        p.kill()
        p.wait()


def test_usable_cpus():
    n = T.usable_cpus()
    assert 1 <= n <= (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    assert T._v2("max 100000", "") is None and T._v2("150000 100000", "") == 1.5


def test_default_threads_takes_the_larger_load(monkeypatch):
    """The instant picture and the 1-minute load average: the larger counts (a bursty neighbour is remembered)."""
    monkeypatch.setattr(T, "usable_cpus", lambda: 2)
    monkeypatch.setattr(T, "competing_load", lambda: 0.0)
    monkeypatch.setattr(T, "recent_load", lambda: 1.5)
    assert T.default_threads(2) == T.ThreadChoice(1, "auto: 2 CPUs, competing load 1.5")
    monkeypatch.setattr(T, "recent_load", lambda: 0.1)
    assert T.default_threads(2).threads == 2
    monkeypatch.setattr(T, "competing_load", lambda: 0.9)
    assert T.default_threads(2).threads == 1


def test_recent_load():
    assert T.recent_load() >= 0.0
