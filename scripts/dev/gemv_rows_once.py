"""A few launches of one multi-row codebook GEMV (tiled codes, random data), for Nsight Compute: no timing here,
ncu measures (NOTES-kernels.md sessions 14-15: is the >16-row GEMV bound by x re-read from L2? session 15: no).
Usage: ncu --kernel-name regex:cb_gemv_mma --launch-skip 2 --launch-count 1 --metrics ... \
           python scripts/dev/gemv_rows_once.py [--shape 4096x11008] [--rows 64] [--bits 4] [--groups 2]"""
import argparse

import torch

from trapetum.kernels import codebook_gemv as cg
from trapetum.settings import GROUPED_GEMV_GROUPS, KernelOptions


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4096x11008", help="in x out")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4)
    ap.add_argument("--groups", type=int, choices=GROUPED_GEMV_GROUPS, default=2)
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--many-rows", choices=("wgmma", "mma"), default="wgmma", help="KernelOptions.many_rows")
    ap.add_argument("--gate-up", action="store_true", help="the fused gate/up call (out x 2 weight rows, SiLU)")
    ap.add_argument("--wg", type=int, default=0,
                    help="call the wgmma kernel directly with this many warpgroups a block (0: through codebook_gemv)")
    a = ap.parse_args()
    k, n = (int(v) for v in a.shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = 2 * n if a.gate_up else n
    codes = torch.randint(0, 256, (rows, k * a.bits // 8), dtype=torch.uint8, device="cuda", generator=g)
    cb = torch.randn(rows, 1 << a.bits, device="cuda", generator=g).half()
    if a.gate_up:
        codes, cb, _ = cg.interleave_gate_up(codes[:n], cb[:n], codes[n:], cb[n:])
    kc = cg.tile_codes(codes)
    x = torch.randn(a.rows, k, device="cuda", generator=g).half()
    y = torch.empty(a.rows, n, device="cuda", dtype=torch.float16)
    ko = KernelOptions(pdl="off", grouped_gemv_groups=a.groups, many_rows=a.many_rows)
    for _ in range(a.launches):
        if a.wg:
            from trapetum.kernels import codebook_gemm_wgmma as wgk
            wgk.gemm(x, kc, cb, y, gate_up_f=n if a.gate_up else 0, wg=a.wg)
        elif a.gate_up:
            cg.codebook_gemv_gate_up(x, kc, cb, a.bits, n, out=y, tiled=True, kopts=ko)
        else:
            cg.codebook_gemv(x, kc, cb, a.bits, out=y, tiled=True, kopts=ko)
    torch.cuda.synchronize()
    print(f"{a.launches} launches {a.shape} rows {a.rows} bits {a.bits} groups {a.groups} many_rows {a.many_rows} wg {a.wg}"
          f"{' gate/up' if a.gate_up else ''}")


if __name__ == "__main__":
    main()
