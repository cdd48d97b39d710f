"""NVML energy metering (eval/nvml.py, eval/bench_energy.py) on the CPU, the library faked at load_library's
boundary: the ctypes calls' out-parameters written as NVML writes them."""
import ctypes

import pytest

from trapetum.eval import bench_energy, nvml
from trapetum.eval.nvml import Nvml, NvmlError


class FakeLib:
    """NVML's C functions: return codes, values through byref out-parameters; energy in mJ, power in mW."""

    def __init__(self, energy=True, fail_init=False):
        self.energy, self.fail_init = energy, fail_init
        self.mj, self.mw, self.calls = 1_000_000, 250_000, []

    def nvmlInit_v2(self):
        self.calls.append("init")
        return 1 if self.fail_init else 0  # NVML_ERROR_UNINITIALIZED-like failure

    def nvmlDeviceGetHandleByIndex_v2(self, index, ref):
        assert isinstance(index, ctypes.c_uint)
        ref._obj.value = 1234
        return 0

    def nvmlDeviceGetTotalEnergyConsumption(self, handle, ref):
        if not self.energy:
            return nvml.NVML_ERROR_NOT_SUPPORTED
        ref._obj.value = self.mj
        return 0

    def nvmlDeviceGetPowerUsage(self, handle, ref):
        ref._obj.value = self.mw
        return 0

    def nvmlShutdown(self):
        self.calls.append("shutdown")
        return 0


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_energy_counter_window():
    lib, clock = FakeLib(), Clock()
    m = Nvml.open(lib=lib)
    assert m.energy_mj() == 1_000_000 and m.power_w() == 250.0

    def work():  # 2 s at 300 W
        clock.t += 2.0
        lib.mj += 600_000
    t, j, method = m.measure(work, sync=lambda: None, clock=clock)
    assert (t, j, method) == (2.0, 600.0, "energy counter")


def test_power_samples_when_the_counter_is_not_supported():
    lib = FakeLib(energy=False)
    m = Nvml.open(lib=lib)
    assert m.energy_mj() is None
    seen = []

    def work():
        import time
        time.sleep(0.05)
        seen.append(1)
    t, j, method = m.measure(work, sync=lambda: None, sample_s=0.005)
    assert method == "power samples" and seen and j == pytest.approx(250.0 * t)


def test_missing_library_and_failing_calls_are_one_line_errors():
    with pytest.raises(NvmlError, match="cannot load libnot-nvml.so") as e:
        nvml.load_library("libnot-nvml.so")
    assert "\n" not in str(e.value)
    with pytest.raises(NvmlError, match="nvmlInit_v2 failed with error 1"):
        Nvml.open(lib=FakeLib(fail_init=True))

    class NoEnergy(FakeLib):
        nvmlDeviceGetTotalEnergyConsumption = None
    with pytest.raises(NvmlError, match="has no nvmlDeviceGetTotalEnergyConsumption"):
        Nvml.open(lib=NoEnergy()).energy_mj()


class FakeEngine:
    def __init__(self, lib, clock, step_s=0.01, mj_per_step=3000):
        self.lib, self.clock, self.step_s, self.mj_per_step, self.steps = lib, clock, step_s, mj_per_step, 0

    def set_position(self, tok, pos):
        assert pos == 0

    def step(self, greedy):
        self.steps += 1
        self.clock.t += self.step_s
        self.lib.mj += self.mj_per_step


def test_decode_energy_per_token():
    lib, clock = FakeLib(), Clock()
    m = Nvml.open(lib=lib)
    m.measure = lambda fn, sync=None, _real=m.measure: _real(fn, sync=lambda: None, clock=clock)
    eng = FakeEngine(lib, clock)
    r = bench_energy.decode_energy(m, eng, seconds=1.0)
    assert r["steps"] % bench_energy.BATCH == 0 and r["steps"] * 0.01 >= 1.0
    assert r["j_per_token"] == pytest.approx(3.0) and r["watts"] == pytest.approx(300.0)
    assert r["tok_s"] == pytest.approx(100.0) and r["tokens_per_j"] == pytest.approx(1 / 3)


def test_main_without_nvml_says_so_in_one_line(capsys):
    def no_meter():
        raise NvmlError("NVML unavailable: cannot load libnvidia-ml.so.1 (not found)")
    assert bench_energy.main([], open_meter=no_meter) == 1
    err = capsys.readouterr().err
    assert err.strip() == "bench_energy: NVML unavailable: cannot load libnvidia-ml.so.1 (not found)"
    assert bench_energy.main(["--runs", "llama2-7b:fp8"], open_meter=no_meter) == 1
    assert "--runs" in capsys.readouterr().err


def test_bench_energy_is_a_cli_subcommand(capsys):
    """``trapetum bench energy`` runs this benchmark: a bad --runs is a one-line error and exit 1 (before NVML or the
    GPU are touched, or with NVML's own one-line error where it is missing)."""
    from trapetum import cli
    assert cli.main(["bench", "energy", "--runs", "llama2-7b:fp8"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_energy: ") and "\n" not in err
