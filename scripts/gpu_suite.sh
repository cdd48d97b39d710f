#!/usr/bin/env bash
# The GPU machine's work in one device call (about 6-8 minutes): GPU-only tests, the end-to-end benchmark
# (kill switches on Llama-2-7B), the quantizer benchmark, the 2-bit kernel benchmark. Logs under $OUT;
# tables last. Usage on the device: bash scripts/gpu_suite.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if [ -z "${TRAPETUM_GEMV_V:-}" ] && [ -f "$OUT/best_variant" ]; then  # written by scripts/gpu_kernels.sh
  export TRAPETUM_GEMV_V=$(cat "$OUT/best_variant"); echo "GEMV variant $TRAPETUM_GEMV_V"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q tests/test_engine_gpu.py tests/test_kernels_dequant.py tests/test_additive_kernels.py \
  -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1; tail -3 "$OUT/pytest_gpu.log"
timeout 150 python3 -m trapetum.eval.bench_e2e --out "$OUT/e2e7b" --models llama2-7b --switches > "$OUT/e2e7b.log" 2>&1
timeout 60 python3 -m trapetum.eval.bench_e2e --out "$OUT/e2e8b" --models llama3-8b > "$OUT/e2e8b.log" 2>&1
timeout 150 python3 -m trapetum.eval.bench_quantize --shape llama2-7b > "$OUT/quantize7b.log" 2>&1; tail -1 "$OUT/quantize7b.log"
timeout 60 python3 -m trapetum.kernels.additive_gemv > "$OUT/additive.log" 2>&1; tail -12 "$OUT/additive.log"
echo "==== tables"
cat "$OUT/e2e7b/results.md" "$OUT/e2e8b/results.md" 2>/dev/null
