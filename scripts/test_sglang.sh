#!/usr/bin/env bash
# Set up .venv-sglang (torch CPU, kvmove editable, SGLang's cache modules without its heavy
# dependencies) and run the SGLang interop tests in tests/integrations/sglang. Extra arguments
# go to pytest; --setup-only sets up the venv and stops. Idempotent: a second run with unchanged pins installs nothing.
# Run scripts/setup.sh first (it installs the system library Mooncake needs).
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=test_sglang
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

setup_only=0
if [ "${1:-}" = --setup-only ]; then setup_only=1; shift; fi

PYTHON=${PYTHON:-python3}
VENV=.venv-sglang
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
# The pure-Python modules SGLang's cache code imports (mem_cache/hicache_storage.py,
# storage/backend_factory.py, pool_host/*, storage/mooncake_store/mooncake_store.py).
SGLANG_MODULES=(orjson msgspec psutil pybase64 packaging pillow starlette pydantic pyzmq tqdm
                IPython dill requests "apache-tvm-ffi==0.1.11" transformers sentencepiece
                compressed_tensors gguf)

[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
SETUP_LOG=$VENV/setup.log  # pip's output (the terminal gets one line a step)

constraints="$VENV/constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" >"$constraints"
stamp="$VENV/.kvmove-sglang-setup"
want="$SGLANG_VERSION $TORCH_VERSION $(cat pyproject.toml "$0" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # shellcheck source=scripts/cpu_torch.sh
  . scripts/cpu_torch.sh
  install_cpu_torch "$VENV/bin/python" "$TORCH_VERSION"
  say "installing kvmove[cpu,test] (editable)"
  quietly "${PIP[@]}" -c "$constraints" -e ".[cpu,test]"
  say "installing sglang==$SGLANG_VERSION (no dependencies) and its cache modules' imports"
  quietly "${PIP[@]}" -c "$constraints" --no-deps "sglang==$SGLANG_VERSION"
  quietly "${PIP[@]}" -c "$constraints" "${SGLANG_MODULES[@]}"
  "$VENV/bin/python" -c 'import mooncake.store' \
    || die "the Mooncake wheel does not import (see the error above)"
  echo "$want" >"$stamp"
fi
[ "$setup_only" = 1 ] && exit 0
say "running the SGLang interop tests"
KVMOVE_ENGINE_STAGE=sglang exec "$VENV/bin/python" -m pytest tests/integrations/sglang "$@"
