#!/usr/bin/env bash
# Session 19 (issue 20): the wgmma many-row GEMV (kernels/codebook_gemm_wgmma.py) in one device call: bits and times
# against the grouped mma kernel (scripts/dev/wgmma_gemm_check.py), its GPU tests and the paged engine's; if all
# pass, the load benchmark of scripts/sessions/gpu_load.sh (batched server, 1/4/16/64 clients) with it as default.
# Usage on the device: OUT=DIR bash scripts/sessions/gpu_s19_wgmma.sh   (carry .whl, xfer: as gpu_load.sh)
OUT=${OUT:-out/s19b}
SKIP_BUILD=1
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../gpu_common.sh"
python3 -m pip install -q --no-index --no-deps .whl/gguf-*.whl > "$L/pip.log" 2>&1
python3 -c "from trapetum.kernels import cuda_ext; assert cuda_ext.load() is not None, cuda_ext.error()" > "$L/build_main.log" 2>&1 &
python3 -c "from trapetum.kernels import codebook_gemm_wgmma as m; assert m.EXT.load() is not None, m.EXT.error()" > "$L/build_wg.log" 2>&1 &
rc=0
for j in $(jobs -p); do wait "$j" || rc=3; done
echo "builds rc=$rc ($(since))"
[ $rc = 0 ] || { tail -c 3000 "$L"/build_*.log; tar czf "$OUT/logs.tgz" -C "$L" .; exit 3; }
timeout "$(budget 150 230)" python3 scripts/dev/wgmma_gemm_check.py --out "$L/wg" > "$L/wg.log" 2>&1
echo "wgmma gemm check rc=$? ($(since))"; cp "$L/wg.log" "$OUT/"
grep -v "^{" "$L/wg.log" | tail -24
if grep -q "bits: all equal" "$L/wg.log"; then
  timeout "$(budget 80 180)" python3 -m pytest -q -x -rf -p no:cacheprovider tests/test_kernels_gemv_wgmma.py \
    tests/test_paged_engine.py > "$L/pytest.log" 2>&1
  prc=$?
  echo "GPU tests rc=$prc: $(tail -1 "$L/pytest.log") ($(since))"; grep -E "^FAILED|Error" "$L/pytest.log" | head -10
  cp "$L/pytest.log" "$OUT/"
  if [ $prc = 0 ]; then
    left=$(( deadline - $(date +%s) - 5 ))
    OUT=$OUT/load BUDGET_S=$left TESTS=0 bash scripts/sessions/gpu_load.sh 2>&1 | tail -20
  fi
fi
tar czf "$OUT/logs.tgz" -C "$L" .
