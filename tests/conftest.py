"""Test session setup.

Triton decides at decoration time whether a kernel runs under its CPU interpreter, so on a
machine without CUDA the interpreter is switched on here, before any test module imports a
kernel; the kernel tests then run the real Triton code at small shapes. Tests that want the
kernels' torch fallbacks instead set TRITON_INTERPRET=0 for their duration (the wrappers read it
at call time).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
