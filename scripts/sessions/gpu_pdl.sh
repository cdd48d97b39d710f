#!/usr/bin/env bash
# Session 4, one device call: programmatic dependent launch (cuda/pdl.cuh, kernels/pdl.py). Builds both
# extensions, runs the PDL on/off bitwise tests and the graph/ownership tests, then Llama-2-7B decode
# (fp16 and 4-bit) and Llama-2-70B 2x8 with TRAPETUM_PDL=1 and =0 in the same call.
# Logs: $OUT/logs.tgz; tables printed last. Usage on the device: OUT=... bash scripts/sessions/gpu_pdl.sh
OUT=${OUT:-out/gpu-pdl}
source "$(dirname "$0")/../gpu_common.sh"
python3 -c "import triton; from trapetum.kernels import pdl; import torch; print('triton', triton.__version__, 'pdl', pdl.enabled(torch.device('cuda')))" | tee "$L/pdl.txt"
timeout "$(budget 150 330)" python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_additive_kernels.py \
  tests/test_kernels_gemv.py tests/test_kernels_fused.py tests/test_dense_gemv.py tests/test_kernels_attention.py \
  -k "pdl or owns or kill_switch or replays or graph or bitwise or tiled or fused or dense or gate_up or attention" > "$L/pytest.log" 2>&1
echo "tests: $(tail -1 "$L/pytest.log") ($(since))"
timeout "$(budget 120 300)" python3 scripts/attn_sweep.py --out "$L/attn" > "$L/attn.log" 2>&1; echo "attn sweep rc=$? ($(since))"
for pdl in 1 0; do
  TRAPETUM_PDL=$pdl timeout "$(budget 100 120)" python3 -m trapetum.eval.bench_e2e --models llama2-7b --formats fp16,cb4 \
    --bins 0,3968 --out "$L/e2e7_pdl$pdl" > "$L/e2e7_pdl$pdl.log" 2>&1; echo "e2e 7b pdl=$pdl rc=$? ($(since))"
done
for pdl in 1 0; do
  TRAPETUM_PDL=$pdl timeout "$(budget 60 10)" python3 -m trapetum.eval.bench_e2e --models llama2-70b --formats aqlm-2x8 \
    --bins 0 --out "$L/e2e70_pdl$pdl" > "$L/e2e70_pdl$pdl.log" 2>&1; echo "e2e 70b pdl=$pdl rc=$? ($(since))"
done
tar czf "$OUT/logs.tgz" -C "$L" .
echo "==== tables ($(since))"
grep -h "FAILED\|Error" "$L"/pytest*.log | head -20
tail -25 "$L/attn.log"
for d in e2e7_pdl1 e2e7_pdl0 e2e70_pdl1 e2e70_pdl0; do echo "-- $d"; grep "^|" "$L/$d/results.md" 2>/dev/null | tail -n +3 | head -6; tail -3 "$L/$d.log" | grep -i error; done
