"""Per-GPU tuning of the row-copy kernel: the config search, the workloads it times, the
results file and tuning at build time (``KVMOVE_AUTOTUNE=1``); the command is ``kvmove tune``
(:mod:`kvmove.cli.tune`). Sits above the copy API (it times copies) and below the mover
(which tunes when it is built); nothing on the copy path calls in here."""
