"""Device code of kvmove: Triton kernels and their launch configs. Knows nothing about the
store. A sub-package like any other: a source checkout on ``PYTHONPATH`` imports it."""
