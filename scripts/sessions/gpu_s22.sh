#!/usr/bin/env bash
# Session 22, issue 23 on one device lease: the GGUF pieces arrive over back-to-back calls while the quality jobs
# run in the background (setsid: they outlive the call that started them, until the machine goes back). The machine
# is given back 30 s after a call, so the calls must follow each other: `wait` keeps it held.
#   bash scripts/sessions/gpu_s22.sh recv                   move carried pieces xfer/[sqg].NN to /tmp/m
#   bash scripts/sessions/gpu_s22.sh start NAME VAR=V ...   gpu_quality_fair.sh with those variables, from a private
#                                                           copy of the tree, as job NAME (log /tmp/jobs/NAME.log)
#   bash scripts/sessions/gpu_s22.sh wait SECONDS           until every job ended or SECONDS passed; each job's tail,
#                                                           its results and logs as $OUT/NAME.tgz
# Carry: .whl/gguf-*.whl, xfer/wiki.test.raw, xfer/valid.txt, xfer/llb.tgz (static llama.cpp b11312 llama-quantize and
# llama-imatrix: `cmake ... -DBUILD_SHARED_LIBS=OFF -DGGML_OPENMP=OFF -DLLAMA_OPENSSL=OFF` with build_llamacpp_tools.sh's
# other flags), the pieces (Qwen: a 50 MiB first piece beside the tools, then 62 MB ones: `split -b 62000000`).
# Session 22's run: QUALITY.md "Session 22".
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/m /tmp/jobs
for f in xfer/[sqg].[0-9][0-9]; do [ -f "$f" ] && mv "$f" /tmp/m/; done
mkdir -p /tmp/m/tools; for f in xfer/llb.tgz xfer/wiki.test.raw xfer/valid.txt; do [ -f "$f" ] && cp "$f" /tmp/m/tools/; done
ls /tmp/m | tr '\n' ' '; echo
[ -x /tmp/llb/bin/llama-quantize ] || { [ -f /tmp/m/tools/llb.tgz ] && mkdir -p /tmp/llb && tar xzf /tmp/m/tools/llb.tgz -C /tmp/llb; }
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/gguf-*.whl
case "${1:-}" in
recv) ;;
start)
    name=$2; shift 2
    for a in "$@"; do case $a in MODEL=smol) p=s;; MODEL=qwen) p=q;; MODEL=gemma) p=g;; esac; done
    [ -s /tmp/m/$p.gguf ] || cat /tmp/m/$p.[0-9][0-9] > /tmp/m/$p.gguf  # once, before any job reads it
    rm -rf /tmp/jobs/$name.tree && mkdir -p /tmp/jobs/$name.tree /tmp/jobs/$name.out
    cp -r . /tmp/jobs/$name.tree/ && mkdir -p /tmp/jobs/$name.tree/xfer && cp /tmp/m/tools/* /tmp/jobs/$name.tree/xfer/
    ( cd /tmp/jobs/$name.tree && setsid nohup env "$@" BQ=/tmp/bq/$name OUT=/tmp/jobs/$name.out bash scripts/sessions/gpu_quality_fair.sh \
        > /tmp/jobs/$name.log 2>&1 < /dev/null; echo $? > /tmp/jobs/$name.rc ) > /dev/null 2>&1 &
    sleep 2; echo "started $name: $*"; cat /tmp/jobs/$name.log ;;
wait)
    end=$(( $(date +%s) + $2 ))
    while (( $(date +%s) < end )); do
        running=0
        for l in /tmp/jobs/*.log; do n=$(basename $l .log); [ -f /tmp/jobs/$n.rc ] || running=1; done
        (( running )) || break
        sleep 5
    done
    for l in /tmp/jobs/*.log; do
        n=$(basename $l .log)
        echo "== $n rc=$(cat /tmp/jobs/$n.rc 2>/dev/null || echo running)"
        tail -n 4 /tmp/jobs/$n.log; tail -n 2 /tmp/bq/$n.a.log /tmp/bq/$n.b.log 2>/dev/null
        tar czf $OUT/$n.tgz -C /tmp --exclude='*.gguf' --exclude='*.cbk' --exclude='*.dat' jobs/$n.log jobs/$n.out \
            $(cd /tmp && ls -d bq/$n bq/$n.*.log 2>/dev/null) 2>/dev/null
        [ -f /tmp/bq/$n/results.json ] && cp /tmp/bq/$n/results.json $OUT/$n.results.json
    done
    nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader ;;
*) echo "usage: recv | start NAME VAR=V ... | wait SECONDS"; exit 2 ;;
esac
