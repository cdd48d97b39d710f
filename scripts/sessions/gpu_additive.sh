#!/usr/bin/env bash
# AQLM (2-bit additive) kernels on the GPU, under 6 minutes: builds the CUDA extension (prints the
# seconds), runs tests/test_additive_kernels.py (GPU-specific tests first, the rest last), the kernel
# benchmark (CUDA and Triton vs cuBLAS fp16, with a TRAPETUM_AQLM_BPS sweep) and the Llama-2-70B-shape
# decode benchmark for aqlm-2x8 and aqlm-1x16. Every step has a timeout drawn from one deadline.
# Writes 6 files under $OUT (build.log, pytest.log, kernels.log, kernels.json, e2e.log, summary.md)
# and prints the summary table last.
# Usage on the device: OUT=out/gpu-additive bash scripts/sessions/gpu_additive.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-out/gpu-additive}
mkdir -p "$OUT"
TMP=$(mktemp -d)
t0=$(date +%s)
deadline=$(( t0 + 340 ))
# budget CAP RESERVE: seconds for the next step: at most CAP, leaving RESERVE for the steps after it
budget() {
  local left=$(( deadline - $(date +%s) - $2 )) c=$1
  (( left < c )) && c=$left
  (( c < 5 )) && c=5
  echo $c
}
since() { echo "$(( $(date +%s) - t0 )) s"; }

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout "$(budget 150 190)" python3 - > "$OUT/build.log" 2>&1 <<'PY'
import time
t = time.time()
from trapetum.kernels import additive_gemv as ag
ok = ag.cuda_available() and ag._load_ext() is not None
print(f"build {'ok' if ok else 'FAILED'} {time.time() - t:.1f} s {ag._EXT_ERR or ''}")
PY
rc=$?; echo "$(tail -c 400 "$OUT/build.log") (rc=$rc, at $(since))"

# the CUDA-specific tests first, the broad random-shape tests (mostly Triton) with the time left at the end
tests() {  # tests CAP RESERVE -k EXPR
  echo "== pytest -k '$4'" >> "$OUT/pytest.log"
  timeout "$(budget "$1" "$2")" python3 -m pytest -q -p no:cacheprovider --maxfail=30 -k "$4" \
    tests/test_additive_kernels.py >> "$OUT/pytest.log" 2>&1
  echo "tests -k '$4': $(tail -1 "$OUT/pytest.log") (at $(since))"
}
: > "$OUT/pytest.log"
tests 90 130 -k "gpu or host"

timeout "$(budget 75 70)" python3 -m trapetum.kernels.additive_gemv --bps 1 --json "$OUT/kernels.json" \
  > "$OUT/kernels.log" 2>&1
echo "kernel bench rc=$? (at $(since))"

: > "$OUT/e2e.log"
for fmt in aqlm-2x8 aqlm-1x16; do
  reserve=$([ "$fmt" = aqlm-2x8 ] && echo 35 || echo 0)
  timeout "$(budget 60 "$reserve")" python3 -m trapetum.eval.bench_e2e --models llama2-70b --formats "$fmt" --bins 0 \
    --out "$TMP/$fmt" >> "$OUT/e2e.log" 2>&1
  echo "e2e $fmt rc=$? (at $(since))"
done

tests 150 0 -k "not gpu and not host"

python3 - "$OUT" "$TMP" > "$OUT/summary.md" 2>&1 <<'PY'
import json, sys
from pathlib import Path
out, tmp = Path(sys.argv[1]), Path(sys.argv[2])
lines = ["## AQLM kernels (batch 1, graph replays, weights rotated past L2)", ""]
lines += [(out / "build.log").read_text().strip().splitlines()[-1] if (out / "build.log").exists() else "build: no log"]
log = (out / "pytest.log").read_text().splitlines() if (out / "pytest.log").exists() else []
ends = [l for l in log if (" passed" in l or " failed" in l or " error" in l) and " in " in l]
lines += [f"tests: {' / '.join(ends) or 'no summary line (timeout?)'}", ""]
try:
    rows = json.loads((out / "kernels.json").read_text())
    cols = []
    for r in rows:
        c = (r["layout"], r["backend"])
        if c not in cols:
            cols.append(c)
    lines += ["| in x out | cuBLAS us | " + " | ".join(f"{l} {b}" for l, b in cols) + " |",
              "|---|---|" + "---|" * len(cols)]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        by = {(r["layout"], r["backend"]): r for r in rows if r["shape"] == shape}
        cub = next(iter(by.values()))["cublas_us"]
        cells = [f"{by[c]['us']:.1f} ({by[c]['vs_cublas']:.2f}x, {by[c]['GBps']:.0f} GB/s)" if c in by else "-"
                 for c in cols]
        lines.append(f"| {shape} | {cub:.1f} | " + " | ".join(cells) + " |")
except Exception as e:
    lines.append(f"kernel bench: no results ({type(e).__name__}: {e})")
lines += ["", "| Llama-2-70B shape | tok/s @0-128 | weights GB | peak mem GB |", "|---|---|---|---|"]
for fmt in ("aqlm-2x8", "aqlm-1x16"):
    try:
        r = json.loads((tmp / fmt / "results.json").read_text())["models"]["llama2-70b"][fmt]
        gb = [r[k] / 1e9 for k in ("weight_bytes", "peak_mem_bytes")]
        lines.append(f"| {fmt} | {r['decode']['0']:.1f} | {gb[0]:.2f} | {gb[1]:.2f} |")
    except Exception as e:
        lines.append(f"| {fmt} | no result ({type(e).__name__}) | | |")
print("\n".join(lines))
PY
rm -rf "$TMP"
echo "==== summary (total $(since))"
cat "$OUT/summary.md"
