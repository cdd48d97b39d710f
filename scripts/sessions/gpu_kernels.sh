#!/usr/bin/env bash
# GEMV kernel work (about 3 minutes of a device call): GPU correctness tests of every mma variant,
# the GEMV table (all variants vs cuBLAS), ncu counters per variant. Writes $OUT/best_variant,
# which scripts/gpu_suite.sh then uses. Usage on the device: bash scripts/sessions/gpu_kernels.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)
python3 -c "from trapetum.kernels import cuda_ext; assert cuda_ext.load() is not None, cuda_ext.error()" \
  > "$OUT/build.log" 2>&1; echo "build rc=$? $(( $(date +%s) - t0 )) s"
timeout 200 python3 -m pytest -q -x tests/test_kernels_gemv.py -p no:cacheprovider > "$OUT/pytest_gemv.log" 2>&1
tail -2 "$OUT/pytest_gemv.log"; echo "tests $(( $(date +%s) - t0 )) s"
timeout 200 python3 -m trapetum.eval.bench_kernels --only gemv --out "$OUT/kernels" > "$OUT/kernels.log" 2>&1
echo "bench $(( $(date +%s) - t0 )) s"
python3 - "$OUT" <<'PY'
import json, math, sys
res = json.load(open(f"{sys.argv[1]}/kernels/kernels.json"))
rows = [r for r in res["gemv"] if r["bits"] == 4 and r["M"] == 1]
best, score = 3, 0.0
for v in (3, 4, 5, 7, 11):
    rs = [r.get(f"mma_v{v}_vs_cublas") for r in rows]
    if all(rs):
        g = math.exp(sum(map(math.log, rs)) / len(rs))
        print(f"v{v}: geomean {g:.2f}x cuBLAS, " + " ".join(f"{x:.2f}" for x in rs))
        if g > score:
            best, score = v, g
open(f"{sys.argv[1]}/best_variant", "w").write(str(best))
print("best variant", best)
PY
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [ -n "$NCU" ]; then
  timeout 100 "$NCU" --clock-control none -k regex:cb_gemv --metrics \
gpu__time_duration.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__data_pipe_lsu_wavefronts.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    python3 -m trapetum.eval.bench_kernels --ncu-driver > "$OUT/ncu_metrics.txt" 2>&1; echo "ncu metrics rc=$?"
  python3 - "$OUT/ncu_metrics.txt" <<'PY'
import re, sys
cur, keys = None, {"gpu__time_duration.sum": "us", "l1tex__data_pipe_lsu_wavefronts.sum": "wavef",
                   "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": "shared", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": "sectors",
                   "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active": "alu%",
                   "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active": "lsu%",
                   "l1tex__throughput.avg.pct_of_peak_sustained_active": "l1%", "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%"}
for line in open(sys.argv[1]):
    m = re.search(r"(cb_gemv_\w+_kernel<[^>]*>).*\((\d+), 1, 1\)x", line)
    if m:
        if cur: print(" ".join(cur))
        cur = [m.group(1), "grid", m.group(2)]
        continue
    parts = line.split()
    if cur and parts and parts[0] in keys:
        cur += [keys[parts[0]], parts[-1]]
if cur: print(" ".join(cur))
PY
else
  echo "no ncu"
fi
echo "ncu $(( $(date +%s) - t0 )) s"
echo "==== tables"
cat "$OUT/kernels/kernels.md" 2>/dev/null
