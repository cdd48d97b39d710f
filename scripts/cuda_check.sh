#!/usr/bin/env bash
# Compile one trapetum/kernels/cuda/*.cu here (no GPU, CPU torch's headers) for sm_90: syntax, templates and
# ptxas' register / spill report. Usage: bash scripts/cuda_check.sh FILE.cu [more nvcc flags]
set -euo pipefail
f=$1; shift
T=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")
PYI=$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])")
stub=$(mktemp -d)
mkdir -p "$stub/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$stub/c10/cuda/impl/cuda_cmake_macros.h"
nvcc -std=c++20 -O3 -arch=sm_90 -c -x cu "$f" -DTRAPETUM_TORCH_LAUNCHER=1 -I "$stub" -I "$(dirname "$f")" \
  -I "$T/include" -I "$T/include/torch/csrc/api/include" -I "$PYI" -Xptxas -v -o "$stub/out.o" "$@" 2>&1 \
  | grep -v -E "Wc\+\+20-extensions|^\s+[0-9]+ \||^\s+\|" 
echo "compiled $f"
