#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, and run every test stage: the core suite in .venv, the
# kernel's compile check under the Triton versions engines run with, then the SGLang interop
# tests (.venv-sglang) and the vLLM integration tests (.venv-vllm), each stage setting up
# its own environment. Extra arguments go to the core suite's pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
bash scripts/test_triton_versions.sh
bash scripts/test_sglang.sh
bash scripts/test_vllm.sh
