#!/usr/bin/env bash
# The decisive GPU check, one run on one CUDA GPU in under 10 minutes, offline, ending in one
# verdict line (GPU CHECK: PASS / FAIL):
#   1. preflight (kvmove doctor --gpu-check): torch sees the GPU, Triton imports, the copy
#      engine's binding (cuda-bindings of torch's CUDA major) is there; else it stops at once,
#      naming the cause. Pinned staging and the direct kernel need no binding (UVA), but the
#      check tests the copy engine too.
#   2. every GPU test (tests/gpu, the real Triton compiler, an in-memory store: none is
#      skipped for want of Mooncake); a skipped test, a failed one or a copy-engine batch the
#      driver refused is a failure. Tests marked multi_gpu are deselected on a one-GPU machine,
#      those marked transfer_engine where Mooncake is not installed; the verdict says how many.
#   3. tuning for this GPU (kvmove tune --quick, at most 16 programs), then
#   4. the GPU benchmark (bench/bench_gpu.py): vs bulk pinned copies, vs one cudaMemcpyAsync
#      per page, matmul slowdown beside gathers, copy engine vs kernel, the kernel's page-span
#      mode vs its row mode (132/656/1152/4100-B rows, 16/64-token pages); its goals are reported
#      in the verdict (measurements, not failures); a refused batch there is a failure.
#   With --full, also the kernel benchmarks, the per-call cost and the mover end to end
#   (bench.run_all --quick --only kernels calls mover; the mover's needs Mooncake), which
#   take a few minutes more.
#
#   scripts/gpu_check.sh [--full] [OUT_DIR]   # OUT_DIR: $OUT if set,
#                                             # else bench/results/gpu-check
#
# Writes to OUT_DIR (a few files, none in subfolders): gpu_check.log, gpu_tests.xml,
# bench_gpu-<gpu>.json, paths-<gpu>.json (the faster path per tuner key), tuned-<gpu>.json
# (the tuner's table), verdict.txt; with --full also <gpu>-<date>-quick.json. Python: this
# repository's .venv when its torch sees the GPU, else $PYTHON or python3 (with torch,
# Triton, pytest); kvmove runs from this checkout (PYTHONPATH), nothing is installed. Wheels
# carried in .whl/ (scripts/gpu_payload.sh: cuda-bindings for a machine that lacks it) are
# unpacked into a private folder first. Exit: 0 pass, 1 fail, 2 no GPU / no usable Python.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
full=0
if [ "${1:-}" = "--full" ]; then full=1; shift; fi
out=${1:-${OUT:-bench/results/gpu-check}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/gpu_check.log"
: >"$log"
t0=$SECONDS
failed=()

say() { printf '[gpu_check %4ds] %s\n' $((SECONDS - t0)) "$*" | tee -a "$log"; }
finish() {  # the verdict line, in the log, in verdict.txt and last on stdout
  echo "$1" | tee -a "$log" >"$out/verdict.txt"
  echo "$1"
}
die() { say "error: $*"; finish "GPU CHECK: FAIL - $*"; exit 2; }
# step NAME SECONDS CMD...: run with a time limit, output to the terminal and the log.
step() {
  local name=$1 limit=$2
  shift 2
  say "== $name (limit ${limit}s): $*"
  local rc=0
  timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$log" || rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    if [ "$rc" -eq 124 ]; then say "$name: time limit of ${limit}s reached"; else say "$name: exit code $rc"; fi
    failed+=("$name")
  else
    say "$name: ok"
  fi
  return 0
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
else
  py=${PYTHON:-python3}
  has_cuda_torch "$py" || die "$py has no torch that sees the GPU (and .venv has none either)"
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
shopt -s nullglob
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  site=${TMPDIR:-/tmp}/kvmove-gpu-site
  say "installing ${#wheels[@]} carried wheel(s) from .whl/ into $site"
  "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$site" "${wheels[@]}" >>"$log" 2>&1 \
    || die "the carried wheels did not install (see $log)"
  export PYTHONPATH="$PYTHONPATH:$site"
fi
if [ -d .whl/lib ]; then
  # Carried system libraries (gpu_payload.sh WITH_MOONCAKE=1): only those this machine lacks
  # are linked into a private folder put on LD_LIBRARY_PATH; the machine's own stay in use.
  have=$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null || true)
  libdir=${TMPDIR:-/tmp}/kvmove-gpu-libs
  rm -rf "$libdir"
  mkdir -p "$libdir"
  for lib in .whl/lib/*.so*; do
    name=$(basename "$lib")
    if ! grep -qF "$name " <<<"$have"; then ln -s "$repo/$lib" "$libdir/$name"; fi
  done
  say "carried libraries this machine lacks: $(ls "$libdir" | tr '\n' ' ')"
  export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
# A private tuning cache: the tuner writes it, the benchmark reads it; the user's is left alone.
export XDG_CACHE_HOME="${TMPDIR:-/tmp}/kvmove-gpu-check-cache"
rm -rf "$XDG_CACHE_HOME"
"$py" - <<'PY' 2>&1 | tee -a "$log"
import torch, triton
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
PY
gpu=$("$py" -c 'import torch; from kvmove.kernels.configs import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))')
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')

# -- 1. preflight: a missing binding stops the check here, with its cause -------------------
say "== preflight: kvmove doctor --gpu-check"
if ! "$py" -m kvmove.cli doctor --gpu-check 2>&1 | tee -a "$log"; then
  die "preflight failed: $(grep -m1 PROBLEM "$log" | sed 's/^PROBLEM *//') (fix: $(grep -m1 -A1 PROBLEM "$log" | sed -n 's/^ *fix: //p'))"
fi

# -- 2. every GPU test ------------------------------------------------------------------------
# Tests that cannot run here are deselected and counted in the verdict: multi-GPU tests on a
# one-GPU machine, Transfer Engine tests (the direct path) where Mooncake is not installed.
collected() { "$py" -m pytest -q --collect-only -p no:cacheprovider -m "$1" tests/gpu 2>/dev/null \
  | grep -c '::' || true; }
skip_marks=()
deselected=0
no_mooncake=0
if [ "$gpus" -lt 2 ]; then
  skip_marks+=(multi_gpu)
  deselected=$(collected multi_gpu)
fi
if ! why=$("$py" -c 'import mooncake.engine' 2>&1); then
  say "Mooncake is not usable here: the Transfer Engine tests are not run ($(tail -n1 <<<"$why"))"
  # What its CUDA wheel's engine.so links against beyond the wheel: to carry what is missing.
  # (read whole, then searched: grep -q on a pipe can end ldconfig early, and pipefail
  # would then report a library that is there as missing)
  libs=$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null || true)
  for lib in libibverbs.so.1 libmlx5.so.1 libnuma.so.1 libcurl.so.4; do
    if grep -qF "$lib" <<<"$libs"; then say "  $lib: present"; else say "  $lib: missing"; fi
  done
  # counted once: a multi-GPU test left out already is not counted again here
  if [ "$gpus" -lt 2 ]; then
    no_mooncake=$(collected "transfer_engine and not multi_gpu")
  else
    no_mooncake=$(collected transfer_engine)
  fi
  skip_marks+=(transfer_engine)
