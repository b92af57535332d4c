#!/usr/bin/env bash
# Compile the row-copy kernel for NVIDIA GPUs (sm_90, sm_80; no GPU needed) under the Triton
# versions engines run with, besides the one in .venv that the core suite uses: 3.5.1 (torch
# 2.9, which SGLang and vLLM pin) and 3.6.0 (torch 2.11, the GPU machine's image). Each is
# installed once, without dependencies, into .triton-versions/<version> and put ahead of
# .venv's own on PYTHONPATH for one run of tests/kernels/test_row_copy_compile.py (which
# checks that the run sees that version). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=test_triton_versions
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

VERSIONS=(3.5.1 3.6.0)
[ -x .venv/bin/python ] || die ".venv is missing: run scripts/setup.sh first"
for version in "${VERSIONS[@]}"; do
  dir=.triton-versions/$version
  if [ ! -f "$dir/.installed" ]; then
    say "installing Triton $version into $dir (compiler only, about 200 MB)"
    rm -rf "$dir"
    SETUP_LOG=$(mktemp)
    quietly .venv/bin/python -m pip install --disable-pip-version-check --no-deps \
      --target "$dir" "triton==$version"
    rm -f "$SETUP_LOG"
    touch "$dir/.installed"
  fi
  say "the row-copy kernel compiles with Triton $version"
  # A private compile cache: kernels of one version are never read by another.
  TRITON_CACHE_DIR="$PWD/$dir/.cache" KVMOVE_EXPECT_TRITON=$version \
    PYTHONPATH="$PWD/$dir" .venv/bin/python -m pytest -q -p no:cacheprovider "$@" \
    tests/kernels/test_row_copy_compile.py
done
