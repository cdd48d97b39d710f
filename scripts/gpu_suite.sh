#!/usr/bin/env bash
# One device call: end-to-end benchmark (both model shapes, kill switches on the first) and the
# GPU-only engine tests. Full logs under $OUT; the tables print last.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 300 python3 -m trapetum.eval.bench_e2e --out "$OUT/e2e7b" --models llama2-7b --switches 2>&1 | tee "$OUT/e2e7b.log" | tail -3
timeout 120 python3 -m trapetum.eval.bench_e2e --out "$OUT/e2e8b" --models llama3-8b 2>&1 | tee "$OUT/e2e8b.log" | tail -3
timeout 150 python3 -m pytest -q -x tests/test_engine_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
echo "==== tables"
cat "$OUT/e2e7b/results.md" "$OUT/e2e8b/results.md" 2>/dev/null
