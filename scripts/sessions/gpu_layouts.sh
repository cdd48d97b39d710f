#!/usr/bin/env bash
# Code-layout experiment in one device call (session 3): the 4-bit GEMV on tiled codes (variant 11)
# against variant 7, and the 2x8 kernel on "slices" codes (one launch for q/k/v and gate/up) against
# the canonical layout. Builds both extensions, runs the layout tests, the kernel tables, the end-to-end
# decode (Llama-2-7B 4-bit v7 / v11, Llama-2-70B 2x8), ncu counters of the 2x8 / 1x16 / 4-bit kernels,
# then the rest of the GPU tests with the time left. Every step has a timeout drawn from one deadline.
# Logs: $OUT/logs.tgz; the tables are printed last. Usage on the device: OUT=... bash scripts/sessions/gpu_layouts.sh
OUT=${OUT:-out/gpu-layouts}
source "$(dirname "$0")/../gpu_common.sh"

timeout "$(budget 90 420)" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gemv.py tests/test_additive_kernels.py \
  -k "tile or tiled or packed or cuda_random or bitwise or graph or host or mixed or real_shapes" > "$L/pytest_quick.log" 2>&1
echo "quick tests: $(tail -1 "$L/pytest_quick.log") ($(since))"

timeout "$(budget 60 360)" python3 -m trapetum.eval.bench_kernels --only gemv --backends mma_v7,mma_v11 --out "$L/kernels" \
  > "$L/kernels.log" 2>&1; echo "gemv bench rc=$? ($(since))"
timeout "$(budget 60 300)" python3 -m trapetum.kernels.additive_gemv --backends cuda --json "$L/additive.json" \
  > "$L/additive.log" 2>&1; echo "additive bench rc=$? ($(since))"

TRAPETUM_GEMV_V=11 timeout "$(budget 80 220)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats fp16,cb4 \
  --bins 0,3968 --out "$L/e2e_v11" > "$L/e2e_v11.log" 2>&1; echo "e2e v11 rc=$? ($(since))"
TRAPETUM_GEMV_V=7 timeout "$(budget 50 170)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats cb4 \
  --bins 0 --out "$L/e2e_v7" > "$L/e2e_v7.log" 2>&1; echo "e2e v7 rc=$? ($(since))"
timeout "$(budget 80 90)" python3 -m trapetum.eval.bench_e2e --models llama2-70b --formats aqlm-2x8 --bins 0 \
  --out "$L/e2e_70b" > "$L/e2e_70b.log" 2>&1; echo "e2e 70b 2x8 rc=$? ($(since))"

NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [ -n "$NCU" ]; then
  cat > "$L/ncu_drv.py" <<'PY'
import torch
from trapetum.kernels import additive_gemv as ag
gen = torch.Generator(device="cuda").manual_seed(0)
for k, n in ((8192, 28672), (4096, 4096)):
    codes, cb, sc = ag._random_layout(n, k, 2, 8, gen)
    x = torch.randn(k, device="cuda", dtype=torch.float16, generator=gen)
    y = torch.empty(n, device="cuda", dtype=torch.float16)
    for layout in ("rows", "slices"):
        ag.Packed2x8([(codes, cb, sc, None)], layout=layout).gemv(x, y)
codes, cb, sc = ag._random_layout(28672, 8192, 1, 16, gen)
ag.additive_gemv(torch.randn(1, 8192, device="cuda", dtype=torch.float16, generator=gen), codes, cb, sc)
torch.cuda.synchronize()
PY
  M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__t_sector_hit_rate.pct,l1tex__throughput.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active
  timeout "$(budget 70 40)" "$NCU" --clock-control none -k regex:aqlm --metrics "$M" python3 "$L/ncu_drv.py" > "$L/ncu_aqlm.txt" 2>&1
  echo "ncu aqlm rc=$? ($(since))"
  timeout "$(budget 40 10)" "$NCU" --clock-control none -k regex:cb_gemv --metrics "$M" \
    python3 -m trapetum.eval.bench_kernels --ncu-driver > "$L/ncu_cb.txt" 2>&1; echo "ncu cb rc=$? ($(since))"
  python3 - "$L/ncu_aqlm.txt" "$L/ncu_cb.txt" > "$L/ncu_summary.txt" <<'PY'
import re, sys
short = {"gpu__time_duration.sum": "us", "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%",
         "dram__bytes_read.sum": "dramB", "lts__t_sectors_srcunit_tex_op_read.sum": "l2sect",
         "lts__t_sector_op_read_hit_rate.pct": "l2hit%", "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2%",
         "l1tex__t_sector_hit_rate.pct": "l1hit%", "l1tex__throughput.avg.pct_of_peak_sustained_active": "l1%",
         "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": "shwf", "l1tex__data_pipe_lsu_wavefronts.sum": "wf",
         "smsp__inst_executed.sum": "inst", "sm__warps_active.avg.pct_of_peak_sustained_active": "occ%",
         "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue%"}
for f in sys.argv[1:]:
    cur = None
    for line in open(f):
        m = re.search(r"\s(\w*(?:aqlm|cb_gemv)\w*)(?:<[^>]*>)?\(.*\((\d+), 1, 1\)x", line)
        if m:
            if cur: print(" ".join(cur))
            cur = [m.group(1)[:24], "grid", m.group(2)]
            continue
        p = line.split()
        if cur and p and p[0].startswith(("gpu__", "dram__", "lts__", "l1tex__", "smsp__", "sm__")):
            k = short.get(p[0]) or re.sub(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active.ratio", r"st_\1", p[0])
            cur += [k, p[-1]]
    if cur: print(" ".join(cur))
PY
fi

timeout "$(budget 300 0)" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gemv.py tests/test_additive_kernels.py \
  tests/test_engine_gpu.py -k "not (tile or tiled or packed or cuda_random or bitwise or graph or host or mixed or real_shapes)" \
  > "$L/pytest_rest.log" 2>&1; echo "other tests: $(tail -1 "$L/pytest_rest.log") ($(since))"

tar czf "$OUT/logs.tgz" -C "$L" .
echo "==== tables ($(since))"
grep -h "FAILED\|Error" "$L"/pytest_*.log | head -20
cat "$L/kernels/kernels.md" 2>/dev/null | grep -v "^$" | head -30
grep "^|" "$L/additive.log" | head -30
for d in e2e_v11 e2e_v7 e2e_70b; do grep "^|" "$L/$d/results.md" 2>/dev/null | head -12; done
cat "$L/ncu_summary.txt" 2>/dev/null
