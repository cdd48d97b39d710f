"""Non-view torch ops (each a kernel launch on CUDA) of a prompt chunk's K/V copies between the paged blocks and a
contiguous cache, per-layer (PagedKV.write / gather per layer) against all layers at once (write_all /
gather_all), on the CPU for a Llama-2-7B-shaped cache (32 layers, 32 kv heads, head dim 128).

    PYTHONPATH=$PWD python3 scripts/dev/count_kv_copies.py [--n 38] [--prefix 16]
"""
from __future__ import annotations

import argparse
import collections
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trapetum.runtime.paged_kv import PagedKV

VIEWS = {"view", "transpose", "permute", "slice", "select", "unbind", "alias", "expand", "_unsafe_view", "t",
         "unsqueeze", "as_strided", "detach"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=38, help="the chunk's positions")
    ap.add_argument("--prefix", type=int, default=16, help="the positions a later chunk gathers")
    a = ap.parse_args(argv)
    L, H, hd = 32, 32, 128
    cfg = SimpleNamespace(num_layers=L, num_kv_heads=H, head_dim=hd, mla=False)
    kv = PagedKV(cfg, 16, 16, torch.float16, "cpu")
    ek = torch.zeros(L, H, 256, hd, dtype=torch.float16)
    ev = torch.zeros_like(ek)
    table, n, p = torch.arange(8), a.n, a.prefix

    def gather_layers():
        for layer in range(L):
            k, v = kv.gather(layer, table, p)
            ek[layer, :, :p], ev[layer, :, :p] = k, v
    cases = [("write, per layer", lambda: [kv.write(i, table, 0, ek[i, :, :n], ev[i, :, :n]) for i in range(L)]),
             ("write_all", lambda: kv.write_all(table, 0, ek[:, :, :n], ev[:, :, :n])),
             (f"gather of {p} positions, per layer", gather_layers),
             (f"gather_all of {p} positions", lambda: kv.gather_all(table, p, ek, ev))]
    for name, fn in cases:
        with Count() as c:
            fn()
        ops = {k: v for k, v in c.ops.items() if k not in VIEWS}
        print(f"{name}: {sum(ops.values())} launches {ops}")


if __name__ == "__main__":
    main()
