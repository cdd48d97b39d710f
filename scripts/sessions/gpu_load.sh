#!/usr/bin/env bash
# Session 10 (issue 20): batched serving on the H200, one device call (~6-7 min). Carry .whl and xfer (both
# ignored by git): .whl holds fastapi / starlette / pydantic / pydantic-core / annotated-types / typing-inspection /
# uvicorn / typing-extensions / opentelemetry-api (fastapi 0.165 imports it) / importlib-metadata for Python 3.12,
# xfer/smollm2-tokenizer/ the tokenizer the random model gets.
#   1. the wheels into /tmp/site;
#   2. in parallel: the CUDA extension build, and a Llama-2-7B-shape 4-bit .cbk of random weights with SmolLM2's
#      tokenizer (python -m trapetum.eval.random_cbk, generated on the GPU, timed);
#   3. the batched-serving GPU tests (tests/test_paged_attention.py, test_paged_engine.py, test_scheduler.py);
#   4. `trapetum serve F.cbk --device cuda --max-batch 64 --gpu-batch --kv-mem 32`, then `trapetum bench load --url`
#      at 1, 4, 16, 64 clients (128 tokens each, 8 requests per client), one call per level (a level cut by the
#      budget leaves the others' JSON);
#   5. if the budget allows, the same batched server with `--no-overlap` (session 14: the scheduler's sequential
#      steps, the host's work on a step's tokens not overlapped with the next step) at 1, 16 and 64 clients, so
#      that overlap on (BATCH passes --overlap, step 4) and off compare in one run;
#   6. the baseline, if the budget allows: `serve --max-batch 1` (one request at a time on the engine's decode
#      graph) at 1 and 16 clients, 16 requests each.
# LEVELS (default "1 4 16 64"): the client counts of step 4; EXTRA=0 skips steps 5 and 6.
# Full results under $OUT (JSON per level, logs); a table with the issue's bars printed last.
# Usage on the device: OUT=... bash scripts/sessions/gpu_load.sh
# (A CPU dry run of the same steps at a tiny shape: DEVICE=cpu TESTS=0 MAX_TOKENS=16 BATCH="--max-batch 4"
#  SET="--set hidden_size=128 --set intermediate_size=256 --set num_layers=2 --set num_heads=4 --set num_kv_heads=4
#  --set head_dim=32" OUT=/tmp/x bash scripts/sessions/gpu_load.sh)
OUT=${OUT:-out/gpu-load}
DEVICE=${DEVICE:-cuda}
TESTS=${TESTS:-1}
MAX_TOKENS=${MAX_TOKENS:-128}
BATCH=${BATCH:---max-batch 64 --gpu-batch --kv-mem 32 --overlap}
SET=${SET:-}
LEVELS=${LEVELS:-1 4 16 64}
EXTRA=${EXTRA:-1}
BUDGET_S=${BUDGET_S:-410}
SKIP_BUILD=1
source "$(dirname "$0")/../gpu_common.sh"
if ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then  # the device: from the carried wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$L/pip.log" 2>&1 || { echo "wheels: install failed: $(tail -c 400 "$L/pip.log")"; exit 1; }
  export PYTHONPATH=$PWD:/tmp/site
fi
python3 -c "import fastapi, uvicorn, pydantic; print('fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'pydantic', pydantic.__version__)" \
  || { echo "wheels: import failed"; exit 1; }
F=/tmp/random-llama2-7b-cb4.cbk
TOK=xfer/smollm2-tokenizer/tokenizer.json
[ "$DEVICE" = cuda ] && python3 -c "from trapetum.kernels import cuda_ext; assert cuda_ext.load() is not None, cuda_ext.error()" \
  > "$L/build.log" 2>&1 &
BUILD=$!
( s=$(date +%s); [ -s "$F" ] && { echo "wrote $F earlier (kept)"; exit 0; }; python3 -m trapetum.eval.random_cbk --shape llama2-7b --format cb4 --tokenizer "$TOK" --out "$F" \
    --device "$DEVICE" $SET; echo "rc=$? process wall $(( $(date +%s) - s )) s" ) > "$L/random_cbk.log" 2>&1 &
CBK=$!
wait $BUILD; rc=$?; [ "$DEVICE" = cuda ] && echo "cuda extension build rc=$rc ($(since)) $(tail -c 300 "$L/build.log")"
wait $CBK; echo "random cbk: $(grep -h "^wrote\|^rc=\|rror" "$L/random_cbk.log" | tr '\n' ' ') ($(since))"
if [ "$TESTS" = 1 ]; then
  timeout "$(budget 120 180)" python3 -m pytest -q -p no:cacheprovider tests/test_paged_attention.py \
    tests/test_paged_engine.py tests/test_scheduler.py > "$L/pytest.log" 2>&1
  echo "GPU tests rc=$?: $(tail -1 "$L/pytest.log") ($(since))"
fi

