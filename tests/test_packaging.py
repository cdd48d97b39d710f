"""The wheel ships every file the package needs: Python modules, the CUDA sources and the headers they include
(without ``pdl.cuh`` / ``act.cuh`` ``cuda_ext`` turns the CUDA kernels off, silently slower), the host kernels'
C source, the web page.

The wheel is built from a copy of ``pyproject.toml`` and ``trapetum/`` (a build writes ``build/`` and
``*.egg-info`` beside its sources), offline: ``pip wheel --no-deps --no-build-isolation``.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {".py", ".c", ".cu", ".cuh", ".js", ".css", ".html"}  # every such file under trapetum/ must be in the wheel


def test_wheel_holds_the_cuda_headers_and_every_package_file(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    shutil.copytree(ROOT / "trapetum", src / "trapetum", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", src / "pyproject.toml")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    wheels = list((tmp_path / "dist").glob("trapetum-*.whl"))
    assert len(wheels) == 1
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    want = {p.relative_to(src).as_posix() for p in (src / "trapetum").rglob("*") if p.suffix in SHIPPED}
    headers = {n for n in want if n.endswith(".cuh")}
    assert {"trapetum/kernels/cuda/pdl.cuh", "trapetum/kernels/cuda/act.cuh"} <= headers
    assert "trapetum/kernels/host/codebook_host.c" in names  # the host kernels' source (compiled at first use)
    assert "trapetum/kernels/host/codebook_host_512.c" in names and "trapetum/kernels/host/codebook_host.h" in names
    assert sorted(want - names) == [], "files missing from the wheel"
    version = (ROOT / "trapetum" / "_version.py").read_text().split('__version__ = "')[1].split('"')[0]
    assert wheels[0].name.startswith(f"trapetum-{version}-")  # the version comes from trapetum/_version.py
