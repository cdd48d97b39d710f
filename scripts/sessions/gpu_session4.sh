#!/usr/bin/env bash
# Session 4 device runs. PART=a: build, the 2x8 correctness tests, the additive kernel table, Llama-2-70B
# 2x8 / 1x16 decode (PDL on and off), then every GPU test file with the time left.
# PART=b: the 4-bit GEMV table (v11, cuBLAS; kernel tables run with PDL off, see graph_time_us), Llama-2-7B
# decode with every kill switch (TRAPETUM_PDL=0 among them) and Llama-3-8B. PART=c: the PDL diagnostic
# (scripts/sessions/pdl_diag.py), Llama-2-7B / 70B 2x8 / Llama-3-8B decode, then every GPU test file. PART=d: the
# diagnostic, the PDL / determinism tests and the same decode runs (final check). PART=e: the engine-keeps-
# no-decoder test and the serving peaks of Llama-2-70B 2x8 and Llama-2-7B 4-bit.
# Logs: $OUT/logs.tgz; tables printed last. Usage on the device: PART=a OUT=... bash scripts/sessions/gpu_session4.sh
OUT=${OUT:-out/gpu-session4}
PART=${PART:-a}
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/../gpu_common.sh"
if [ "$PART" = a ]; then
  timeout "$(budget 90 400)" python3 -m pytest -q -p no:cacheprovider tests/test_additive_kernels.py \
    -k "cuda or packed or bitwise or graph or mixed or kill_switch" > "$L/pytest_2x8.log" 2>&1
  echo "2x8 tests: $(tail -1 "$L/pytest_2x8.log") ($(since))"
  timeout "$(budget 60 330)" python3 -m trapetum.kernels.additive_gemv --backends cuda --json "$L/additive.json" \
    > "$L/additive.log" 2>&1; echo "additive bench rc=$? ($(since))"
  for f in aqlm-2x8 aqlm-1x16; do
    timeout "$(budget 60 220)" python3 -m trapetum.eval.bench_e2e --models llama2-70b --formats $f --bins 0 \
      --out "$L/e2e70_$f" > "$L/e2e70_$f.log" 2>&1; echo "e2e 70b $f rc=$? ($(since))"
  done
  TRAPETUM_PDL=0 timeout "$(budget 50 170)" python3 -m trapetum.eval.bench_e2e --models llama2-70b --formats aqlm-2x8 --bins 0 \
    --out "$L/e2e70_nopdl" > "$L/e2e70_nopdl.log" 2>&1; echo "e2e 70b 2x8 pdl=0 rc=$? ($(since))"
  timeout "$(budget 400 0)" python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_kernels_gemv.py \
    tests/test_kernels_fused.py tests/test_kernels_attention.py tests/test_dense_gemv.py tests/test_additive_kernels.py \
    tests/test_precise_prefill.py -k "not (cuda or packed or bitwise or mixed or kill_switch)" -x > "$L/pytest_rest.log" 2>&1
  echo "other GPU tests: $(tail -1 "$L/pytest_rest.log") ($(since))"
elif [ "$PART" = e ]; then  # the engine no longer keeps its decoder alive: test, then the serving peaks
  timeout "$(budget 60 60)" python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py \
    -k "no_reference or owns or pdl" > "$L/pytest_e.log" 2>&1; echo "tests: $(tail -1 "$L/pytest_e.log") ($(since))"
  timeout "$(budget 30 30)" python3 -m trapetum.eval.bench_e2e --models llama2-70b --formats aqlm-2x8 --bins 0 \
    --out "$L/e2e70" > "$L/e2e70.log" 2>&1; echo "e2e 70b rc=$? ($(since))"
  timeout "$(budget 30 0)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats cb4 --bins 0 \
    --out "$L/e2e7" > "$L/e2e7.log" 2>&1; echo "e2e 7b rc=$? ($(since))"
