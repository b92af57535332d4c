"""Per-GPU tuning of the row-copy kernel: the config search, the workloads it times, the
results file, tuning at build time (``KVMOVE_AUTOTUNE=1``) and ``kvmove tune``. Sits above
the copy API; nothing below it calls in here."""
