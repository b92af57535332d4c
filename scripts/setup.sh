#!/usr/bin/env bash
# Set up kvmove in ./.venv: system library, virtualenv, torch without a surprise CUDA
# download, the Mooncake wheel that fits this machine, and the test tools.
# Idempotent: a second run with an unchanged pyproject.toml installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=setup
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null || die "$PYTHON not found: install Python >= 3.10"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "Python >= 3.10 is required, $PYTHON is $("$PYTHON" -V 2>&1)"

as_root() { [ "$(id -u)" = 0 ]; }
apt_install() {
  as_root || return 1
  command -v apt-get >/dev/null || return 1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1 \
    || { DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null 2>&1 \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1; }
}

# Mooncake's wheels link against libibverbs.so.1 (Debian package libibverbs1).
has_ibverbs() { "$PYTHON" -c 'import ctypes; ctypes.CDLL("libibverbs.so.1")' 2>/dev/null; }
if ! has_ibverbs; then
  say "installing the system library libibverbs1 (needed by Mooncake)"
  apt_install libibverbs1 || die "libibverbs.so.1 is missing and could not be installed.
  Install it as root:  apt-get install -y libibverbs1   (Debian/Ubuntu; rdma-core on RHEL)"
fi

if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  if ! "$PYTHON" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    pyver=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    apt_install "python${pyver}-venv" || apt_install python3-venv \
      || die "$PYTHON cannot create a virtualenv: install python3-venv"
    "$PYTHON" -m venv .venv
  fi
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check)
SETUP_LOG=.venv/setup.log  # pip's output (the terminal gets one line a step)

# The extra that fits this machine: a CUDA 13 / CUDA 12 driver, or none (on a GPU the final
# choice follows the CUDA major of the torch installed below).
extra=cpu
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  cuda=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n1)
  if [ "${cuda:-12}" -ge 13 ]; then extra=cuda13; else extra=cuda12; fi
fi

stamp=".venv/.kvmove-setup"
want="$extra $(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

if [ "$extra" = cpu ]; then
  # shellcheck source=scripts/cpu_torch.sh
  . scripts/cpu_torch.sh
  install_cpu_torch .venv/bin/python "${KVMOVE_TORCH_VERSION:-2.13.0}"
else
  say "installing torch (CUDA build, for a ${extra} driver)"
  quietly "${PIP[@]}" torch
  # The CUDA wheels (Mooncake's, cuda-bindings) follow torch's CUDA major, which the driver
  # runs (it runs its own major and older ones): one runtime major in the process.
  major=$(.venv/bin/python -c 'import torch; print((torch.version.cuda or "").split(".")[0])')
  case "$major" in
    12|13) extra=cuda$major ;;
    *) die "the installed torch is not a CUDA 12 or 13 build (torch.version.cuda: '$major')" ;;
  esac
fi
say "installing kvmove[$extra,test] (editable)"
quietly "${PIP[@]}" -e ".[$extra,test]"
.venv/bin/python -c 'import mooncake.store' \
  || die "the Mooncake wheel does not import (see the error above)"
echo "$want" >"$stamp"
say "ready: .venv ($extra)"
