#!/usr/bin/env bash
# Session 20 (issue 20): where the 64-row step and the wgmma GEMV spend their time, in one device call.
#   1. builds (main extension, wgmma extension) beside a random Llama-2-7B-shape 4-bit .cbk (as gpu_load.sh);
#   2. tests/test_kernels_gemv_wgmma.py (the launcher change of 6485b1a had not run on a GPU; warpgroups a block);
#   3. scripts/dev/wgmma_gemm_check.py: bits of every (nx, rs, wg) case, then times of 1, 2, 3 warpgroups a block;
#   4. the load bench (gpu_load.sh, TESTS=0, EXTRA=0) at 1, 16, 64 clients with the warpgroup count W that the check
#      found fastest on the 64-row 4096x11008 and gate/up calls (serve --wgmma-warpgroups W), and if W is not 1,
#      1 and 64 clients with the kernel's own rule (1 today) on the same card;
#   5. scripts/dev/profile_paged_step.py at 1, 16, 64 sequences (wgmma) and 64 (mma): the step's kernels;
#   6. Nsight Compute on one launch each of wgmma at 64 rows of 4096x11008 (wg 1 and W) and the grouped mma kernel
#      (speed of light, memory, warp states, occupancy, scheduler), while the budget lasts.
# Usage on the device: OUT=DIR BUDGET_S=580 bash scripts/sessions/gpu_s20_profile.sh   (carry .whl, xfer)
OUT=${OUT:-out/s20}
SKIP_BUILD=1
BUDGET_S=${BUDGET_S:-580}
source "$(dirname "$0")/../gpu_common.sh"
start_batch_builds
rc=0; wait $B1 || rc=3; wait $B2 || rc=3
echo "builds rc=$rc ($(since))"
[ $rc = 0 ] || { tail -c 3000 "$L"/build_*.log; tar czf "$OUT/logs.tgz" -C "$L" .; exit 3; }
timeout "$(budget 100 350)" python3 -m pytest -q -x -rf -p no:cacheprovider tests/test_kernels_gemv_wgmma.py > "$L/pytest.log" 2>&1
echo "GPU tests rc=$?: $(tail -1 "$L/pytest.log") ($(since))"; grep -E "^FAILED|Error" "$L/pytest.log" | head -10
cp "$L/pytest.log" "$OUT/"
timeout "$(budget 150 200)" python3 scripts/dev/wgmma_gemm_check.py --rows 64 --bench-rows 64 --out "$OUT/wg" > "$OUT/wg.log" 2>&1
echo "wgmma gemm check rc=$? ($(since))"

W=$(python3 - "$OUT/wg/wgmma_gemm.json" <<'EOF'
import json, sys
try:
    rows = [r for r in json.load(open(sys.argv[1]))["bench"] if r["M"] == 64 and r["shape"].startswith("4096x11008")]
    best = min((sum(r[v] for r in rows), w) for v, w in (("auto", 1), ("wg2", 2), ("wg3", 3)))
    print(best[1])
except Exception:
    print(1)
EOF
)
echo "warpgroups for the load bench: $W ($(since))"
wait $CBK; echo "random cbk: $(grep -h "^wrote\|^rc=\|rror" "$L/random_cbk.log" | tr '\n' ' ') ($(since))"
B="--max-batch 64 --gpu-batch --kv-mem 32 --overlap"
OUT=$OUT/load_w$W BUDGET_S=$(budget 260 150) TESTS=0 EXTRA=0 LEVELS="1 16 64" BATCH="$B --wgmma-warpgroups $W" \
  bash scripts/sessions/gpu_load.sh > "$L/load_w$W.log" 2>&1
echo "load W=$W done ($(since))"
if [ "$W" != 1 ]; then
  OUT=$OUT/load_rule BUDGET_S=$(budget 150 100) TESTS=0 EXTRA=0 LEVELS="1 64" BATCH="$B" bash scripts/sessions/gpu_load.sh \
    > "$L/load_rule.log" 2>&1
  echo "load rule done ($(since))"
fi
timeout "$(budget 100 40)" python3 scripts/dev/profile_paged_step.py "$F" --sizes 1,16,64 > "$OUT/profile_wgmma.txt" 2>&1
echo "profile wgmma rc=$? ($(since))"
timeout "$(budget 60 25)" python3 scripts/dev/profile_paged_step.py "$F" --sizes 64 --many-rows mma > "$OUT/profile_mma.txt" 2>&1
echo "profile mma rc=$? ($(since))"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats --section ComputeWorkloadAnalysis"
prof() {  # prof NAME KERNEL_REGEX ARGS...: one launch of scripts/dev/gemv_rows_once.py under ncu
  local name=$1 k=$2; shift 2
  timeout "$(budget 40 10)" "$NCU" --clock-control none -k "regex:$k" --launch-skip 2 --launch-count 1 $SECTIONS \
    python3 scripts/dev/gemv_rows_once.py "$@" > "$OUT/ncu_$name.txt" 2>&1
  echo "ncu $name rc=$? ($(since))"
}
if [ -n "$NCU" ]; then
  prof wg1_4096x11008 cb_gemm_wgmma --shape 4096x11008 --rows 64 --wg 1
  [ "$W" != 1 ] && prof "wg${W}_4096x11008" cb_gemm_wgmma --shape 4096x11008 --rows 64 --wg "$W"
  prof mma_4096x11008 cb_gemv_mma --shape 4096x11008 --rows 64 --many-rows mma
else
  echo "no ncu"
fi
tar czf "$OUT/logs.tgz" -C "$L" .
echo "==== wgmma check"
grep -v "^{" "$OUT/wg.log" | tail -12
echo "==== ncu summaries"
for f in "$OUT"/ncu_*.txt; do
  echo "-- $(basename "$f")"
  grep -E "^\s+(Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit Registers|Block Limit Shared Mem|Issued Warp Per Scheduler|No Eligible|Active Warps Per Scheduler|Eligible Warps Per Scheduler|Warp Cycles Per Issued Instruction|Executed Ipc Active|Waves Per SM)" "$f" | sed 's/  */ /g' | head -24
  grep -iE "stall|Est\. Speedup" "$f" | head -8 | cut -c1-220
done
echo "==== profiles"
grep -E "^S=|ms .*x " "$OUT"/profile_*.txt | cut -c1-160 | head -70
echo "==== load"
for f in "$L"/load_*.log; do echo "-- $(basename "$f")"; tail -10 "$f"; done
