"""Test session setup.

Triton decides at decoration time whether a kernel runs under its CPU interpreter, so on a
machine without CUDA the interpreter is switched on here, before any test module imports a
kernel; the kernel tests then run the real Triton code at small shapes. Tests that want the
kernels' torch fallbacks instead set TRITON_INTERPRET=0 for their duration (the wrappers read it
at call time).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (README's test command runs two workers) each worker gets its share of the cores for torch's
# intra-op threads, so that the workers do not oversubscribe the machine.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture
def torch_fallbacks(monkeypatch, request):
    """The kernels' torch fallbacks on the CPU (TRITON_INTERPRET=0 for the test), except in tests whose name says
    "interpreter" (they run the real Triton code, usually in a subprocess). Engine tests use it for speed."""
    if not torch.cuda.is_available() and "interpreter" not in request.node.name:
        monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and lose much to them on a busy machine: torch at one thread
    for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``), restored after it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
