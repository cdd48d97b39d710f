#!/usr/bin/env bash
# Session 5 device runs. PART=a (at commit ecd722c, where variants 13/14 existed): 4-bit GEMV variants 13 / 14
# (half the rows by byte permutes): their GPU tests, the GEMV table against v11 and cuBLAS (PDL off, see
# graph_time_us), Llama-2-7B 4-bit decode under each variant.
# PART=b: the 2x8 GEMV's shorter main loop and the fused RoPE + KV append + attention (merge folded in): their
# GPU tests, the additive kernel table, the attention check (scripts/gpu_attn_fused.py), Llama-2-7B / Llama-3-8B /
# Llama-2-70B 2x8 decode, two layers of the 2x8 quantizer on the Llama-2-7B shape, then the other GPU tests.
# PART=c: the 2x8 quantizer on the whole Llama-2-7B shape (32 layers, file written and verified; ~16-19 min, so two
# calls in a row on a warm device: the second resumes from out/q7b; not run in session 5).
# PART=d: decode with the default attention (RoPE fused into the split kernel, merge kernel), the quantizer profile
# at 65536-vector blocks with the two-stage selection, the attention / engine / 2x8 GPU tests.
# PART=e: the 2x8 / engine GPU tests and 70B 2x8 decode after the Packed2x8 launch-helper refactor.
# Logs: $OUT/logs.tgz; tables printed last. Usage on the device: PART=a OUT=... bash scripts/sessions/gpu_session5.sh
OUT=${OUT:-out/gpu-session5}
PART=${PART:-a}
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/../gpu_common.sh"
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
elif [ "$PART" = b ]; then
  timeout "$(budget 120 440)" python3 -m pytest -q -p no:cacheprovider tests/test_additive_kernels.py tests/test_kernels_attention.py \
    tests/test_pdl.py > "$L/pytest_b.log" 2>&1; echo "2x8 + attention tests: $(tail -1 "$L/pytest_b.log") ($(since))"
  timeout "$(budget 60 380)" python3 -m trapetum.kernels.additive_gemv --backends cuda --json "$L/additive.json" \
    > "$L/additive.log" 2>&1; echo "additive bench rc=$? ($(since))"
  timeout "$(budget 60 360)" python3 scripts/gpu_attn_fused.py --out "$L/attn" > "$L/attn.log" 2>&1
  echo "attention check rc=$? ($(since))"
  timeout "$(budget 80 300)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats fp16,cb4 --bins 0,3968 \
    --out "$L/e2e7" > "$L/e2e7.log" 2>&1; echo "e2e 7b rc=$? ($(since))"
  TRAPETUM_ATTN=unfused timeout "$(budget 50 260)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats cb4 \
    --bins 0,3968 --out "$L/e2e7_unfused" > "$L/e2e7_unfused.log" 2>&1; echo "e2e 7b unfused rc=$? ($(since))"
  timeout "$(budget 50 210)" python3 -m trapetum.eval.bench_e2e --models llama2-70b --formats aqlm-2x8 --bins 0 \
    --out "$L/e2e70" > "$L/e2e70.log" 2>&1; echo "e2e 70b rc=$? ($(since))"
  TRAPETUM_ATTN=merge-kernel timeout "$(budget 50 180)" python3 -m trapetum.eval.bench_e2e --models llama2-70b \
    --formats aqlm-2x8 --bins 0 --out "$L/e2e70_mk" > "$L/e2e70_mk.log" 2>&1; echo "e2e 70b merge-kernel rc=$? ($(since))"
  timeout "$(budget 50 130)" python3 -m trapetum.eval.bench_e2e --models llama3-8b --formats cb4 --bins 0 \
    --out "$L/e2e8" > "$L/e2e8.log" 2>&1; echo "e2e 8b rc=$? ($(since))"
  timeout "$(budget 70 60)" python3 -m trapetum.eval.bench_quantize --shape llama2-7b --scheme aqlm-2x8 --device cuda \
    --layers 2 > "$L/quant2.log" 2>&1; echo "quantizer 2 layers rc=$? ($(since))"
  timeout "$(budget 300 0)" python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_kernels_gemv.py \
    tests/test_kernels_fused.py tests/test_dense_gemv.py tests/test_precise_prefill.py > "$L/pytest_rest.log" 2>&1
  echo "other GPU tests: $(tail -1 "$L/pytest_rest.log") ($(since))"
