"""Keep native libraries' log lines (Mooncake's glog writes straight to file descriptor 2,
whatever ``MC_LOG_LEVEL`` says about errors such as ``Local segment descriptor not found``)
out of a terminal: :func:`native_stderr_to` sends fd 2 to a file while Python's own
``sys.stderr`` keeps writing to the terminal."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile


@contextlib.contextmanager
def native_stderr_to(prefix: str = "kvmove-native-"):
    """Within the block, file descriptor 2 writes to a temporary file (its path is
    yielded; it is kept, for a bug report) and ``sys.stderr`` to the original stderr."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
    sys.stderr.flush()
    saved = os.dup(2)
    old_stderr = sys.stderr
    try:
        os.dup2(fd, 2)
        sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
        yield path
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
            sys.stderr.close()
        sys.stderr = old_stderr
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)
