#!/usr/bin/env bash
# The GPU machine's work in one device call. PARTS (default "tests kernels e2e quantize additive")
# picks: GPU-only tests; the kernel benchmark (GEMV, attention, fused kernels); the end-to-end
# benchmark (Llama-2-7B with kill switches, Llama-3-8B); the quantizer benchmark; the 2-bit kernel
# benchmark. Uses $OUT/best_variant from scripts/sessions/gpu_kernels.sh if present. Full logs go into
# $OUT/suite.tgz (the device returns few files); tables are printed last.
# Usage on the device: PARTS="tests e2e" bash scripts/gpu_suite.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-out/gpu}
PARTS=${PARTS:-tests kernels e2e quantize additive}
L=$(mktemp -d)
mkdir -p "$OUT"
if [ -z "${TRAPETUM_GEMV_V:-}" ] && [ -f "$OUT/best_variant" ]; then
  export TRAPETUM_GEMV_V=$(cat "$OUT/best_variant"); echo "GEMV variant $TRAPETUM_GEMV_V"
fi
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$L/gpu.txt"
if has tests; then
  timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_kernels_dequant.py tests/test_kernels_gemv.py \
    tests/test_additive_kernels.py tests/test_dense_gemv.py tests/test_kernels_attention.py tests/test_kernels_fused.py \
    > "$L/pytest_gpu.log" 2>&1; tail -3 "$L/pytest_gpu.log"; echo "tests $(( $(date +%s) - t0 )) s"
fi
if has kernels; then
  timeout 150 python3 -m trapetum.eval.bench_kernels --backends mma,mma_v7,mma_v11 --out "$L/kernels" > "$L/kernels.log" 2>&1
  echo "kernels $(( $(date +%s) - t0 )) s"
fi
if has e2e; then
  timeout 150 python3 -m trapetum.eval.bench_e2e --out "$L/e2e7b" --models llama2-7b --switches > "$L/e2e7b.log" 2>&1
  timeout 60 python3 -m trapetum.eval.bench_e2e --out "$L/e2e8b" --models llama3-8b > "$L/e2e8b.log" 2>&1
  echo "e2e $(( $(date +%s) - t0 )) s"
fi
if has quantize; then
  timeout 150 python3 -m trapetum.eval.bench_quantize --shape llama2-7b > "$L/quantize7b.log" 2>&1; tail -1 "$L/quantize7b.log"
  timeout 300 python3 -m trapetum.eval.bench_quantize --shape llama2-7b --scheme aqlm-2x8 --layers 2 >> "$L/quantize7b.log" 2>&1; tail -1 "$L/quantize7b.log"
fi
if has additive; then
  timeout 60 python3 -m trapetum.kernels.additive_gemv > "$L/additive.log" 2>&1; tail -12 "$L/additive.log"
fi
tar czf "$OUT/suite.tgz" -C "$L" .
echo "==== tables"
cat "$L/kernels/kernels.md" "$L/e2e7b/results.md" "$L/e2e8b/results.md" 2>/dev/null
