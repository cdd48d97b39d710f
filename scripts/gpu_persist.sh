#!/usr/bin/env bash
# Session 4, one device call: the persistent 4-bit GEMV (variant 12) against variant 11. Builds both
# extensions, runs the tiled/persistent GEMV tests and the engine tests left unverified in session 3,
# the GEMV table (v11, v12, cuBLAS), Llama-2-7B decode under v11 and v12, and ncu counters of both.
# Logs: $OUT/logs.tgz; tables printed last. Usage on the device: OUT=... bash scripts/gpu_persist.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-out/gpu-persist}
L=$(mktemp -d)
mkdir -p "$OUT"
t0=$(date +%s)
deadline=$(( t0 + ${BUDGET_S:-560} ))
budget() { local left=$(( deadline - $(date +%s) - $2 )) c=$1; (( left < c )) && c=$left; (( c < 5 )) && c=5; echo $c; }
since() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$L/gpu.txt"
python3 -c "from trapetum.kernels import cuda_ext; assert cuda_ext.load() is not None, cuda_ext.error()" > "$L/build4.log" 2>&1 &
python3 -c "from trapetum.kernels import additive_gemv as ag; assert ag._load_ext() is not None, ag._EXT_ERR" > "$L/build2.log" 2>&1 &
wait
echo "build done ($(since)): $(tail -c 300 "$L/build4.log") $(tail -c 300 "$L/build2.log")"

timeout "$(budget 150 330)" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gemv.py tests/test_engine_gpu.py \
  tests/test_additive_kernels.py -k "tiled or persistent or owns or kill_switch or bitwise or graph" > "$L/pytest.log" 2>&1
echo "tests: $(tail -1 "$L/pytest.log") ($(since))"
timeout "$(budget 60 270)" python3 -m trapetum.eval.bench_kernels --only gemv --backends mma_v11,mma_v12 --out "$L/kernels" \
  > "$L/kernels.log" 2>&1; echo "gemv bench rc=$? ($(since))"
TRAPETUM_GEMV_V=12 timeout "$(budget 90 170)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats fp16,cb4 \
  --bins 0,3968 --out "$L/e2e_v12" > "$L/e2e_v12.log" 2>&1; echo "e2e v12 rc=$? ($(since))"
TRAPETUM_GEMV_V=11 timeout "$(budget 50 110)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats cb4 \
  --bins 0 --out "$L/e2e_v11" > "$L/e2e_v11.log" 2>&1; echo "e2e v11 rc=$? ($(since))"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [ -n "$NCU" ]; then
  M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed
  timeout "$(budget 60 5)" "$NCU" --clock-control none -k regex:cb_gemv --metrics "$M" \
    python3 -m trapetum.eval.bench_kernels --ncu-driver > "$L/ncu_cb.txt" 2>&1; echo "ncu rc=$? ($(since))"
  python3 - "$L/ncu_cb.txt" > "$L/ncu_summary.txt" <<'PY'
import re, sys
cur = None
for line in open(sys.argv[1]):
    m = re.search(r"\s(cb_gemv\w*)(?:<[^>]*>)?\(.*\((\d+), 1, 1\)x", line) or re.search(r"(cb_gemv_\w+)<([^>]*)>", line)
    if m and "cb_gemv" in line and "(" in line:
        if cur: print(" ".join(cur))
        cur = [line.strip()[:70]]
        continue
    p = line.split()
    if cur and p and p[0].startswith(("gpu__", "dram__", "l1tex__", "smsp__", "sm__")):
        k = re.sub(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active.ratio", r"st_\1", p[0])
        cur += [k.split("__")[-1][:22], p[-1]]
if cur: print(" ".join(cur))
PY
fi
tar czf "$OUT/logs.tgz" -C "$L" .
echo "==== tables ($(since))"
grep -h "FAILED\|Error" "$L"/pytest*.log | head -20
cat "$L/kernels/kernels.md" 2>/dev/null | grep -v "^$" | head -30
for d in e2e_v12 e2e_v11; do grep "^|" "$L/$d/results.md" 2>/dev/null | head -12; done
cat "$L/ncu_summary.txt" 2>/dev/null
