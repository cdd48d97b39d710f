# Shared start of the one-call device scripts (scripts/sessions/gpu_layouts.sh, gpu_pdl.sh, gpu_session4.sh); sourced
# after the caller has set OUT. Sets L (a log folder the caller tars into $OUT), t0 and a deadline of BUDGET_S
# seconds (default 560); `budget CAP RESERVE` prints a timeout of at most CAP seconds that leaves RESERVE for the
# steps after; `since` prints the seconds elapsed. Records the GPU and builds both CUDA extensions in parallel
# (SKIP_BUILD=1: no builds, for runs that need neither extension).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
L=$(mktemp -d)
mkdir -p "$OUT"
t0=$(date +%s)
deadline=$(( t0 + ${BUDGET_S:-560} ))
budget() { local left=$(( deadline - $(date +%s) - $2 )) c=$1; (( left < c )) && c=$left; (( c < 5 )) && c=5; echo $c; }
since() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$L/gpu.txt"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
python3 -c "from trapetum.kernels import cuda_ext; assert cuda_ext.load() is not None, cuda_ext.error()" > "$L/build4.log" 2>&1 &
python3 -c "from trapetum.kernels import additive_gemv as ag; assert ag.EXT.load() is not None, ag.EXT.error()" > "$L/build2.log" 2>&1 &
wait
echo "build done ($(since)): $(tail -c 300 "$L/build4.log") $(tail -c 300 "$L/build2.log")"
fi
# start_batch_builds: in the background, the main and wgmma extensions' builds (pids B1, B2) and the random
# Llama-2-7B-shape 4-bit .cbk with SmolLM2's tokenizer at $F (pid CBK) that the batched-serving runs load.
start_batch_builds() {
  F=${F:-/tmp/random-llama2-7b-cb4.cbk}
  python3 -m pip install -q --no-index --no-deps .whl/gguf-*.whl > "$L/pip.log" 2>&1
  python3 -c "from trapetum.kernels import cuda_ext; assert cuda_ext.load() is not None, cuda_ext.error()" > "$L/build_main.log" 2>&1 &
  B1=$!
  python3 -c "from trapetum.kernels import codebook_gemm_wgmma as m; assert m.EXT.load() is not None, m.EXT.error()" > "$L/build_wg.log" 2>&1 &
  B2=$!
  ( s=$(date +%s); python3 -m trapetum.eval.random_cbk --shape llama2-7b --format cb4 \
      --tokenizer xfer/smollm2-tokenizer/tokenizer.json --out "$F" --device cuda; echo "rc=$? process wall $(( $(date +%s) - s )) s" ) \
    > "$L/random_cbk.log" 2>&1 &
  CBK=$!
}
