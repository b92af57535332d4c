#!/usr/bin/env bash
# One GPU check, offline, in under 8 minutes: on a CUDA machine, set up (or reuse) a Python
# environment, run the tests with the real Triton compiler (tests/gpu included: the
# kernel, pinned staging over 1 GiB, the copy engine, graph capture, no host syncs in the
# mover, a flat compile count, and the mover on an engine stream when Mooncake imports),
# tune the kernel for this GPU, and run the kernel benchmarks and the per-call cost
# (bench/bench_calls.py: kvmove's host cost per launch). Each step has its own time
# limit (GPU tests 150 s, other tests 90 s, tuning 90 s, benchmarks 120 s). The CUDA bindings
# kvmove calls (cupy, cuda-bindings: the cuda12/cuda13 extras) must import there; the log
# says which are missing.
#
#   scripts/gpu_check.sh [OUT_DIR]        # default: $OUT if set, else bench/results
#
# Writes to OUT_DIR: gpu_check.log, <gpu>-<date>-quick.json and .png (benchmarks),
# tuned-<gpu>.json (the tuner's table for this GPU), report-<gpu>.md (the
# README section). No network is needed: the environment is this repository's .venv when
# its torch sees the GPU, else a virtualenv on top of the machine's python3 (which must
# hold torch and triton), into which any wheels in .whl/ are installed (e.g. the Mooncake
# CUDA wheel: without it, the tests that need a Mooncake store are left out and the log
# says so); system packages in .deb/ (libibverbs1) are unpacked beside it.
# scripts/gpu_payload.sh fetches both folders on a machine with network. The script exits 2 without a GPU, 1 if any step failed or ran out of time.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

out=${1:-${OUT:-bench/results}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/gpu_check.log"
: >"$log"
t0=$SECONDS
failed=()

say() { printf '[gpu_check %4ds] %s\n' $((SECONDS - t0)) "$*" | tee -a "$log"; }
die() { say "error: $*"; exit 2; }
# step NAME SECONDS CMD...: run with a time limit, output to the terminal and the log.
step() {
  local name=$1 limit=$2
  shift 2
  say "== $name (limit ${limit}s): $*"
  local rc=0
  timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$log" || rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    if [ "$rc" -eq 124 ]; then
      say "$name: time limit of ${limit}s reached"
    else
      say "$name: exit code $rc"
    fi
    failed+=("$name")
  else
    say "$name: ok"
  fi
}

# -- a GPU, or stop here -------------------------------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 || die "nvidia-smi not found: this script needs a CUDA GPU machine"
nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi -L failed: no usable NVIDIA GPU here"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"

# -- the Python environment ----------------------------------------------------------------
has_cuda_torch() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
  >/dev/null 2>&1; }
if [ -x .venv/bin/python ] && has_cuda_torch .venv/bin/python; then
  py=.venv/bin/python
  say "using .venv (its torch sees the GPU)"
else
  base=${PYTHON:-python3}
  has_cuda_torch "$base" || die "$base has no torch that sees the GPU, and .venv has none either"
  venv=${KVMOVE_GPU_VENV:-$HOME/.cache/kvmove/venv-gpu}
  if [ ! -x "$venv/bin/python" ]; then
    say "creating $venv on top of $base (its packages: torch, triton, ...)"
    "$base" -m venv --without-pip --system-site-packages "$venv"  # pip, setuptools: $base's
    # Where $base runs in a virtualenv itself, its packages are not the "system" ones: a
    # .pth file puts its site-packages on the new environment's path.
    "$base" -c 'import site; print("\n".join(site.getsitepackages()))' \
      >"$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_kvmove_base.pth"
  fi
  py=$venv/bin/python
  has_cuda_torch "$py" || die "$py does not see $base's torch; remove $venv and try again"
fi
pip=("$py" -m pip install -q --disable-pip-version-check --no-index --no-deps)
shopt -s nullglob
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  say "installing ${#wheels[@]} carried wheel(s) from .whl/"
  "${pip[@]}" "${wheels[@]}" 2>&1 | tee -a "$log"
fi
debs=(.deb/*.deb)
if [ ${#debs[@]} -gt 0 ]; then  # system libraries Mooncake loads (scripts/gpu_payload.sh)
  sys_root=${TMPDIR:-/tmp}/kvmove-sys
  say "unpacking ${#debs[@]} carried system package(s) from .deb/ into $sys_root"
  mkdir -p "$sys_root"
  for f in "${debs[@]}"; do dpkg -x "$f" "$sys_root"; done
  export LD_LIBRARY_PATH="$sys_root/usr/lib/x86_64-linux-gnu:$sys_root/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if ! "$py" -c 'import kvmove.kernels.configs' >/dev/null 2>&1 \
   || [ "$("$py" -c 'import kvmove, os; print(os.path.dirname(os.path.dirname(kvmove.__file__)))')" != "$repo" ]; then
  say "installing kvmove from $repo (editable, offline)"
  "${pip[@]}" --no-build-isolation -e . >>"$log" 2>&1 \
    || die "the offline install of kvmove failed (see $log): it needs setuptools>=68 and wheel in $py's environment; carry their wheels in .whl/"
fi
"$py" - <<'EOF' 2>&1 | tee -a "$log"
import torch, triton
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"GPU {torch.cuda.get_device_name()}")
EOF
gpu=$("$py" -c 'import torch; from kvmove.kernels.configs import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))')
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

# -- tests with the real Triton compiler ------------------------------------------------------
tests=(tests/gpu)
if "$py" -c 'import mooncake.store' >/dev/null 2>&1; then
  suite=(tests -m "not soak" --ignore tests/gpu)
else
  say "Mooncake does not import here (carry its CUDA wheel in .whl/, and libibverbs1): running the tests that need no store"
  suite=(tests/rows tests/tuning tests/kernels tests/memory tests/test_bad_input.py)
fi
parallel=()
"$py" -c 'import xdist' >/dev/null 2>&1 && parallel=(-n 8)
for binding in cupy cuda.bindings; do
  "$py" -c "import $binding" >/dev/null 2>&1 || say "warning: $binding does not import here: install kvmove's CUDA extra (or carry its wheel in .whl/)"
done
step "GPU tests" 150 "$py" -m pytest -q -p no:cacheprovider -rs "${tests[@]}"
step "test suite" 90 "$py" -m pytest -q -p no:cacheprovider "${parallel[@]}" "${suite[@]}"

# -- tuning (before the benchmarks, which then use the tuned table) -----------------------------
step "tuning" 90 "$py" -m kvmove.cli tune --quick --time-limit 60 --row-bytes 656 132 1152 \
  --page-tokens 64 1 16 --out "$out/tuned-$gpu.json"

# -- kernel benchmarks ----------------------------------------------------------------------------
step "benchmarks" 120 "$py" -m bench.run_all --quick --only kernels calls --out "$out"
found=("$out/$gpu"-*-quick.json)  # dated names: the last one is the newest
if [ ${#found[@]} -gt 0 ]; then  # (also after a cut-short run: its cases are saved as they come)
  "$py" -m bench.plot "${found[-1]}" >>"$log" 2>&1 || say "no plot (see the log)"
  "$py" -m bench.report "${found[-1]}" >"$out/report-$gpu.md" && say "README section: $out/report-$gpu.md"
fi

say "done in $((SECONDS - t0)) s; files in $out:"
find "$out" -maxdepth 1 -type f -printf '%10s  %f\n' | sort -k2 | tee -a "$log"
if [ ${#failed[@]} -gt 0 ]; then
  say "FAILED: ${failed[*]}"
  exit 1
fi
say "all steps passed"
