"""Where a batched decode step's device time goes (issue 20): torch.profiler over eager paged DECODE forwards of
GpuBatchRunner (runtime/paged_engine.py) at S rows, CUDA time summed by kernel name, top N per S; plus the graph
replay's device ms beside it; the 4-bit GEMVs' share (kernels named cb_gemv_mma*, cb_gemm_wgmma*, x_wgmma*) per step.
Usage: python scripts/dev/profile_paged_step.py MODEL.cbk [--sizes 1,16,64] [--grouped-groups 1] [--many-rows mma]"""
import argparse
import collections

import torch

from trapetum.formats.detect import load_checkpoint
from trapetum.runtime.engine import GpuEngine
from trapetum.runtime.paged_engine import GpuBatchRunner
from trapetum.settings import GROUPED_GEMV_GROUPS, Options

GEMV_KERNELS = ("cb_gemv_mma", "cb_gemm_wgmma", "x_wgmma")  # the layers' 4-bit GEMVs (and the wgmma x-order copy)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cbk")
    ap.add_argument("--sizes", default="1,16,64")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--grouped-groups", type=int, choices=GROUPED_GEMV_GROUPS, default=1,
                    help="KernelOptions.grouped_gemv_groups: row groups of 16 a block of the >16-row mma GEMV")
    ap.add_argument("--many-rows", choices=("wgmma", "mma"), default="wgmma",
                    help="KernelOptions.many_rows: the >16-row GEMV's kernel (wgmma where it builds and takes the shape)")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    eng = GpuEngine(load_checkpoint(a.cbk), 1024, device="cuda", options=Options().replace(
        kernels={"grouped_gemv_groups": a.grouped_groups, "many_rows": a.many_rows}))
    per, plen = 8, 38
    runner = GpuBatchRunner(eng, max(sizes) * per, 16)
    tables = [torch.arange(i * per, (i + 1) * per) for i in range(max(sizes))]
    prompt = list(range(100, 100 + plen))
    for t in tables:
        runner.prefill(t, prompt, 0)
    torch.cuda.synchronize()
    for S in sizes:
        ip, tab = runner._stage(S, tables[:S], [prompt[-1]] * S, [plen] * S, reuse=False)
        ip, tab = ip.cuda(), tab.cuda()
        C = runner.chunk_bound(plen + 1)  # the split grid the step's graph launches
        for _ in range(3):
            runner._forward(ip[0], ip[1], tab, C)
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile
        n = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                runner._forward(ip[0], ip[1], tab, C)
            torch.cuda.synchronize()
        tot, cnt = collections.Counter(), collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                tot[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                cnt[e.name] += 1
        all_us = sum(tot.values()) / n
        gemv_us = sum(us for name, us in tot.items() if any(k in name for k in GEMV_KERNELS)) / n
        k = sum(cnt.values()) // n
        print(f"\nS={S}: eager device time {all_us / 1e3:.3f} ms per step, {k} kernels per step "
              f"({k / eng.cfg.num_layers:.1f} per layer); 4-bit GEMVs {gemv_us / 1e3:.3f} ms")
        for name, us in tot.most_common(a.top):
            print(f"  {us / n / 1e3:7.3f} ms  {cnt[name] // n:5d}x  {name[:110]}")
        step = ([prompt[-1]] * S, [plen] * S)
        for _ in range(3):  # capture the bucket's graph, then replay it
            runner.decode(tables[:S], *step)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                runner.decode(tables[:S], *step)
            torch.cuda.synchronize()
        dev = sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                  for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(20):
            runner.decode(tables[:S], *step)
        t1.record()
        torch.cuda.synchronize()
        print(f"S={S}: graph replay kernels' device time {dev / n / 1e3:.3f} ms per step; "
              f"decode() wall {t0.elapsed_time(t1) / 20:.3f} ms per step (20 steps back to back)")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
