# Sourced by the set-up scripts (after scripts/lib.sh): install_cpu_torch PYTHON VERSION
# installs torch into PYTHON's environment without a surprise CUDA download. On Linux x86-64
# the default index's torch bundles the CUDA libraries (gigabytes a CPU machine does not
# need). In order: a torch wheel already on this machine (pip's find-links; its dependencies
# from the index), the CPU wheel index where it answers, the default index as a last
# resort. Says which it used; pip's output goes to $SETUP_LOG.
install_cpu_torch() {
  local python=$1 version=$2
  local pip=("$python" -m pip install --disable-pip-version-check)
  local cpu_index=${KVMOVE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
  local pin="torch==$version"
  # --no-deps: --no-index cannot resolve torch's own dependencies (filelock, sympy, ...).
  if "${pip[@]}" --no-index --no-deps "$pin" >>"${SETUP_LOG:-/dev/null}" 2>&1; then
    quietly "${pip[@]}" "$pin" numpy
    say "torch: a wheel already on this machine ($("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null))"
  elif "$python" - "$cpu_index" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).close()
PY
  then
    say "torch: the CPU build, from the CPU wheel index $cpu_index"
    quietly "${pip[@]}" "$pin" --index-url "$cpu_index"
  else
    say "torch: the CPU wheel index $cpu_index does not answer; installing from the default"
    say "       index (on Linux x86-64 that build carries CUDA libraries; it runs on the CPU)"
    quietly "${pip[@]}" "$pin"
  fi
}
