"""Mooncake's native log (glog, straight to fd 2), quiet unless asked for.
:func:`quiet_mooncake_log` sets ``MC_LOG_LEVEL`` (``ERROR``; ``INFO`` when kvmove's logger is
at DEBUG) unless the user set it; :func:`native_stderr_captured` sends fd 2 to a file around a
call that logs (a client's ``setup()``) and then passes glog's lines to the
``kvmove.store.mooncake`` logger, any other line back to stderr; :func:`native_stderr_to`
(``kvmove demo``) sends fd 2 to a file for a whole run."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading

mooncake_log = logging.getLogger("kvmove.store.mooncake")

# glog's line prefix: severity letter, MMDD, time, thread id, file:line]
_GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]]+\] ")
_HARMLESS = ("Local segment descriptor not found",
             "Logging before InitGoogleLogging() is written to STDERR")
_capture_lock = threading.Lock()


def quiet_mooncake_log() -> None:
    """``MC_LOG_LEVEL=ERROR`` (``INFO`` when kvmove's logger shows DEBUG) unless it is set."""
    verbose = logging.getLogger("kvmove").isEnabledFor(logging.DEBUG)
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if verbose else "ERROR")


@contextlib.contextmanager
def _fd2_to(fd: int):
    """File descriptor 2 writes to ``fd`` inside the block; ``sys.stderr`` keeps writing to
    the original stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    old_stderr = sys.stderr
    try:
        os.dup2(fd, 2)
        sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
            sys.stderr.close()
        sys.stderr = old_stderr
        os.dup2(saved, 2)
        os.close(saved)


def relay(lines: list[str]) -> None:
    """Native stderr lines: glog's to the ``kvmove.store.mooncake`` logger, others back to
    stderr."""
    for line in lines:
        if not line.strip():
            continue
        if _GLOG_LINE.match(line) or line.startswith("WARNING: Logging before"):
            harmless = any(h in line for h in _HARMLESS)
            level = logging.WARNING if line[0] in "EF" and not harmless else logging.DEBUG
            mooncake_log.log(level, "%s", line.rstrip())
        else:
            sys.stderr.write(line if line.endswith("\n") else line + "\n")


@contextlib.contextmanager
def native_stderr_captured():
    """Capture what native code writes to fd 2 inside the block, then :func:`relay` it.
    Yields a list that holds, after the block, the captured glog lines of severity W, E or F
    other than the known harmless ones (for an error message). Serialised: one capture at a
    time in a process."""
    problems: list[str] = []
    with _capture_lock, tempfile.TemporaryFile(mode="w+b") as f:
        try:
            with _fd2_to(f.fileno()):
                yield problems
        finally:
            f.seek(0)
            lines = f.read().decode("utf-8", "replace").splitlines()
            problems.extend(ln.strip() for ln in lines
                            if _GLOG_LINE.match(ln) and ln[0] in "WEF"
                            and not any(h in ln for h in _HARMLESS))
            relay(lines)


@contextlib.contextmanager
def native_stderr_to(prefix: str = "kvmove-native-"):
    """Within the block, file descriptor 2 writes to a new temporary file (its path is
    yielded; the caller removes it or reports it) and ``sys.stderr`` to the original
    stderr."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
    try:
        with _fd2_to(fd):
            yield path
    finally:
        os.close(fd)
