#!/usr/bin/env bash
# The GPU machine's work, in parts that fit one device call each. PARTS picks (default "build tests verify"):
#   build    compile both CUDA extensions (parallel) and report their errors
#   quick    a pytest selection ($QUICK_TESTS) with short tracebacks, before the rest
#   tests    the GPU test files (kernels, engine, precise prefill, PDL); $TEST_FILES overrides the list
#   verify   python -m trapetum.eval.verify_exact: the verify contract, bitwise, 4 models x 3 option sets
#   e2e      bench_e2e: Llama-2-7B fp16 + 4-bit (decode bins, verify cost, load memory), Llama-3-8B 4-bit
#   switches bench_e2e --switches on Llama-2-7B (each option off)
#   kernels  bench_kernels --rows 1,2,4,8,16 (the multi-row 4-bit, 8-bit and fp16 GEMVs against one row)
#   additive bench_additive --rows (2-bit GEMVs) and bench_e2e on Llama-2-70B 2x8 with verify
# Full logs go into $OUT/suite.tgz (the device returns few files); tables are printed last.
# Usage on the device: OUT=DIR PARTS="build tests" bash scripts/gpu_suite.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-out/gpu}
PARTS=${PARTS:-build tests verify}
L=$(mktemp -d)
mkdir -p "$OUT"
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
t0=$(date +%s)
since() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$L/gpu.txt"
if has build; then
  python3 -c "from trapetum.kernels import cuda_ext; assert cuda_ext.load() is not None, cuda_ext.error()" > "$L/build_main.log" 2>&1 &
  python3 -c "from trapetum.kernels import additive_gemv as ag; assert ag.EXT.load() is not None, ag.EXT.error()" > "$L/build_aqlm.log" 2>&1 &
  wait
  echo "build ($(since)): $(tail -c 400 "$L/build_main.log") | $(tail -c 400 "$L/build_aqlm.log")"
fi
if has quick; then  # QUICK_TESTS: pytest selection (files and -k) run first with short tracebacks
  timeout ${QUICK_S:-120} python3 -m pytest -q -x --tb=short -p no:cacheprovider ${QUICK_TESTS} > "$L/pytest_quick.log" 2>&1
  tail -40 "$L/pytest_quick.log"; echo "quick ($(since))"
fi
if has tests; then
  FILES=${TEST_FILES:-tests/test_kernels_gemv.py tests/test_dense_gemv.py tests/test_kernels_dequant.py tests/test_kernels_attention.py \
    tests/test_kernels_attention_rows_gpu.py tests/test_kernels_fused.py tests/test_additive_kernels.py tests/test_engine_gpu.py \
    tests/test_precise_prefill.py tests/test_pdl.py}
  timeout ${TESTS_S:-330} python3 -m pytest -v -rf --tb=short ${PYTEST_X:--x} -p no:cacheprovider -m "not slow" -k "${KEXPR:-not nothing}" $FILES \
    > "$L/pytest_gpu.log" 2>&1; grep -E "FAILED|ERROR|passed|failed" "$L/pytest_gpu.log" | tail -40; echo "tests ($(since))"
fi
if has verify; then
  timeout ${VERIFY_S:-240} python3 -m trapetum.eval.verify_exact > "$L/verify.log" 2>&1; echo "verify ($(since))"
fi
if has e2e; then
  timeout 300 python3 -m trapetum.eval.bench_e2e --out "$L/e2e7b" --models llama2-7b --formats fp16,cb4 --bins 0,3968 \
    --verify 1,2,4,8,16 --verify-bases 64,1088 > "$L/e2e7b.log" 2>&1
  timeout 200 python3 -m trapetum.eval.bench_e2e --out "$L/e2e8b" --models llama3-8b --formats cb4 --bins 0 \
    --verify 1,2,4,8,16 --verify-bases 64,1088 > "$L/e2e8b.log" 2>&1
  echo "e2e ($(since))"
fi
if has switches; then
  timeout 300 python3 -m trapetum.eval.bench_e2e --out "$L/e2e7b_sw" --models llama2-7b --formats cb4 --bins 0 \
    --switches > "$L/e2e7b_sw.log" 2>&1; echo "switches ($(since))"
fi
if has kernels; then
  timeout ${KERNELS_S:-240} python3 -m trapetum.eval.bench_kernels --only rows --rows 1,2,4,8,16 --out "$L/kernels" > "$L/kernels.log" 2>&1
  echo "kernels ($(since))"
fi
if has additive; then
  [ "${SKIP_ADDITIVE_BENCH:-0}" = 1 ] || timeout 120 python3 -m trapetum.eval.bench_additive --backends cuda --rows 1,2,4,8,16 > "$L/additive.log" 2>&1
  timeout 240 python3 -m trapetum.eval.bench_e2e --out "$L/e2e70b" --models llama2-70b --formats aqlm-2x8 --bins 0 \
    --verify 1,8 --verify-bases 64 > "$L/e2e70b.log" 2>&1
  echo "additive ($(since))"
fi
tar czf "$OUT/suite.tgz" -C "$L" .
echo "==== tables"
for f in verify.log e2e7b/results.md e2e8b/results.md e2e7b_sw/results.md kernels/kernels.md e2e70b/results.md; do
  [ -f "$L/$f" ] && { echo "-- $f"; tail -40 "$L/$f"; }
done
[ -f "$L/additive.log" ] && { echo "-- additive"; tail -30 "$L/additive.log"; }
exit 0
