"""kvmove's benchmarks: the row-copy kernels against bulk, per-page and per-row memcpy, the
torch primitives and a CPU rearrange, on any machine; one command, ``python -m
bench.run_all``, writes ``bench/results/<machine>-<date>.json``, a plot and the tables.

OpenMP threads wait *passively* here unless ``OMP_WAIT_POLICY`` says otherwise (it must be
set before torch loads OpenMP, hence here): on a small, shared VM (2 vCPUs) torch's
spinning OpenMP workers put a whole process into a mode where every parallel copy runs about
6x slower (index_select 1.3 instead of 8.5 GB/s, measured), at random per process. Passive
waiting makes runs comparable; the setting is recorded in each results file.
``OMP_WAIT_POLICY=default`` runs with the runtime's own default instead (threads spin a
while after each parallel region: what an engine's process gets), in the suites a run
starts as processes of their own too.
"""

import os

# Set here (and inherited by the suites' processes) where OMP_WAIT_POLICY=default asked for
# the runtime's default: the variable itself is then unset.
RUNTIME_DEFAULT = "KVMOVE_BENCH_OMP_RUNTIME_DEFAULT"

if (os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "default"
        or os.environ.get(RUNTIME_DEFAULT) == "1"):
    os.environ.pop("OMP_WAIT_POLICY", None)  # the runtime's default: spin, then sleep
    os.environ[RUNTIME_DEFAULT] = "1"
else:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
