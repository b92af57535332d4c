"""Device code of kvmove: Triton kernels and their launch configs. Knows nothing about the
store. Installed as ``kvmove.kernels``."""
