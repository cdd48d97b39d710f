#!/usr/bin/env bash
# Session 15 (issue 19 item 3): the tensor-core sparse GEMV (sparse_kernel "mma") in one device call.
# Usage on the device: OUT=... bash scripts/sessions/gpu_sparse_mma.sh   (BUDGET_S, default 360 s; the e2e step
# gets what the earlier ones leave, E2E_KERNELS default "mma": e.g. "mma,compact" with a larger budget)
# (Until session 17 it also built and tested the first CUDA sparse kernel, "cuda", deleted since.)
# 1. builds the main and the "mma" sparse extensions in parallel; stops (rc 3) if one fails;
# 2. tests/test_sparse_mma.py, test_sparse_engine.py, test_sparse_gemv.py (TESTS overrides; GPU: 240 cases against float64, bits, splits, NaN codes, graph, engine verify);
#    3. (KERNEL_TABLE=0 skips it) bench_sparse kernel table (dense, tiled dense, masked, compact, mma) at S = 0, 0.25, 0.5 with
#    --mma-splits 6,16; 4. bench_sparse --e2e at 0.25 and 0.5 with the E2E_KERNELS (each with its own dense runs
#    before and after), as the budget allows.
# Logs: $OUT/logs.tgz and the three result files copied to $OUT; a one-line summary per step on stdout.
OUT=${OUT:-out/gpu-sparse-mma}
SKIP_BUILD=1
BUDGET_S=${BUDGET_S:-360}
source "$(dirname "$0")/../gpu_common.sh"
python3 -c "from trapetum.kernels import cuda_ext; assert cuda_ext.load() is not None, cuda_ext.error()" > "$L/build_main.log" 2>&1 &
python3 -c "from trapetum.kernels import sparse_mma as m; assert m.EXT.load() is not None, m.EXT.error()" > "$L/build_mma.log" 2>&1 &
rc=0
for j in $(jobs -p); do wait "$j" || rc=3; done
echo "builds rc=$rc ($(since))"
if [ $rc != 0 ]; then tail -c 2000 "$L"/build_*.log; tar czf "$OUT/logs.tgz" -C "$L" .; exit 3; fi
timeout "$(budget 150 130)" python3 -m pytest -q -rf -p no:cacheprovider ${TESTS:-tests/test_sparse_mma.py tests/test_sparse_engine.py tests/test_sparse_gemv.py} > "$L/pytest_mma.log" 2>&1
echo "mma tests rc=$?: $(tail -1 "$L/pytest_mma.log") ($(since))"
if [ "${KERNEL_TABLE:-1}" = 1 ]; then
  timeout "$(budget 80 70)" python3 -m trapetum.eval.bench_sparse --sparsity 0,0.25,0.5 --mma-splits 6,16 \
    > "$L/kernels.txt" 2>&1
  echo "kernel table rc=$? ($(since))"; cp "$L/kernels.txt" "$OUT/"
fi
timeout "$(budget 300 5)" python3 -m trapetum.eval.bench_sparse --e2e --sparsity 0.25,0.5 --sparse-kernel "${E2E_KERNELS:-mma}" \
  > "$L/e2e.txt" 2>&1
echo "e2e rc=$? ($(since))"; cp "$L/e2e.txt" "$OUT/"
cp "$L/pytest_mma.log" "$OUT/"
tar czf "$OUT/logs.tgz" -C "$L" .
