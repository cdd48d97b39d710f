#!/usr/bin/env bash
# Session 20 (issue 20): the shortest load call, 1 and 64 clients per server configuration: both extensions built
# beside the random 7B-shape .cbk (gpu_common.sh start_batch_builds), then gpu_load.sh LEVELS="1 64" EXTRA=0 for each
# NAME:ARGS of CONFIGS (default "default:", today's server with the scheduler's row groups: prompt rows folded only
# into the decode rows' last 64-row group; commas in ARGS stand for spaces). CONFIGS="default: fold0:--fold-prompts,0"
# also measures prompts as prefill forwards in the same call; LEVELS (default "1 64") the client counts.
# Usage on the device: OUT=DIR BUDGET_S=200 bash scripts/sessions/gpu_s20_rowgroup.sh   (carry .whl, xfer)
OUT=${OUT:-out/s20rg}
SKIP_BUILD=1
BUDGET_S=${BUDGET_S:-200}
CONFIGS=${CONFIGS:-default:}
LEVELS=${LEVELS:-1 64}
source "$(dirname "$0")/../gpu_common.sh"
start_batch_builds
wait
echo "builds and cbk ($(since)): $(tail -c 160 "$L/random_cbk.log")"
for cfg in $CONFIGS; do
  name=${cfg%%:*}; extra=${cfg#*:}
  OUT=$OUT/$name BUDGET_S=$(budget 300 3) TESTS=0 EXTRA=0 LEVELS="$LEVELS" \
    BATCH="--max-batch 64 --gpu-batch --kv-mem 32 --overlap ${extra//,/ }" bash scripts/sessions/gpu_load.sh > "$L/load_$name.log" 2>&1
  echo "-- $name ($(since))"; tail -6 "$L/load_$name.log"
done
tar czf "$OUT/logs.tgz" -C "$L" .
