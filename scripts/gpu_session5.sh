#!/usr/bin/env bash
# Session 5 device runs. PART=a: 4-bit GEMV variants 13 / 14 (half the rows by byte permutes): their GPU tests,
# the GEMV table against v11 and cuBLAS (PDL off, see graph_time_us), Llama-2-7B 4-bit decode under each variant.
# Logs: $OUT/logs.tgz; tables printed last. Usage on the device: PART=a OUT=... bash scripts/gpu_session5.sh
OUT=${OUT:-out/gpu-session5}
PART=${PART:-a}
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/gpu_common.sh"
if [ "$PART" = a ]; then
  timeout "$(budget 90 400)" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gemv.py -k "tiled" -x \
    > "$L/pytest_gemv.log" 2>&1; echo "gemv tests: $(tail -1 "$L/pytest_gemv.log") ($(since))"
  timeout "$(budget 120 250)" python3 -m trapetum.eval.bench_kernels --only gemv --backends mma_v11,mma_v13,mma_v14 \
    --out "$L/kernels" > "$L/kernels.log" 2>&1; echo "gemv bench rc=$? ($(since))"
  for v in 13 11 14; do
    TRAPETUM_GEMV_V=$v timeout "$(budget 80 20)" python3 -m trapetum.eval.bench_e2e --models llama2-7b \
      --formats $([ $v = 13 ] && echo fp16,cb4 || echo cb4) --bins 0,3968 --out "$L/e2e7_v$v" > "$L/e2e7_v$v.log" 2>&1
    echo "e2e 7b v$v rc=$? ($(since))"
  done
fi
tar czf "$OUT/logs.tgz" -C "$L" .
echo "==== tables ($(since))"
grep -h "FAILED\|Error" "$L"/pytest*.log 2>/dev/null | head -20
cat "$L/kernels/kernels.md" 2>/dev/null | grep "^|" | head -16
for d in "$L"/e2e*/; do echo "-- $d"; grep "^|" "$d/results.md" 2>/dev/null | head -30; done
