#!/usr/bin/env bash
# Session 20 (issue 20): does folding prompts into the batched decode forward cost the 64-client level its rate?
# A 64-row step with 40 folded prompt rows runs 104 rows: two 64-row groups of the wgmma GEMV, each dequantizing
# every weight again. One call: both extensions built beside the random 7B-shape .cbk, then gpu_load.sh (EXTRA=0)
# at 1 and 64 clients with the default server (--fold-prompts 128) and with --fold-prompts 0 (prompts as prefill
# forwards), same card. Usage on the device: OUT=DIR BUDGET_S=380 bash scripts/sessions/gpu_s20_fold.sh (carry .whl, xfer)
OUT=${OUT:-out/s20fold}
SKIP_BUILD=1
BUDGET_S=${BUDGET_S:-380}
source "$(dirname "$0")/../gpu_common.sh"
python3 -m pip install -q --no-index --no-deps .whl/gguf-*.whl > "$L/pip.log" 2>&1
F=/tmp/random-llama2-7b-cb4.cbk
python3 -c "from trapetum.kernels import cuda_ext; assert cuda_ext.load() is not None, cuda_ext.error()" > "$L/build_main.log" 2>&1 &
python3 -c "from trapetum.kernels import codebook_gemm_wgmma as m; assert m.EXT.load() is not None, m.EXT.error()" > "$L/build_wg.log" 2>&1 &
python3 -m trapetum.eval.random_cbk --shape llama2-7b --format cb4 --tokenizer xfer/smollm2-tokenizer/tokenizer.json \
  --out "$F" --device cuda > "$L/random_cbk.log" 2>&1 &
wait
echo "builds and cbk ($(since)): $(tail -c 200 "$L/random_cbk.log")"
B="--max-batch 64 --gpu-batch --kv-mem 32 --overlap"
for cfg in "fold128:" "fold0:--fold-prompts 0"; do
  name=${cfg%%:*}; extra=${cfg#*:}
  OUT=$OUT/$name BUDGET_S=$(budget 150 20) TESTS=0 EXTRA=0 LEVELS="1 64" BATCH="$B $extra" \
    bash scripts/sessions/gpu_load.sh > "$L/load_$name.log" 2>&1
  echo "load $name done ($(since))"
done
tar czf "$OUT/logs.tgz" -C "$L" .
for f in "$L"/load_*.log; do echo "-- $(basename "$f")"; tail -6 "$f"; done
