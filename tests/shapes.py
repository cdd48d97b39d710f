"""Shapes for kernel tests and benchmarks: real models plus awkward and bad ones.

GEMV shapes are (in_features, out_features) -- "in x out", as in issue 4 and BENCHMARKS.md:
x [M, in] @ W.T with W [out, in].
"""
from __future__ import annotations

# name -> (hidden, intermediate, n_heads, n_kv_heads, head_dim, vocab)
MODELS = {
    "llama-2-7b": (4096, 11008, 32, 32, 128, 32000),
    "llama-3-8b": (4096, 14336, 32, 8, 128, 128256),
    "llama-2-70b": (8192, 28672, 64, 8, 128, 32000),
    "qwen2.5-7b": (3584, 18944, 28, 4, 128, 152064),
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64, 151936),
    "gemma-2-2b": (2304, 9216, 8, 4, 256, 256000),
    "smollm2-135m": (576, 1536, 9, 3, 64, 49152),
}


def gemv_shapes(model: str) -> list[tuple[int, int]]:
    """(in, out) of every projection of one decoder layer (q, k, v, o, gate, up, down)."""
    h, f, nh, nkv, d, _ = MODELS[model]
    return [(h, nh * d), (h, nkv * d), (nh * d, h), (h, f), (f, h)]


# The benchmark set of issue 4/5 (in x out) and the 8-bit LM head.
BENCH_GEMV_4BIT = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 14336), (14336, 4096),
                   (8192, 28672), (28672, 8192)]
BENCH_GEMV_8BIT = [(4096, 32000)]

# Multi-row (speculative verify) GEMVs: activation row counts and the real shapes of the batch-invariance tests.
ROWS = tuple(range(1, 17))
ROWS_GEMV_4BIT = [(4096, 4096), (4096, 11008), (11008, 4096)]  # in x out (plain + residual)
ROWS_GATE_UP_4BIT = [(4096, 11008)]  # in x F: the interleaved [gate; up] matrix has 2 x F rows
ROWS_GEMV_8BIT = [(4096, 32000), (4096, 128256)]  # LM heads of Llama-2 and Llama-3
# Odd shapes for the CPU (interpreter) invariance tests: (in, out); 8-bit needs no padding, 2/4-bit pack a tail.
ROWS_ODD_CPU = [(97, 53), (1, 3), (257, 17)]

# Attention: (Hq, Hkv, D) of real models
ATTN_HEADS = {"llama-2-7b": (32, 32, 128), "llama-3-8b": (32, 8, 128), "gemma-2-2b": (8, 4, 256),
              "qwen2.5-0.5b": (14, 2, 64), "llama-2-70b": (64, 8, 128)}

AWKWARD = [1, 3, 53, 97, 257, 1025]
