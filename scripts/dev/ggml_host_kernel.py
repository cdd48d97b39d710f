"""The host GEMV of GGUF block types alone (kernels/ggml_host.py, host/ggml_host.c): legacy types' random weights
quantized by the gguf package at SmolLM2-135M's shapes (out x in; its 49152-row head in Q8_0) and one matrix larger
than the L3 cache; the K-quants (Q4_K, Q6_K; gguf does not quantize them: random bytes with sane fp16 scales) at
Qwen2.5-0.5B's ffn_down (896 x 4864, the one K-quant tensor of its GGUF: its gate / up have K = 896, not a multiple
of 256), a 4864 x 1024 and Gemma-3-270M's ffn_down (640 x 2048), and one larger than the L3 cache. One row of x,
one thread, per code path: microseconds a call (the C entry point through ctypes with its arguments bound once, best
of 5 x REPS calls; the weights stay in cache where they fit) and GB/s of block bytes read. ``read``: a one-thread
torch sum over 256 MB in the same process, the memory speed to compare with.

    python3 scripts/dev/ggml_host_kernel.py [REPS] [TYPES, default all of GGML_TYPES] [PATHS, default c,avx2,avx512]
"""
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trapetum.kernels import ggml_host as gh
from trapetum.kernels import host_gemv as hg

LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")
KQUANT = ("Q4_K", "Q6_K")
SHAPES = [(576, 576, LEGACY), (1536, 576, LEGACY), (576, 1536, LEGACY), (49152, 576, ("Q8_0",)),
          (16384, 4096, ("Q4_0",)), (896, 4864, KQUANT), (4864, 1024, KQUANT), (640, 2048, KQUANT),
          (16384, 4096, KQUANT)]


def kquant_blocks(qt: str, n: int, k: int, rng) -> np.ndarray:
    """Random Q4_K / Q6_K rows: random bytes, fp16 d (and Q4_K's dmin) of sane magnitudes."""
    nb, bs = k // gh.BLOCK_ELEMS[qt], gh.GGML_TYPES[qt][1]
    b = rng.integers(0, 256, (n, nb, bs), dtype=np.uint8)
    d = (rng.standard_normal((n, nb, 2)) * 1e-3).astype(np.float16).view(np.uint8)
    if qt == "Q4_K":
        b[..., 0:4] = d
    else:
        b[..., 208:210] = d[..., 0:2]
    return b.reshape(n, nb * bs)


def best_of(f, reps):
    f()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def read_gbs() -> float:
    torch.set_num_threads(1)
    a = torch.zeros(64 << 20, dtype=torch.float32)
    return a.numel() * 4 / best_of(a.sum, 3) / 1e9


def main():
    import gguf
    from gguf import quants
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    types = (sys.argv[2] if len(sys.argv) > 2 else ",".join(gh.GGML_TYPES)).split(",")
    best = hg.PATHS.index(hg.best_path())
    paths = sys.argv[3].split(",") if len(sys.argv) > 3 else ["c", "avx2", "avx512"][: min(best, 2) + 1]
    lib = hg.library()
    rng = np.random.default_rng(0)
    print(f"read (torch sum, 1 thread, 256 MB): {read_gbs():.1f} GB/s")
    print(f"{'type':5} {'N x K':>11} {'MB':>6}  " + "  ".join(f"{p:>20}" for p in paths))
    for n, k, only in SHAPES:
        if not set(only) & set(types):
            continue
        W = rng.standard_normal((n, k), dtype=np.float32) if set(only) & set(LEGACY) else None
        for qt in types:
            if qt not in only:
                continue
            b = kquant_blocks(qt, n, k, rng) if qt in KQUANT \
                else quants.quantize(W, getattr(gguf.GGMLQuantizationType, qt))
            w = gh.GgmlWeight(qt, torch.from_numpy(b), k)
            gh.check_weight(w)
            x, out = torch.randn(1, k), torch.empty(1, n)
            row = []
            for p in paths:
                args = (x.data_ptr(), k, 1, k, w.blocks.data_ptr(), w.blocks.stride(0), gh.GGML_TYPES[qt][0], n,
                        out.data_ptr(), n, 1, hg.PATHS.index(p))
                scale = 50 if p == "c" else 1
                r = max(2, reps * 576 * 1536 // (n * k) // scale)
                t = best_of(lambda a=args: lib.tp_ggml_gemv(*a), r)
                row.append(f"{t * 1e6:9.1f} us {w.blocks.numel() / t / 1e9:5.1f} GB/s")
            print(f"{qt:5} {f'{n}x{k}':>11} {w.blocks.numel() / 1e6:6.2f}  " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
