#!/usr/bin/env bash
# Session 15, issue 23 on the H200: the fair-source table (30 and all windows) for one model, in stages, one call
# each (QUALITY.md "Session 15"). Carry: this script, xfer/wiki.test.raw, xfer/valid.txt (WikiText-2 valid, the
# calibration of both sides), .whl/gguf-*.whl, xfer/llb.tgz (llama.cpp b11312's llama-quantize / llama-imatrix /
# llama-perplexity built on the dev VM: `cmake ... -DBUILD_SHARED_LIBS=OFF -DGGML_OPENMP=OFF` with
# scripts/build_llamacpp_tools.sh's other flags, then `tar czf xfer/llb.tgz -C DIR bin`), and the source GGUF as
# 56 MiB pieces xfer/{s,q,g}.NN (`split -b 56M -d -a 2 SRC xfer/s.`) over as many calls as it takes (the device
# tree is 64 MiB a call; pieces wait in the warm machine's /tmp/m).
#   MODEL=smol|qwen|gemma STAGES="a b" T=seconds [SOURCE=fair|raw] [PLAIN=1] [AQLM=1] bash scripts/sessions/gpu_quality_fair.sh
#   SOURCE (default fair): raw scores the GGUF as shipped (issue 23 item 2) into the same results file
#   a: reference, llama.cpp Q4_K_M and IQ2_XS with an importance matrix; PLAIN=1 adds ours cb4 and cb4e4 (GPTQ: CUDA
#      default; session 16 left them out on Qwen and Gemma for device time)
#   b: ours at llama.cpp's file sizes (--target-size of the Q4_K_M-imat and IQ2_XS-imat files); AQLM=1 adds AQLM 2x8
#   OURS_A="NAME=FLAGS;NAME=FLAGS" (session 22): stage a's rows of ours instead of PLAIN's; BQ=DIR: the results folder
#      (default /tmp/bq/MODEL; two jobs of one model at once need two)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
t0=$(date +%s); since() { echo "$(( $(date +%s) - t0 )) s"; }
mkdir -p /tmp/m /tmp/bq
bq=${BQ:-/tmp/bq/$MODEL}
python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/gguf-*.whl
for f in xfer/[qsg].[0-9][0-9]; do [ -f "$f" ] && mv "$f" /tmp/m/; done
[ -x /tmp/llb/bin/llama-quantize ] || { mkdir -p /tmp/llb && tar xzf xfer/llb.tgz -C /tmp/llb; }
declare -A NAME=([smol]=SmolLM2-135M-Instruct [qwen]=Qwen25-Coder-05B-Instruct [gemma]=Gemma-3-270M)
declare -A P=([smol]=s [qwen]=q [gemma]=g)
declare -A SUM=([smol]=b179c952 [qwen]=1d961463 [gemma]=a5fd3b62)
p=${P[$MODEL]}; n=${NAME[$MODEL]}; src=/tmp/m/$p.gguf
if [ ! -s $src ]; then cat /tmp/m/$p.[0-9][0-9] > $src; fi
# a fresh machine resumes from an earlier call's results (carry xfer/bq.$MODEL.json, e.g. OUT/$MODEL.results.json)
[ -s $bq/results.json ] || { [ -s xfer/bq.$MODEL.json ] && mkdir -p $bq && cp xfer/bq.$MODEL.json $bq/results.json; }
sha256sum $src | grep -q "^${SUM[$MODEL]}" || { echo "$src: checksum mismatch: $(sha256sum $src)"; rm -f $src; exit 1; }
C=(--model "$n=$src" --sources ${SOURCE:-fair} --text xfer/wiki.test.raw --calib xfer/valid.txt --windows 30 --all-windows
   --device cuda --threads 16 --cross-check "" --llama-bin /tmp/llb/bin --out $bq --reuse)
for st in ${STAGES:-a b}; do
  left=$(( ${T:-560} - ($(date +%s) - t0) )); (( left < 20 )) && { echo "stage $st: no time left"; break; }
  if [ $st = a ]; then
    ours=(--ours "")  # without it bench_quality.py would run its default rows (cb4, cb4e4, aqlm2x8)
    [ -n "${PLAIN:-}" ] && ours=(--ours "cb4=--bits 4 --calib {calib}" --ours "cb4e4=--bits 4 --embed-bits 4 --calib {calib}")
    if [ -n "${OURS_A:-}" ]; then ours=(); IFS=';' read -ra rows <<< "$OURS_A"; for r in "${rows[@]}"; do ours+=(--ours "$r"); done; fi
    timeout $left python3 scripts/bench_quality.py "${C[@]}" --llama Q4_K_M,IQ2_XS --imatrix on "${ours[@]}" \
      > $bq.a.log 2>&1
    echo "stage a rc=$? ($(since))"
  else
    read q4 iq2 < <(python3 -c "
import json; r = json.load(open('$bq/results.json'))
g = lambda k: r['$n/${SOURCE:-fair}/' + k]['file_bytes'] / 1e6
print(f'{g(\"Q4_K_M-imat\") - 0.05:.2f} {g(\"IQ2_XS-imat\") - 0.05:.2f}')")
    echo "target sizes: $q4 MB (Q4_K_M-imat), $iq2 MB (IQ2_XS-imat)"
    timeout $left python3 scripts/bench_quality.py "${C[@]}" --llama "" \
      --ours "ts_q4km=--embed-bits 4 --target-size $q4 --calib {calib}" \
      --ours "ts_iq2xs=--embed-bits 4 --target-size $iq2 --calib {calib}" ${AQLM:+--ours "aqlm2x8=--scheme aqlm-2x8 --embed-bits 4 --calib {calib}"} > $bq.b.log 2>&1
    echo "stage b rc=$? ($(since))"
  fi
done
o=$(basename $bq); cp $bq/results.json $OUT/$o.results.json 2>/dev/null; cp $bq.*.log $OUT/ 2>/dev/null
tar czf $OUT/$o.logs.tgz -C $bq --exclude='*.gguf' --exclude='*.cbk' --exclude='*.dat' . 2>/dev/null
grep -h "PPL\|error\|Error" $bq.*.log | tail -14
python3 - <<PY
import json
r = json.load(open('$bq/results.json'))
for k, v in r.items():
    if 'ppl' in v:
        print(f"{k:60s} {v['file_bytes']/1e6:7.1f} MB {v['proj_bpw']:.3f} bpw  30w {v['ppl']:.3f}  all {v.get('ppl_all', float('nan')):.3f}  agree {v.get('agree', '-')}  q {v.get('quantize_s', 0):.0f}s m {v.get('measure_s', 0):.0f}s")
    else:
        print(k, v.get('error'))
PY
