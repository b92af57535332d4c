#!/usr/bin/env bash
# What scripts/gpu_check.sh may need carried to a GPU machine that cannot download anything:
# the copy engine's binding, cuda-bindings (and cuda-pathfinder, which it loads the driver
# through), for that machine's Python and for the CUDA major of ITS torch (cuda-bindings 12.x
# for a torch built for CUDA 12, 13.x for CUDA 13: a binding of the other major is refused by
# the preflight). Nothing else by default: pinned staging needs no binding, the mover's GPU
# tests use an in-memory store, and the machine's Python must bring torch, Triton and pytest.
# A machine whose Python has cuda-bindings of the right major (the H200 image here: torch
# 2.11+cu130 with cuda-bindings) needs no binding carried. Without Mooncake there, the
# Transfer Engine tests (the direct path) are left out and the hot path's prefetch figures
# are not measured: WITH_MOONCAKE=1 (below) carries it.
#
#   CUDA_MAJOR=13 bash scripts/gpu_payload.sh    # on a machine with network; CUDA_MAJOR is
#                                                # required: the GPU machine's torch.version.cuda
#   bash scripts/gpu_check.sh                    # on the GPU machine, with .whl/ copied there
#
# PYTHON_VERSION (default 3.12) picks another Python. WITH_MOONCAKE=1 adds the Mooncake wheel
# of that CUDA major (mooncake-transfer-engine for 12, -cuda13 for 13), for the Transfer Engine
# tests and the store's figures there, and the shared libraries its engine links against
# beyond the wheel (libibverbs1, its providers, libnuma1, libnl), taken from this Debian
# machine's packages (apt-get download) into .whl/lib: gpu_check.sh puts those the GPU
# machine lacks on LD_LIBRARY_PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
major=${CUDA_MAJOR:?set CUDA_MAJOR to the CUDA major of the GPU machine torch (12 or 13)}
case "$major" in
  12) mooncake=mooncake-transfer-engine==0.3.13.post1 ;;
  13) mooncake=mooncake-transfer-engine-cuda13 ;;
  *) echo "CUDA_MAJOR must be 12 or 13, got $major" >&2; exit 2 ;;
esac
python_version=${PYTHON_VERSION:-3.12}
rm -rf .whl
mkdir -p .whl
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}
get "cuda-bindings>=$major,<$((major + 1))" cuda-pathfinder
if [ "${WITH_MOONCAKE:-0}" = 1 ]; then
  get "$mooncake"
  debs=$(mktemp -d)
  (cd "$debs" && apt-get download -q libibverbs1 ibverbs-providers libnuma1 libnl-3-200 \
    libnl-route-3-200 >/dev/null) || { echo "apt-get download failed: the Mooncake wheel is" \
    "carried without its system libraries" >&2; }
  mkdir -p .whl/lib
  for deb in "$debs"/*.deb; do
    [ -e "$deb" ] || continue
    dpkg-deb -x "$deb" "$debs/root"
  done
  if [ -d "$debs/root" ]; then
    # each library under its soname (libibverbs.so.1, ...), as a plain file
    find "$debs/root" -regextype posix-extended -regex '.*/lib[^/]*\.so\.[0-9]+' \
      -exec cp -L {} .whl/lib/ \;
  fi
  rm -rf "$debs"
fi
du -sh .whl
ls .whl .whl/lib 2>/dev/null || true
