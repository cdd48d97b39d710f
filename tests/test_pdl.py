"""Programmatic dependent launch: when the Triton side turns it on, and a guard on the CUDA sources.

The GPU behaviour (all PDL modes give bitwise the same logits) is tested in tests/test_engine_gpu.py.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from trapetum.kernels import pdl
from trapetum.settings import KernelOptions, Options

CUDA_DIR = Path(__file__).resolve().parents[1] / "trapetum" / "kernels" / "cuda"


def test_off_where_it_cannot_work(monkeypatch):
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda", 0))  # the interpreter has no grid dependencies


@pytest.mark.parametrize("mode,triton_side", [("off", False), ("cuda", False), ("triton", None), ("all", None)])
def test_option_modes(monkeypatch, mode, triton_side):
    """pdl "off" and "cuda" keep the Triton kernels off; "all" and "triton" leave it to the device. The
    environment plays no part once the options exist."""
    monkeypatch.setenv("TRAPETUM_PDL", "0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_triton_supports_pdl", lambda: True)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    k = KernelOptions(pdl=mode)
    on = pdl.enabled(torch.device("cuda", 0), k)
    assert on is (True if triton_side is None else triton_side)
    assert pdl.launch_kwargs(torch.device("cuda", 0), k) == ({"PDL": True, "launch_pdl": True} if on else {"PDL": False})


@pytest.mark.parametrize("value,mode", [("0", "off"), ("off", "off"), ("1", "all"), ("", "all"), ("cuda", "cuda"),
                                        ("triton", "triton"), ("False", "off")])
def test_env_switch_is_parsed_once_by_settings(value, mode):
    assert Options.from_env({"TRAPETUM_PDL": value}).kernels.pdl == mode


def test_device_capability_gates_it(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_triton_supports_pdl", lambda: True)
    monkeypatch.setattr(pdl, "_capable", lambda index: False)  # e.g. an A100
    assert not pdl.enabled(torch.device("cuda", 0))


def test_cuda_kernels_read_activations_with_coherent_loads():
    """Kernels that may start before the previous kernel ends must not read its outputs through the read-only
    path: ptxas hoisted such loads (__ldg) above griddepcontrol.wait (the 2x8 kernel's x: wrong logits).
    Activations (x, xp, p.x) and residuals (res, p.res) go through trapetum_pdl::ld_input*, and residuals
    are never indexed directly (a const __restrict__ pointer is read through the read-only path too)."""
    bad = []
    for f in sorted([*CUDA_DIR.glob("*.cu"), *CUDA_DIR.glob("*.cuh")]):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("//")[0]
            if re.search(r"__ldg\([^;]*\b(x|xp|res|p\.x|p\.res)\b", code) or re.search(r"\bres\s*\[", code):
                bad.append(f"{f.name}:{n}: {line.strip()}")
    assert not bad, "activation/residual loads outside ld_input:\n" + "\n".join(bad)
    assert "wait_inputs" in (CUDA_DIR / "pdl.cuh").read_text()
    for f in ("codebook_gemv_mma.cu", "dense_gemv.cu", "additive_gemv.cu"):
        src = (CUDA_DIR / f).read_text()
        assert "trapetum_pdl::wait_inputs()" in src and "trapetum_pdl::launch(" in src, f
