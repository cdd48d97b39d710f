#!/usr/bin/env bash
# Session 6 device runs. Logs: $OUT/logs.tgz; tables printed last. Usage on the device: PART=a OUT=... bash scripts/sessions/gpu_session6.sh
# PART=a: the quantizer's Triton beam step: its GPU tests, one 11008x4096 projection with the torch step and the
#   Triton step (scripts/profile_quantizer.py), then the whole Llama-2-7B shape 2x8 quantizer run (bench quantize,
#   parts kept in the ignored out/q7b: run PART=q again on a warm device to resume if the budget cuts it).
# PART=q: the whole-model quantizer run only (resumes from out/q7b).
# PART=b: length-adaptive attention (AttnConfig.splits): its GPU tests, the attention sweep at 128 / 1k / 4k
#   positions (MHA) and 128 / 4k (GQA), Llama-2-7B fp16 + 4-bit decode at 0-128 and 3968-4096 with the default
#   and with the split / 512-chunk configs, Llama-3-8B 4-bit at 0-128 the same way.
# PART=c: after SPLIT8_CONFIG became the default for >= 32 kv heads: Llama-2-7B fp16 + 4-bit at 0-128 and
#   3968-4096 (then the old default, c64, in the same process), the split / named-config and engine GPU tests.
# PART=d: Llama-2-7B fp16 + 4-bit at 0-128 and 3968-4096 with the engine's choice (fixed chunks for dense fp16
#   projections, 8 splits for the 4-bit ones), then p8 and c64 named, in one process.
OUT=${OUT:-out/gpu-session6}
PART=${PART:-a}
BUDGET_S=${BUDGET_S:-570}
[ "$PART" = a ] || [ "$PART" = q ] && SKIP_BUILD=1
source "$(dirname "$0")/../gpu_common.sh"
quant_full() {
  timeout "$(budget 560 5)" python3 -m trapetum.eval.bench_quantize --shape llama2-7b --scheme aqlm-2x8 --device cuda \
    --work out/q7b > "$L/quant.log" 2>&1; echo "quantizer rc=$? ($(since))"; cp "$L/quant.log" "$OUT/quant_$(date +%s).log"
}
if [ "$PART" = a ]; then
  timeout "$(budget 120 400)" python3 -m pytest -q -p no:cacheprovider tests/test_beam_search.py > "$L/pytest_beam.log" 2>&1
  echo "beam tests: $(tail -1 "$L/pytest_beam.log") ($(since))"
  timeout "$(budget 90 330)" python3 scripts/profile_quantizer.py --out "$L/qprof" --runs torch:65536,triton:1048576 \
    > "$L/qprof.log" 2>&1; echo "quantizer profile rc=$? ($(since))"
  quant_full
elif [ "$PART" = q ]; then
  quant_full
elif [ "$PART" = c ]; then
  timeout "$(budget 150 200)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats fp16,cb4 --bins 0,3968 \
    --attn-configs c64-w4-m64w4d32 --out "$L/e2e7" > "$L/e2e7.log" 2>&1; echo "e2e 7b rc=$? ($(since))"
  timeout "$(budget 130 70)" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py \
    -k "split or named or chooser" > "$L/pytest_attn.log" 2>&1; echo "attention tests: $(tail -1 "$L/pytest_attn.log") ($(since))"
  timeout "$(budget 120 0)" python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py -x \
    > "$L/pytest_engine.log" 2>&1; echo "engine tests: $(tail -1 "$L/pytest_engine.log") ($(since))"
elif [ "$PART" = d ]; then  # after the engine keeps fixed chunks for dense fp16 projections
  timeout "$(budget 150 0)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats fp16,cb4 --bins 0,3968 \
    --attn-configs p8c64b64s3-w4-m64w4d32,c64-w4-m64w4d32 --out "$L/e2e7" > "$L/e2e7.log" 2>&1; echo "e2e 7b rc=$? ($(since))"
elif [ "$PART" = b ]; then
  CFGS=p8c64b64s3-w4-m64w4d32,p16c64b64s3-w4-m64w4d32,p4c64b64s3-w4-m64w4d32,c512b64s3-w4-m64w4d32
  timeout "$(budget 200 280)" python3 scripts/attn_sweep.py --out "$L/sweep" \
    --shapes "mha-32/32x128@128,mha-32/32x128@1024,mha-32/32x128@4096,gqa-32/8x128@4096,gqa-32/8x128@128" \
    > "$L/sweep.log" 2>&1; echo "attention sweep rc=$? ($(since))"
  timeout "$(budget 150 130)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats fp16,cb4 --bins 0,3968 \
    --attn-configs $CFGS --out "$L/e2e7" > "$L/e2e7.log" 2>&1; echo "e2e 7b rc=$? ($(since))"
  timeout "$(budget 70 60)" python3 -m trapetum.eval.bench_e2e --models llama3-8b --formats cb4 --bins 0 \
    --attn-configs $CFGS --out "$L/e2e8" > "$L/e2e8.log" 2>&1; echo "e2e 8b rc=$? ($(since))"
  timeout "$(budget 120 0)" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py \
    -k "split or graph or named" > "$L/pytest_attn.log" 2>&1; echo "attention tests: $(tail -1 "$L/pytest_attn.log") ($(since))"
fi
tar czf "$OUT/logs.tgz" -C "$L" .
echo "==== tables ($(since))"
grep -h "FAILED\|Error" "$L"/pytest*.log 2>/dev/null | head -20
tail -6 "$L/qprof.log" 2>/dev/null
grep "\[bench\]" "$L"/quant*.log 2>/dev/null | tail -4
grep "^{" "$L"/quant*.log 2>/dev/null | tail -1 | cut -c1-1500
sed -n "/## Summary/,\$p" "$L/sweep.log" 2>/dev/null | head -20
grep "^|" "$L"/e2e*.log 2>/dev/null | grep -v "^|---" | head -40
