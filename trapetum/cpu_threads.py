"""The default CPU thread count: ``default_threads()`` picks it from the CPUs this process may use and what
else is running now. ``generate``, ``chat`` and ``serve`` call it (through ``choose_threads``) when ``--threads``
is not given and ``OMP_NUM_THREADS`` is not set; CPU kernels that run their own thread pool may call
``default_threads()`` directly (it imports nothing heavy and reads no environment variable).

Why not torch's own default (one thread per physical core): on a small machine that is busy, a decode
step's OpenMP threads wait for each other at every operation, and a thread that the scheduler has put
aside stalls them all; on an idle machine more threads can help. Measurements: BENCHMARKS.md, "CLI start-up
and default threads" (``trapetum bench cli``).

The choice (``auto_threads``): ``floor(cpus - load + SLACK)`` threads, at least 1 and at most torch's default:
one thread per CPU that is at least 3/4 free (SLACK = 0.25). The rule leans low on purpose: a thread too few
costs at most its share of the work, a thread too many can cost several times the whole step (an OpenMP team
runs at the pace of its slowest thread, and one that waits for a busy CPU stalls the others at every
operation). Here

* ``cpus``: the CPUs of this process's affinity mask (``os.sched_getaffinity``), fewer if a cgroup CPU quota
  (``cpu.max``, ``cpu.cfs_quota_us``) allows less;
* ``load``: the larger of (a) the runnable threads of other processes, sampled a few times over about 0.1 s
  from ``/proc/*/task/*/stat``, each weighted by its scheduler weight relative to ours (a thread at nice 10
  counts 0.11 against one at nice 0, at nice 19 0.015: the kernel gives it that share of a core when both
  want one), and (b) the 1-minute load average, which remembers bursty neighbours that an instant picture
  misses (BENCHMARKS.md, "CLI start-up and default threads": on the shared development machine the instant
  picture alone chose too many threads); at most ``cpus``.

Nothing here reads the environment (``settings.CpuEnv`` says whether OMP_NUM_THREADS is set) or imports torch.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

# The kernel's CFS weights for nice -20..19 (kernel/sched/core.c, sched_prio_to_weight).
_WEIGHTS = (88761, 71755, 56483, 46273, 36291, 29154, 23254, 18705, 14949, 11916, 9548, 7620, 6100, 4904, 3906,
            3121, 2501, 1991, 1586, 1277, 1024, 820, 655, 526, 423, 335, 272, 215, 172, 137, 110, 87, 70, 56, 45,
            36, 29, 23, 18, 15)
SAMPLES = 8          # snapshots of the runnable threads
INTERVAL_S = 0.012   # between snapshots: about 0.1 s in all
SLACK = 0.25         # a CPU counts as free when at most this much of it is taken (auto_threads)


def weight(nice: int) -> int:
    return _WEIGHTS[max(-20, min(19, nice)) + 20]


@dataclass(frozen=True)
class ThreadChoice:
    """``threads``: what torch is set to (None: torch's default is kept); ``why``: one phrase for ``--stats``."""
    threads: int | None
    why: str


def usable_cpus() -> int:
    """CPUs this process may run on: the affinity mask, capped by a cgroup CPU quota (rounded up)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def _cgroup_quota() -> float | None:
    """CPUs' worth of the cgroup quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), None without one."""
    for path, parse in (("/sys/fs/cgroup/cpu.max", _v2), ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", _v1)):
        try:
            with open(path) as f:
                q = parse(f.read(), path)
        except (OSError, ValueError, IndexError):
            continue
        if q is not None:
            return q
    return None


def _v2(text: str, path: str) -> float | None:
    quota, period = text.split()[:2]
    return None if quota == "max" else int(quota) / int(period)


def _v1(text: str, path: str) -> float | None:
    quota = int(text.strip())
    if quota <= 0:
        return None
    with open(path.replace("cfs_quota_us", "cfs_period_us")) as f:
        return quota / int(f.read().strip())


def _runnable_others(me: int, my_weight: int, proc: str = "/proc") -> float:
    """One snapshot: the runnable threads of other processes, each weighted by weight(its nice) / ours."""
    total = 0.0
    try:
        pids = [d.name for d in os.scandir(proc) if d.name.isdigit() and int(d.name) != me]
    except OSError:
        return 0.0
    for pid in pids:
        try:
            tasks = [t.name for t in os.scandir(f"{proc}/{pid}/task")]
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"{proc}/{pid}/task/{tid}/stat", "rb") as f:
                    raw = f.read()
            except OSError:
                continue
            fields = raw[raw.rfind(b")") + 2:].split()  # after "pid (comm) ": state is field 3, nice 19
            if len(fields) > 16 and fields[0] == b"R":
                try:
                    total += min(1.0, weight(int(fields[16])) / my_weight)
                except ValueError:
                    continue
    return total


def competing_load(samples: int = SAMPLES, interval_s: float = INTERVAL_S, proc: str = "/proc",
                   me: int | None = None, nice: int | None = None) -> float:
    """Other processes' runnable threads, weighted by scheduler weight (module docstring), averaged.
    ``me``, ``nice``: the process that asks and its nice level (default: this process's)."""
    me = os.getpid() if me is None else me
    if nice is None:
        try:
            nice = os.getpriority(os.PRIO_PROCESS, 0)
        except (AttributeError, OSError):
            nice = 0
    mine = weight(nice)
    seen = []
    for i in range(samples):
        if i:
            time.sleep(interval_s)
        seen.append(_runnable_others(me, mine, proc))
    return sum(seen) / len(seen)


def auto_threads(cpus: int, load: float, cap: int | None = None) -> int:
    """``floor(cpus - load + SLACK)`` threads, at least 1, at most ``cap`` (torch's default) and ``cpus``."""
    n = int(math.floor(cpus - min(max(load, 0.0), cpus) + SLACK))
    return max(1, min(n, cpus, cap if cap else cpus))


def default_threads(cap: int | None = None, measure=None) -> ThreadChoice:
    """The thread count for CPU work started now: ``auto_threads(cpus, load, cap)`` with ``cpus, load`` from
    ``measure()`` (default: ``usable_cpus()``, and the larger of ``competing_load()``, about 0.1 s of sampling,
    and ``recent_load()``, the 1-minute load average). ``cap``: at most this
    many (torch's own default, one per physical core). ``why`` says the inputs, e.g.
    'auto: 2 CPUs, competing load 1.0'."""
    cpus, load = measure() if measure is not None else (usable_cpus(), max(competing_load(), recent_load()))
    n = auto_threads(cpus, load, cap)
    return ThreadChoice(n, f"auto: {cpus} CPU{'s' if cpus != 1 else ''}, competing load {load:.1f}")


def recent_load() -> float:
    """The 1-minute load average (0 where there is none). It lags, and that is its use here: it remembers the
    neighbours whose work comes in bursts (a test suite between two files), which the 0.1 s picture of
    ``competing_load`` can miss; ``default_threads`` takes the larger of the two."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return 0.0


def choose_threads(explicit: int | None, omp_set: bool = False, torch_default: int | None = None,
                   measure=None) -> ThreadChoice:
    """The commands' rule: ``--threads`` (explicit), else torch's default when ``OMP_NUM_THREADS`` is set
    (omp_set: torch follows it; threads None), else ``default_threads(torch_default, measure)``."""
    if explicit is not None:
        return ThreadChoice(explicit, "--threads")
    if omp_set:
        return ThreadChoice(None, "OMP_NUM_THREADS")
    return default_threads(torch_default, measure)
