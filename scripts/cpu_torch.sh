# Sourced by the set-up scripts: install_cpu_torch PYTHON VERSION
# installs torch into PYTHON's environment without a surprise CUDA download. On Linux x86-64
# the default index's torch bundles the CUDA libraries (gigabytes a CPU machine does not
# need). In order: a torch wheel already on this machine (pip's find-links; its dependencies
# from the index), the CPU wheel index where it answers, the default index as a last
# resort. Says which it used (through the caller's `say`).
install_cpu_torch() {
  local python=$1 version=$2
  local pip=("$python" -m pip install -q --disable-pip-version-check)
  local cpu_index=${KVMOVE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
  local pin="torch==$version"
  # --no-deps: --no-index cannot resolve torch's own dependencies (filelock, sympy, ...).
  if "${pip[@]}" --no-index --no-deps "$pin" >/dev/null 2>&1 && "${pip[@]}" "$pin"; then
    say "torch: a wheel already on this machine ($("$python" -c 'import torch; print(torch.__version__)'))"
  elif "$python" - "$cpu_index" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).close()
PY
  then
    say "torch: the CPU build, from the CPU wheel index $cpu_index"
    "${pip[@]}" "$pin" --index-url "$cpu_index"
  else
    say "torch: the CPU wheel index $cpu_index does not answer; installing from the default"
    say "       index (on Linux x86-64 that build carries CUDA libraries; it runs on the CPU)"
    "${pip[@]}" "$pin"
  fi
}
