#!/usr/bin/env bash
# Session 20 (issue 20): the load bench at 1 and 64 clients with the scheduler's row groups (prompt rows folded only
# into the decode rows' last 64-row group), the shortest call that measures it: both extensions built beside the
# random 7B-shape .cbk, then gpu_load.sh LEVELS="1 64" EXTRA=0. Compare with gpu_s20_profile.sh's load (same card).
# Usage on the device: OUT=DIR BUDGET_S=200 bash scripts/sessions/gpu_s20_rowgroup.sh   (carry .whl, xfer)
OUT=${OUT:-out/s20rg}
SKIP_BUILD=1
BUDGET_S=${BUDGET_S:-200}
source "$(dirname "$0")/../gpu_common.sh"
python3 -m pip install -q --no-index --no-deps .whl/gguf-*.whl > "$L/pip.log" 2>&1
python3 -c "from trapetum.kernels import cuda_ext; assert cuda_ext.load() is not None, cuda_ext.error()" > "$L/build_main.log" 2>&1 &
python3 -c "from trapetum.kernels import codebook_gemm_wgmma as m; assert m.EXT.load() is not None, m.EXT.error()" > "$L/build_wg.log" 2>&1 &
python3 -m trapetum.eval.random_cbk --shape llama2-7b --format cb4 --tokenizer xfer/smollm2-tokenizer/tokenizer.json \
  --out /tmp/random-llama2-7b-cb4.cbk --device cuda > "$L/random_cbk.log" 2>&1 &
wait
echo "builds and cbk ($(since)): $(tail -c 160 "$L/random_cbk.log")"
OUT=$OUT/load BUDGET_S=$(budget 300 3) TESTS=0 EXTRA=0 LEVELS="1 64" \
  BATCH="--max-batch 64 --gpu-batch --kv-mem 32 --overlap" bash scripts/sessions/gpu_load.sh 2>&1 | tail -8
tar czf "$OUT/logs.tgz" -C "$L" .
