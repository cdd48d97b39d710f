#!/usr/bin/env bash
# Session 16's plan for the next device session's first call (one cold start for the GPU items that need no GGUF):
#   1. issue 19: both sparse kernels' GPU tests, then bench_sparse --e2e at 0.25 / 0.5 with cuda and mma
#      (scripts/sessions/gpu_sparse_mma.sh, KERNEL_TABLE=0), so the loser can be deleted with its tests;
#   2. issue 23 item 3: `bench quantize --shape llama2-7b --device cuda --gptq` alone on the machine (session 12's
#      193.1 s shared the GPU with three pytest processes; bar 180 s);
#   3. issues 15 / 20: where a 64-row paged decode step's device time goes (scripts/dev/profile_paged_step.py on a
#      Llama-2-7B-shape random 4-bit .cbk made on the GPU), before any new GEMV kernel.
# Usage on the device: OUT=... STEPS="1 2" bash scripts/sessions/gpu_s17_first.sh, then STEPS=3 in the next call
# (steps 1 + 2 need ~470 s, step 3 ~120 s with the .cbk's generation; BUDGET_S, default 580 s, is shared in order:
# step 1 up to 330 s, step 2 up to 220 s, step 3 what is left). Carry: .whl, xfer/smollm2-tokenizer.
# Prints one line a step; logs under $OUT. (Session 17 ran step 1 with E2E_KERNELS=cuda,mma; the "cuda" kernel was
# deleted after it, so step 1 now runs mma alone.)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-out/gpu-s17}; mkdir -p "$OUT"
t0=$(date +%s); B=${BUDGET_S:-580}
left() { echo $(( B - ($(date +%s) - t0) )); }
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1
STEPS=" ${STEPS:-1 2 3} "
step() { [[ $STEPS == *" $1 "* ]]; }
step 1 && { OUT=$OUT/sparse BUDGET_S=$(( $(left) < 330 ? $(left) : 330 )) KERNEL_TABLE=0 E2E_KERNELS=mma \
  bash scripts/sessions/gpu_sparse_mma.sh > "$OUT/sparse.txt" 2>&1
echo "1. sparse: $(grep -h "tests rc\|e2e rc" "$OUT/sparse.txt" | tr '\n' ' ') ($(( $(date +%s) - t0 )) s)"; }
step 2 && { s=$(( $(left) < 220 ? $(left) : 220 ))
timeout $(( s > 5 ? s : 5 )) python3 -m trapetum.cli bench quantize --shape llama2-7b --device cuda --gptq \
  > "$OUT/quantize_gptq.txt" 2>&1
echo "2. 7B --gptq quantize rc=$?: $(tail -c 300 "$OUT/quantize_gptq.txt" | tr '\n' ' ') ($(( $(date +%s) - t0 )) s)"; }
step 3 || exit 0
F=/tmp/random-llama2-7b-cb4.cbk  # after the timed steps: its generation would share the GPU with them
[ -s "$F" ] || python3 -m trapetum.eval.random_cbk --shape llama2-7b --format cb4 \
  --tokenizer xfer/smollm2-tokenizer/tokenizer.json --out "$F" --device cuda > "$OUT/random_cbk.log" 2>&1
s=$(left)
timeout $(( s > 5 ? s : 5 )) python3 scripts/dev/profile_paged_step.py "$F" --sizes 1,16,64 --grouped-groups 2 \
  > "$OUT/paged_step.txt" 2>&1
echo "3. paged step profile rc=$? ($(( $(date +%s) - t0 )) s)"; tail -25 "$OUT/paged_step.txt"