serve() {  # serve NAME ARGS...: start `trapetum serve $F ARGS` on port 8765, wait for /health (at most $2 s)
  local name=$1 wait_s=$2; shift 2
  python3 -m trapetum.cli serve "$F" --device "$DEVICE" --port 8765 --queue 256 --no-access-log "$@" > "$L/serve_$name.log" 2>&1 &
  SPID=$!
  python3 - "$wait_s" <<'EOF' || { echo "server $name not ready: $(tail -c 600 "$L/serve_$name.log")"; return 1; }
import sys, time, httpx
t0 = time.time()
while time.time() - t0 < float(sys.argv[1]):
    try:
        if httpx.get("http://127.0.0.1:8765/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.TransportError:
        pass
    time.sleep(0.5)
sys.exit(1)
EOF
  echo "server $name ready ($(since))"
}
stop_serve() { kill -INT "$SPID" 2>/dev/null; timeout 20 tail --pid="$SPID" -f /dev/null || kill -9 "$SPID"; }
level() {  # level NAME CLIENTS CAP RESERVE ARGS...
  local name=$1 n=$2 cap=$3 reserve=$4; shift 4
  timeout "$(budget "$cap" "$reserve")" python3 -m trapetum.cli bench load --url http://127.0.0.1:8765 --clients "$n" \
    --max-tokens "$MAX_TOKENS" "$@" --json "$OUT/${name}_$n.json" > "$L/${name}_$n.log" 2>&1
  echo "$name $n clients rc=$? ($(since))"
}
if serve batched 120 $BATCH; then
  for n in $LEVELS; do
    case $n in 1) level batched 1 45 110 --per-client 8 ;; 4) level batched 4 40 95 --per-client 8 ;;
      16) level batched 16 50 75 --per-client 8 ;; *) level batched "$n" 100 10 --per-client 8 ;; esac
  done
  python3 -c "import httpx; print(httpx.get('http://127.0.0.1:8765/health', timeout=5).text)" > "$OUT/health_batched.json" 2>&1
fi
stop_serve
if [ "$EXTRA" = 1 ] && (( deadline - $(date +%s) > 110 )) && serve sequential 120 $BATCH --no-overlap; then
  level sequential 1 30 70 --per-client 8
  level sequential 16 30 45 --per-client 8
  level sequential 64 60 10 --per-client 8
fi
stop_serve
if [ "$EXTRA" = 1 ] && (( deadline - $(date +%s) > 75 )) && serve single 50 --max-batch 1; then
  level single 1 30 15 --requests 16
  level single 16 30 5 --requests 16
fi
stop_serve
cp "$L"/serve_*.log "$L/pytest.log" "$L/random_cbk.log" "$OUT/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$L" .
echo "==== tables ($(since))"
grep -h "FAILED\|Error\|error" "$L/pytest.log" 2>/dev/null | head -12
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("*_*.json")):
    name, n = f.stem.rsplit("_", 1)
    if n.isdigit():
        rows.setdefault(name, {})[int(n)] = json.loads(f.read_text())["levels"][0]
print("| server | clients | req (err) | tok/s | x 1 client | TTFT p50 / p99 s | ITL p50 / p90 / p99 ms | ITL p50 x 1 | peak running |")
print("|---|---|---|---|---|---|---|---|---|")
f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"
for name, levels in rows.items():
    base = levels.get(1)
    for n, r in sorted(levels.items()):
        x = r["throughput_tok_s"] / base["throughput_tok_s"] if base and base["throughput_tok_s"] else None
        i = r["itl_ms"]
        xi = i["p50"] / base["itl_ms"]["p50"] if base and base["itl_ms"]["p50"] and i["p50"] else None
        print(f"| {name} | {n} | {r['requests']} ({r['errors']}) | {f(r['throughput_tok_s'], 1)} | {f(x)} | "
              f"{f(r['ttft_s']['p50'])} / {f(r['ttft_s']['p99'])} | {f(i['p50'], 1)} / {f(i['p90'], 1)} / {f(i['p99'], 1)} "
              f"| {f(xi)} | {r['peak_running']} |")
b, q = rows.get("batched", {}), rows.get("sequential", {})
for n in sorted(set(b) & set(q)):
    if q[n]["throughput_tok_s"]:
        print(f"overlap: {n} clients {b[n]['throughput_tok_s'] / q[n]['throughput_tok_s']:.2f}x the --no-overlap "
              f"throughput, p50 ITL {f(b[n]['itl_ms']['p50'], 1)} vs {f(q[n]['itl_ms']['p50'], 1)} ms")
if 1 in b:
    t1, l1 = b[1]["throughput_tok_s"], b[1]["itl_ms"]["p50"]
    for n, bar in ((16, 6), (64, 15)):
        if n in b:
            x = b[n]["throughput_tok_s"] / t1
            print(f"bar: {n} clients {x:.2f}x the 1-client throughput (>= {bar}x: {'met' if x >= bar else 'MISSED'})")
    if 16 in b and b[16]["itl_ms"]["p50"] and l1:
        x = b[16]["itl_ms"]["p50"] / l1
        print(f"bar: p50 ITL at 16 clients {x:.2f}x the 1-client one (< 2x: {'met' if x < 2 else 'MISSED'})")
EOF