elif [ "$PART" = d ]; then  # final check: diagnostic, PDL and determinism tests, decode
  timeout "$(budget 60 300)" python3 scripts/sessions/pdl_diag.py > "$L/pdl_diag.log" 2>&1; echo "pdl diag rc=$? ($(since))"
  timeout "$(budget 90 200)" python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_kernels_gemv.py \
    tests/test_additive_kernels.py -k "pdl or bitwise or graph or replays or tiled or cuda_random" > "$L/pytest_d.log" 2>&1
  echo "tests: $(tail -1 "$L/pytest_d.log") ($(since))"
  timeout "$(budget 90 90)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats fp16,cb4 --bins 0,1024,3968 \
    --out "$L/e2e7" > "$L/e2e7.log" 2>&1; echo "e2e 7b rc=$? ($(since))"
  timeout "$(budget 40 45)" python3 -m trapetum.eval.bench_e2e --models llama2-70b --formats aqlm-2x8 --bins 0 \
    --out "$L/e2e70" > "$L/e2e70.log" 2>&1; echo "e2e 70b rc=$? ($(since))"
  timeout "$(budget 40 0)" python3 -m trapetum.eval.bench_e2e --models llama3-8b --formats fp16,cb4 --bins 0,3968 \
    --out "$L/e2e8" > "$L/e2e8.log" 2>&1; echo "e2e 8b rc=$? ($(since))"
elif [ "$PART" = c ]; then  # after the fix of the hoisted x loads: diagnostic, every GPU test, decode
  timeout "$(budget 60 420)" python3 scripts/sessions/pdl_diag.py > "$L/pdl_diag.log" 2>&1; echo "pdl diag rc=$? ($(since))"
  timeout "$(budget 90 330)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats fp16,cb4 --bins 0,1024,3968 \
    --out "$L/e2e7" > "$L/e2e7.log" 2>&1; echo "e2e 7b rc=$? ($(since))"
  timeout "$(budget 40 290)" python3 -m trapetum.eval.bench_e2e --models llama2-70b --formats aqlm-2x8 --bins 0 \
    --out "$L/e2e70" > "$L/e2e70.log" 2>&1; echo "e2e 70b rc=$? ($(since))"
  timeout "$(budget 40 250)" python3 -m trapetum.eval.bench_e2e --models llama3-8b --formats fp16,cb4 --bins 0,3968 \
    --out "$L/e2e8" > "$L/e2e8.log" 2>&1; echo "e2e 8b rc=$? ($(since))"
  timeout "$(budget 400 0)" python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_kernels_gemv.py \
    tests/test_kernels_fused.py tests/test_kernels_attention.py tests/test_dense_gemv.py tests/test_additive_kernels.py \
    tests/test_precise_prefill.py > "$L/pytest_all.log" 2>&1
  echo "all GPU tests: $(tail -1 "$L/pytest_all.log") ($(since))"
else
  timeout "$(budget 60 380)" python3 scripts/sessions/pdl_diag.py > "$L/pdl_diag.log" 2>&1; echo "pdl diag rc=$? ($(since))"
  timeout "$(budget 90 300)" python3 -m trapetum.eval.bench_kernels --only gemv --backends mma_v11 --out "$L/kernels" \
    > "$L/kernels.log" 2>&1; echo "gemv bench rc=$? ($(since))"
  timeout "$(budget 260 60)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --switches --out "$L/e2e7" \
    > "$L/e2e7.log" 2>&1; echo "e2e 7b rc=$? ($(since))"
  timeout "$(budget 80 0)" python3 -m trapetum.eval.bench_e2e --models llama3-8b --out "$L/e2e8" \
    > "$L/e2e8.log" 2>&1; echo "e2e 8b rc=$? ($(since))"
fi
tar czf "$OUT/logs.tgz" -C "$L" .
echo "==== tables ($(since))"
tail -6 "$L/pdl_diag.log" 2>/dev/null
grep -h "FAILED\|Error" "$L"/pytest*.log 2>/dev/null | head -20
grep "^|" "$L/additive.log" 2>/dev/null | head -20
cat "$L/kernels/kernels.md" 2>/dev/null | grep "^|" | head -16
for d in "$L"/e2e*/; do echo "-- $d"; grep "^|" "$d/results.md" 2>/dev/null | head -30; done
