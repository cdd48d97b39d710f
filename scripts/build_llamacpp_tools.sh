#!/usr/bin/env bash
# Build llama.cpp's quantize / imatrix / perplexity / bench tools, for the quality benchmark only
# (scripts/bench_quality.py; never a runtime dependency of Trapetum).
#
#   bash scripts/build_llamacpp_tools.sh [WORKDIR [JOBS [native|avx2]]]   (default /tmp/llamacpp-b11312, 1 job)
#
# Source: the llama-cpp-python 0.3.36 sdist from the package index (sha256 832db069…c1a2e), which vendors
# llama.cpp b11312.
# CPU build, AMX off (ggml's AMX path crashed on this machine's Xeon), OpenMP on, AVX-512 (+VNNI, BF16) set
# explicitly; 'native' instead tunes for the building CPU (GGML_NATIVE, AMX still off), for a CPU without
# AVX-512; 'avx2' builds for AVX2 alone (no AVX-512, no AVX-VNNI: what an AVX2-only machine runs, against
# bench_cpu --host-path avx2). Builds at nice 19 with one job by default (the dev machine's 2 cores are shared).
# Prints the bin directory at the end; pass it to bench_quality.py as --llama-bin.
set -euo pipefail
WORK=${1:-/tmp/llamacpp-b11312}
JOBS=${2:-1}
NATIVE=${3:-}
mkdir -p "$WORK"
cd "$WORK"
if [ ! -d llama_cpp_python-0.3.36 ]; then
    # a machine without the package index: put llama_cpp_python-0.3.36.tar.gz into WORKDIR first
    [ -f llama_cpp_python-0.3.36.tar.gz ] || \
        python3 -m pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .
    tar xzf llama_cpp_python-0.3.36.tar.gz
fi
SRC=$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp
if [ ! -f build/build.ninja ]; then
    cmake -S "$SRC" -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        $(if [ "$NATIVE" = native ]; then echo -DGGML_NATIVE=ON;
          elif [ "$NATIVE" = avx2 ]; then echo -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
            -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF;
          else echo -DGGML_NATIVE=OFF -DGGML_AVX=ON \
          -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
          -DGGML_AVX512_BF16=ON; fi) \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
        -DGGML_OPENMP=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
        > cmake.log
fi
nice -n 19 ninja -C build -j"$JOBS" llama-quantize llama-imatrix llama-perplexity llama-bench
echo "$WORK/build/bin"