elif [ "$PART" = d ]; then  # the default attention is now fused RoPE + split, then the merge kernel
  timeout "$(budget 80 380)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats fp16,cb4 --bins 0,3968 \
    --out "$L/e2e7" > "$L/e2e7.log" 2>&1; echo "e2e 7b rc=$? ($(since))"
  timeout "$(budget 60 320)" python3 -m trapetum.eval.bench_e2e --models llama3-8b --formats fp16,cb4 --bins 0 \
    --out "$L/e2e8" > "$L/e2e8.log" 2>&1; echo "e2e 8b rc=$? ($(since))"
  timeout "$(budget 50 270)" python3 -m trapetum.eval.bench_e2e --models llama2-70b --formats aqlm-2x8,aqlm-1x16 --bins 0 \
    --out "$L/e2e70" > "$L/e2e70.log" 2>&1; echo "e2e 70b rc=$? ($(since))"
  timeout "$(budget 60 200)" python3 scripts/profile_quantizer.py --out "$L/qprof" --chunks 65536 > "$L/qprof.log" 2>&1
  echo "quantizer profile rc=$? ($(since))"
  timeout "$(budget 300 0)" python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_kernels_attention.py \
    tests/test_additive_kernels.py -k "attention or engine or packed or gate_up" > "$L/pytest_d.log" 2>&1
  echo "GPU tests: $(tail -1 "$L/pytest_d.log") ($(since))"
elif [ "$PART" = e ]; then  # final check after the Packed2x8 launch-helper refactor
  timeout "$(budget 150 60)" python3 -m pytest -q -p no:cacheprovider tests/test_additive_kernels.py tests/test_engine_gpu.py \
    -k "packed or gate_up or cuda or owns or pdl or unfused" > "$L/pytest_e.log" 2>&1
  echo "GPU tests: $(tail -1 "$L/pytest_e.log") ($(since))"
  timeout "$(budget 50 0)" python3 -m trapetum.eval.bench_e2e --models llama2-70b --formats aqlm-2x8 --bins 0 \
    --out "$L/e2e70" > "$L/e2e70.log" 2>&1; echo "e2e 70b rc=$? ($(since))"
elif [ "$PART" = c ]; then
  # resumable: the parts stay in out/q7b (ignored, so kept on a warm device between calls); run PART=c again
  # within the idle window to finish; the whole-model time is the sum of the runs (see bench_quantize --work)
  timeout "$(budget 560 0)" python3 -m trapetum.eval.bench_quantize --shape llama2-7b --scheme aqlm-2x8 --device cuda \
    --work out/q7b > "$L/quant.log" 2>&1; echo "quantizer rc=$? ($(since))"; cp "$L/quant.log" "$OUT/quant_$(date +%s).log"
fi
tar czf "$OUT/logs.tgz" -C "$L" .
echo "==== tables ($(since))"
grep -h "FAILED\|Error" "$L"/pytest*.log 2>/dev/null | head -20
grep "^|" "$L/additive.log" 2>/dev/null | head -20
tail -12 "$L/attn.log" 2>/dev/null
grep "\[bench\]\|^{" "$L"/quant*.log 2>/dev/null | tail -6
tail -8 "$L/qprof.log" 2>/dev/null
cat "$L/kernels/kernels.md" 2>/dev/null | grep "^|" | head -16
for d in "$L"/e2e*/; do echo "-- $d"; grep "^|" "$d/results.md" 2>/dev/null | head -30; done
