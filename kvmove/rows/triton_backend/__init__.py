"""The Triton backend of row moves: how a move's rows are handed to ``kvmove.kernels``."""
