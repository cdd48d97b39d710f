#!/bin/bash
# Session 14: alternated before/after bench_cpu runs of the host GEMV (step path), nice 10, no llama.cpp on this
# machine. `BASE=DIR BRANCH=DIR OUT=DIR bash cpu_s14_bench.sh A B`: round A runs base then branch, round B branch
# then base, each on SmolLM2 then Qwen (the 4-bit .cbk files of /tmp/h1).
one() {  # tree model tag
  echo "== $3 start $(date -u +%H:%M:%S) $(cat /proc/loadavg)"
  cd $1 && PYTHONPATH=$1 nice -n 10 python3 -m trapetum.eval.bench_cpu $2 --rounds ${ROUNDS:-3} --tokens 64 --paths step \
    --out ${OUT:-/tmp/h1/bench}/$3 2>&1 | grep -v Warn | tail -4
  echo "== $3 end $(date -u +%H:%M:%S) $(cat /proc/loadavg)"
}
B0=${BASE:-/tmp/h1/base}; B1=${BRANCH:-/work/wt1}
A=${1:-1}; Z=${2:-2}
one $B0 /tmp/h1/smol.cbk smol_base_$A
one $B1 /tmp/h1/smol.cbk smol_branch_$A
one $B0 /tmp/h1/qwen.cbk qwen_base_$A
one $B1 /tmp/h1/qwen.cbk qwen_branch_$A
one $B1 /tmp/h1/smol.cbk smol_branch_$Z
one $B0 /tmp/h1/smol.cbk smol_base_$Z
one $B1 /tmp/h1/qwen.cbk qwen_branch_$Z
one $B0 /tmp/h1/qwen.cbk qwen_base_$Z
echo ALLDONE
