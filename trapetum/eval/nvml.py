"""GPU energy and power through NVML, by ctypes on ``libnvidia-ml.so.1`` (the driver's library: no Python package).

    meter = Nvml.open(index=0)      # NvmlError (one line) where the library, the device or the call is missing
    meter.energy_mj()               # nvmlDeviceGetTotalEnergyConsumption: mJ since the driver loaded, or None
                                    # where the device does not count energy (then power_w sampling is used)
    meter.power_w()                 # nvmlDeviceGetPowerUsage: the board's power now, W
    meter.measure(fn)               # (seconds, joules, "energy counter" | "power samples"): fn() once, timed

``measure`` synchronizes through ``sync`` (torch.cuda.synchronize by default) before and after fn, so the window is
the device work; with the energy counter the joules are its difference, else the mean of power samples taken
every ``sample_s`` by a thread times the seconds. The library is reached only through ``load_library`` (tests
fake it there).
"""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Callable

from ..errors import TrapetumError

LIBRARY = "libnvidia-ml.so.1"
NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3


class NvmlError(TrapetumError):
    """NVML cannot measure on this machine (one line: what is missing)."""


def load_library(name: str = LIBRARY):
    """The NVML shared library (ctypes), NvmlError where it cannot be loaded."""
    try:
        return ctypes.CDLL(name)
    except OSError as e:
        raise NvmlError(f"NVML unavailable: cannot load {name} ({' '.join(str(e).split())[:120]})") from None


def _cuda_sync() -> None:
    import torch
    torch.cuda.synchronize()


class Nvml:
    def __init__(self, lib, handle):
        self.lib, self.handle = lib, handle

    @classmethod
    def open(cls, index: int = 0, lib=None) -> "Nvml":
        lib = load_library() if lib is None else lib
        cls._call(lib, "nvmlInit_v2")
        handle = ctypes.c_void_p()
        cls._call(lib, "nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
        return cls(lib, handle)

    @staticmethod
    def _call(lib, name: str, *args) -> int:
        fn = getattr(lib, name, None)
        if fn is None:
            raise NvmlError(f"NVML unavailable: {LIBRARY} has no {name}")
        ret = fn(*args)
        if ret not in (NVML_SUCCESS, NVML_ERROR_NOT_SUPPORTED):
            raise NvmlError(f"NVML: {name} failed with error {ret}")
        return ret

    def energy_mj(self) -> int | None:
        v = ctypes.c_ulonglong()
        if self._call(self.lib, "nvmlDeviceGetTotalEnergyConsumption", self.handle, ctypes.byref(v)):
            return None
        return int(v.value)

    def power_w(self) -> float:
        v = ctypes.c_uint()
        if self._call(self.lib, "nvmlDeviceGetPowerUsage", self.handle, ctypes.byref(v)):
            raise NvmlError("NVML: this device reports neither energy nor power")
        return v.value / 1000.0

    def close(self) -> None:
        fn = getattr(self.lib, "nvmlShutdown", None)
        if fn is not None:
            fn()

    def measure(self, fn: Callable[[], object], sync: Callable[[], None] = _cuda_sync,
                sample_s: float = 0.01, clock: Callable[[], float] = time.perf_counter) -> tuple[float, float, str]:
        """(seconds, joules, method) of one fn() call (module docstring)."""
        sync()
        e0 = self.energy_mj()
        if e0 is not None:
            t0 = clock()
            fn()
            sync()
            t1, e1 = clock(), self.energy_mj()
            return t1 - t0, (e1 - e0) / 1000.0, "energy counter"
        samples: list[float] = [self.power_w()]
        stop = threading.Event()

        def sampler():
            while not stop.wait(sample_s):
                samples.append(self.power_w())
        th = threading.Thread(target=sampler, daemon=True)
        t0 = clock()
        th.start()
        try:
            fn()
            sync()
        finally:
            t1 = clock()
            stop.set()
            th.join()
        return t1 - t0, sum(samples) / len(samples) * (t1 - t0), "power samples"
