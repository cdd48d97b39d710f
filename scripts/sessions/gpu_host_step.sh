#!/usr/bin/env bash
# Session 10, second part (issue 20): where a batched step's time goes, host against device, one device call
# (~3-5 min). No wheels needed (the worker and SSE parts use no fastapi); carry xfer/smollm2-tokenizer.
#   1. the random Llama-2-7B-shape 4-bit .cbk of gpu_load.sh (kept in /tmp when that ran on this machine);
#   2. python3 scripts/bench_host_step.py: the scheduler over an instant runner (host ms per step at S rows,
#      full vocab and --vocab 512), the worker with and without the server's per-token SSE work, and the paged GPU
#      runner alone on the .cbk (decode wall / device ms per S, one 38-token prefill; overlapped_ms: sequential
#      vs overlapped steps with 0, 2 and 6 ms of host work a step, session 14);
#   3. the same runner part under --prefill-budget's question: how long one prefill forward takes (printed).
# Usage on the device: OUT=... bash scripts/sessions/gpu_host_step.sh
OUT=${OUT:-out/gpu-host-step}
BUDGET_S=${BUDGET_S:-540}
SKIP_BUILD=1
source "$(dirname "$0")/../gpu_common.sh"
F=/tmp/random-llama2-7b-cb4.cbk
TOK=xfer/smollm2-tokenizer/tokenizer.json
python3 -c "from trapetum.kernels import cuda_ext; assert cuda_ext.load() is not None, cuda_ext.error()" \
  > "$L/build.log" 2>&1 &
BUILD=$!
( s=$(date +%s); [ -s "$F" ] && { echo "wrote $F earlier (kept)"; exit 0; }; python3 -m trapetum.eval.random_cbk \
    --shape llama2-7b --format cb4 --tokenizer "$TOK" --out "$F" --device cuda; echo "rc=$? $(( $(date +%s) - s )) s" ) \
  > "$L/random_cbk.log" 2>&1
wait $BUILD; echo "cuda extension build rc=$? ($(since)); random cbk: $(tail -1 "$L/random_cbk.log")"
timeout "$(budget 120 300)" python3 scripts/bench_host_step.py --tokenizer "$TOK" --worker --sse \
  > "$OUT/host_full_vocab.txt" 2>&1; echo "host, full vocab rc=$? ($(since))"; cat "$OUT/host_full_vocab.txt"
timeout "$(budget 60 240)" python3 scripts/bench_host_step.py --tokenizer "$TOK" --vocab 512 \
  > "$OUT/host_vocab512.txt" 2>&1; echo "host, vocab 512 rc=$? ($(since))"; cat "$OUT/host_vocab512.txt"
timeout "$(budget 240 10)" python3 scripts/bench_host_step.py --tokenizer "$TOK" --sizes 1,4,16,64 --steps 50 \
  --repeat 1 --vocab 512 --cbk "$F" --device cuda --host-ms 0,2,6 > "$OUT/runner.txt" 2>&1; echo "runner rc=$? ($(since))"
cat "$OUT/runner.txt"
tar czf "$OUT/logs.tgz" -C "$L" .
