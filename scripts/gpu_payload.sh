#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a GPU machine that cannot download anything (for
# example an H200 with Python 3.12 and torch with CUDA 13): Mooncake's CUDA wheel for that
# Python in .whl/, and libibverbs1 (which Mooncake loads) with its libnl libraries in .deb/.
# Where that machine's Python already has pytest (with pytest-timeout and pytest-xdist),
# hypothesis, rich, matplotlib, setuptools and wheel, carrying other versions would shadow
# them beside its own pytest plugins, so they are not carried. Run it on a machine with
# network, copy both folders (git ignores them) into the checkout on the GPU machine, then:
#
#   bash scripts/gpu_payload.sh                  # about 50 MB
#   bash scripts/gpu_check.sh OUTDIR             # on the GPU machine
#
# PYTHON_VERSION (default 3.12) and MOONCAKE_WHEEL (default mooncake-transfer-engine-cuda13)
# pick another Python or CUDA major.
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=${PYTHON_VERSION:-3.12}
wheel=${MOONCAKE_WHEEL:-mooncake-transfer-engine-cuda13}
rm -rf .whl .deb
mkdir -p .whl .deb
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "$wheel"
(cd .deb && apt-get download -q libibverbs1 libnl-3-200 libnl-route-3-200)
du -sh .whl .deb
ls .whl .deb