fi
marks=()
if [ ${#skip_marks[@]} -gt 0 ]; then
  expr="not ${skip_marks[0]}"
  for m in "${skip_marks[@]:1}"; do expr+=" and not $m"; done
  marks=(-m "$expr")
fi
step "GPU tests" 300 "$py" -m pytest -q -p no:cacheprovider -rs "${marks[@]}" \
  --junitxml="$out/gpu_tests.xml" tests/gpu

# -- 3. tuning (the benchmark then uses the tuned table) -------------------------------------
step "tuning" 90 "$py" -m kvmove.cli tune --quick --time-limit 50 --row-bytes 656 132 1152 \
  --page-tokens 64 1 16 --max-programs 16 --out "$out/tuned-$gpu.json"

# -- 4. the GPU benchmark -------------------------------------------------------------------
step "GPU benchmark" 240 "$py" -m bench.bench_gpu --quick --json "$out/bench_gpu-$gpu.json" \
  --paths-out "$out/paths-$gpu.json"
if [ "$full" -eq 1 ]; then
  step "kernel benchmarks" 240 "$py" -m bench.run_all --quick --only kernels calls mover --out "$out" --no-plot
fi

say "files in $out:"
find "$out" -maxdepth 1 -type f -printf '%10s  %f\n' | sort -k2 | tee -a "$log"
args=(--junit "$out/gpu_tests.xml" --bench "$out/bench_gpu-$gpu.json" --deselected "$deselected"
      --no-mooncake "$no_mooncake" --seconds $((SECONDS - t0)))
for f in "${failed[@]}"; do args+=(--failed-step "$f"); done
rc=0
line=$("$py" -m bench.gpu_verdict "${args[@]}") || rc=$?
finish "$line"
exit "$rc"
