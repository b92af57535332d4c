"""``EmbeddedMaster``: a private ``mooncake_master`` child process on free loopback ports, for
laptops, CI and tests (:meth:`kvmove.MooncakeStore.embedded`). Started from an argv list
(never a shell), bound to loopback, its log in a temporary file quoted in every error; ready
when its RPC port accepts connections and that socket is the child's. It never outlives its
parent: ``stop()`` (also at close, garbage collection and exit) sends ``SIGTERM`` then
``SIGKILL``; the child asks for ``SIGKILL`` when its parent dies (so one daemon "spawner"
thread forks every master); it runs in its own session; and a default ``SIGTERM`` action is
wrapped so the masters stop first. See ``docs/API.md``, ``EmbeddedMaster``."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib.util
import logging
import os
import queue
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

from kvmove.errors import StoreError

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CLIENT_TTL_S", "EmbeddedMaster", "check_bindable", "find_master_binary",
           "free_ports", "master_argv", "tcp_reachable"]

BINARY_ENV = "KVMOVE_MOONCAKE_MASTER"  # explicit path to a mooncake_master binary
# Seconds the master keeps a client that stopped sending heartbeats (Mooncake's
# --client_ttl, 10 s by default). Then it unmounts the client's segment: the replicas there
# are dropped, so reads go to surviving replicas (or answer MISS) instead of FAILED. Clients
# send a heartbeat about every second, so 5 s leaves room for a loaded machine.
DEFAULT_CLIENT_TTL_S = 5
_PR_SET_PDEATHSIG = 1
_PORT_ATTEMPTS = 3


def find_master_binary() -> str:
    """The ``mooncake_master`` to run: ``$KVMOVE_MOONCAKE_MASTER``, else the binary inside
    the installed ``mooncake`` wheel, else one next to ``sys.executable``, else one on
    ``PATH``. Raises :class:`kvmove.StoreError` listing where it looked."""
    looked = []
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        if os.access(explicit, os.X_OK):
            return explicit
        raise StoreError(f"{BINARY_ENV}={explicit!r} is not an executable file")
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / "mooncake_master"
            looked.append(str(path))
            if path.is_file():
                if not os.access(path, os.X_OK):  # wheels may drop the mode bit
                    with contextlib.suppress(OSError):
                        path.chmod(path.stat().st_mode | stat.S_IXUSR)
                if os.access(path, os.X_OK):
                    return str(path)
    beside = Path(sys.executable).parent / "mooncake_master"
    looked.append(str(beside))
    if os.access(beside, os.X_OK):
        return str(beside)
    on_path = shutil.which("mooncake_master")
    looked.append("$PATH")
    if on_path:
        return on_path
    raise StoreError(
        "mooncake_master not found (looked in: " + ", ".join(looked) + "); install "
        "mooncake-transfer-engine (or -non-cuda) or set " + BINARY_ENV
    )


# -- spawning -----------------------------------------------------------------------------


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()


def _die_with_parent(parent_pid: int):
    """A ``preexec_fn`` for the child: SIGKILL when the spawning thread dies. It only calls
    a function bound before the fork, and exits when the parent is already gone."""
    prctl = _PRCTL

    def preexec():
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


class _Spawner:
    """One daemon thread that forks every master (see the module docstring)."""

    _lock = threading.Lock()
    _requests: queue.SimpleQueue | None = None

    @classmethod
    def popen(cls, argv: list[str], **kwargs) -> subprocess.Popen:
        with cls._lock:
            if cls._requests is None:
                cls._requests = queue.SimpleQueue()
                threading.Thread(
                    target=cls._serve, args=(cls._requests,), name="kvmove-master-spawner",
                    daemon=True,
                ).start()
        done: Future = Future()
        cls._requests.put((argv, kwargs, done))
        return done.result()

    @staticmethod
    def _serve(requests: queue.SimpleQueue) -> None:
        while True:
            argv, kwargs, done = requests.get()
            try:
                done.set_result(subprocess.Popen(argv, **kwargs))
            except BaseException as e:  # handed to the caller
                done.set_exception(e)


def master_argv(binary: str, *, host: str, rpc_port: int, metrics_port: int,
                client_ttl_s: int | None = DEFAULT_CLIENT_TTL_S,
                kv_lease_ttl_ms: int | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """The ``mooncake_master`` command line: RPC and metrics on ``host``, logs to stderr."""
    argv = [
        binary,
        f"--rpc_port={rpc_port}",
        f"--rpc_address={host}",
        f"--metrics_port={metrics_port}",
        f"--metrics_host={host}",
        "--logtostderr",
    ]
    if client_ttl_s is not None:
        argv.append(f"--client_ttl={client_ttl_s}")
    if kv_lease_ttl_ms is not None:
        argv.append(f"--default_kv_lease_ttl={kv_lease_ttl_ms}")
    argv.extend(extra_args)
    return argv


def _check_positive_int(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value <= 0):
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _seconds(name: str, value, *, zero_ok: bool) -> float:
    """``value`` as float seconds (> 0, or >= 0 with ``zero_ok``), else ``ValueError`` naming
    ``name`` (kept here, not kvmove.checks: the CLI imports this module without torch)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (value >= 0 if zero_ok else value > 0) and value < float("inf")):
        raise ValueError(f"{name} must be {'>= 0' if zero_ok else 'positive'} seconds, "
                         f"got {value!r}")
    return float(value)


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct free TCP ports on ``host`` (held open together while chosen)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def check_bindable(host: str, port: int) -> None:
    """Raise :class:`kvmove.StoreError` with the cause when a listener cannot bind TCP
    ``port`` on ``host`` (the port is taken, or ``host`` is not an address of this
    machine); port 0 checks the address only."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host.strip("[]"), port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise StoreError(f"port {port} on {host} is in use (another mooncake_master, or "
                             f"another service): pick a free port") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise StoreError(f"{host} is not an address of this machine: bind to one of its "
                             f"own addresses, or 0.0.0.0 for all") from None
        raise StoreError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _listener_owner(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the socket listening on TCP ``port`` (``None`` when
    this system cannot tell, e.g. no ``/proc``)."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            if not os.path.exists(table):
                continue
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if (cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port
                            and cols[9] in inodes):
                        return True
        return False
    except OSError:
        return None


def tcp_reachable(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _exited(proc: subprocess.Popen, timeout: float) -> bool:
    """Whether ``proc`` exits within ``timeout`` seconds. Polls (never a blocking
    ``wait()``), so it is safe inside a signal handler that interrupted a ``wait()``."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class _LogFile:
    """The master's log file (``path`` None: it writes to this process's stderr), and
    whether to keep it when the master stops."""

    def __init__(self, path: str | None, keep: bool):
        self.path, self.keep = path, keep


def _stop_process(proc: subprocess.Popen, logfile: _LogFile, grace: float,
                  owner_pid: int | None = None) -> None:
    """Terminate, then kill after ``grace`` seconds, ``proc`` (``grace`` 0: kill it at once);
    remove its log unless ``logfile.keep``. Does nothing in a forked child (``owner_pid`` is
    the process that started ``proc``)."""
    if owner_pid is not None and os.getpid() != owner_pid:
        return
    if proc.poll() is None and grace <= 0:  # a private master: its objects die with it
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        if not _exited(proc, 5.0):
            log.error("mooncake_master pid %d survived SIGKILL for 5 s", proc.pid)
    elif proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        if not _exited(proc, grace):
            log.warning("mooncake_master pid %d ignored SIGTERM for %.1fs; killing it",
                        proc.pid, grace)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            if not _exited(proc, 5.0):
                log.error("mooncake_master pid %d survived SIGKILL for 5 s", proc.pid)
    if not logfile.keep and logfile.path is not None:
        with contextlib.suppress(OSError):
            os.unlink(logfile.path)


# -- SIGTERM ------------------------------------------------------------------------------

_LIVE: weakref.WeakSet = weakref.WeakSet()  # masters started by this process
_sigterm_installed = False


def _on_sigterm(signum, frame) -> None:
    """Stop this process's masters, then end the process by ``SIGTERM`` as the default
    action would have."""
    for master in list(_LIVE):
        if master._owner_pid == os.getpid():
            with contextlib.suppress(Exception):
                master.stop()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_handler() -> None:
    """Install :func:`_on_sigterm` once, from the main thread, only over the default action
    (a handler the application installed, before or after, is never replaced)."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            _sigterm_installed = True  # the application's handler stays
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter, or no signals here
        return
    _sigterm_installed = True
    log.debug("installed kvmove's SIGTERM handler (stops embedded masters)")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_LIVE.clear)


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(log {path} unreadable: {e})"
    return "\n".join(text.splitlines()[-lines:])


class EmbeddedMaster:
    """A ``mooncake_master`` child process listening on free loopback ports. ``kv_lease_ttl_ms``,
    ``client_ttl_s`` (:data:`DEFAULT_CLIENT_TTL_S`; ``None``: Mooncake's 10 s) and
    ``extra_args`` go to the master; ``start_timeout``, ``stop_timeout`` (seconds from
    ``SIGTERM`` to ``SIGKILL``; 0: ``SIGKILL`` at once, which spares the second Mooncake's
    master takes to exit after ``SIGTERM``), ``keep_log``, ``log_to_stderr``,
    ``host``, ``rpc_port`` / ``metrics_port`` (default: free ones). A fixed port in use, or a
    host not this machine's, raises :class:`kvmove.StoreError` before anything starts.
    ``address`` is the ``host:port`` to give a client as its master address."""

    def __init__(
        self,
        *,
        kv_lease_ttl_ms: int | None = None,
        client_ttl_s: int | None = DEFAULT_CLIENT_TTL_S,
        extra_args: Sequence[str] = (),
        start_timeout: float = 15.0,
        stop_timeout: float = 5.0,
        keep_log: bool = False,
        binary: str | None = None,
        host: str = "127.0.0.1",
        rpc_port: int | None = None,
        metrics_port: int | None = None,
        log_to_stderr: bool = False,
    ):
        _check_positive_int("kv_lease_ttl_ms", kv_lease_ttl_ms)
        _check_positive_int("client_ttl_s", client_ttl_s)
        if isinstance(extra_args, str) or not all(isinstance(a, str) for a in extra_args):
            raise TypeError(f"extra_args must be a sequence of str, got {extra_args!r}")
        for name, port in (("rpc_port", rpc_port), ("metrics_port", metrics_port)):
            if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                     or not 0 < port < 65536):
                raise ValueError(f"{name} must be a port 1..65535, got {port!r}")
        self.host = host
        self.binary = binary or find_master_binary()
        for port in (rpc_port, metrics_port):  # a taken port or a foreign host: say so now
            if port is not None:
                check_bindable(host, port)
        if rpc_port is None or metrics_port is None:
            check_bindable(host, 0)
        self.stop_timeout = _seconds("stop_timeout", stop_timeout, zero_ok=True)
        self.start_timeout = _seconds("start_timeout", start_timeout, zero_ok=False)
        path = None
        if not log_to_stderr:
            fd, path = tempfile.mkstemp(prefix="kvmove-mooncake-master-", suffix=".log")
            os.close(fd)
        self._log = _LogFile(path, keep_log)
        self._proc: subprocess.Popen | None = None
        self._finalizer = None
        self._owner_pid = os.getpid()
        _install_sigterm_handler()
        _LIVE.add(self)
        attempts = _PORT_ATTEMPTS if rpc_port is None else 1  # a fixed port is tried once
        for attempt in range(1, attempts + 1):
            self.rpc_port, self.metrics_port = self._ports(rpc_port, metrics_port)
            argv = master_argv(self.binary, host=host, rpc_port=self.rpc_port,
                               metrics_port=self.metrics_port, client_ttl_s=client_ttl_s,
                               kv_lease_ttl_ms=kv_lease_ttl_ms, extra_args=extra_args)
            self.argv = argv
            if self._start(argv, start_timeout, last_attempt=attempt == attempts):
                break
        log.info("mooncake_master pid %d on %s (log %s)", self.pid, self.address, self.log_path)

    def _ports(self, rpc_port: int | None, metrics_port: int | None) -> tuple[int, int]:
        """The RPC and metrics ports: those given, free ones for the others."""
        free = iter(free_ports(self.host.strip("[]"),
                               (rpc_port is None) + (metrics_port is None)))
        return (rpc_port if rpc_port is not None else next(free),
                metrics_port if metrics_port is not None else next(free))

    def _start(self, argv: list[str], timeout: float, *, last_attempt: bool) -> bool:
        """Spawn and wait for readiness; ``False`` when the ports were taken meanwhile."""
        with contextlib.ExitStack() as files:
            out = (2 if self.log_path is None  # this process's stderr
                   else files.enter_context(open(self.log_path, "ab")))
            proc = _Spawner.popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                close_fds=True, start_new_session=True,
                preexec_fn=_die_with_parent(os.getpid()),
            )
        self._proc = proc
        self._finalizer = weakref.finalize(
            self, _stop_process, proc, self._log, self.stop_timeout, self._owner_pid,
        )
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                self._finalizer.detach()
                tail = self.log_tail()
                if not last_attempt and "in use" in tail.lower():
                    log.info("mooncake_master port race on %d; retrying", self.rpc_port)
                    return False
                raise StoreError(
                    f"mooncake_master exited with code {proc.returncode} while starting on "
                    f"{self.address}; argv {argv}; log {self.log_path}:\n{tail}"
                )
            if tcp_reachable(self.host, self.rpc_port, 0.2):
                owner = _listener_owner(proc.pid, self.rpc_port)
                if owner or owner is None:
                    return True
                if not last_attempt:  # someone else took the port
                    self._finalizer()
                    log.info("port %d was taken by another process; retrying", self.rpc_port)
                    return False
            if time.monotonic() > deadline:
                self._finalizer.detach()
                self._log.keep = True
                _stop_process(proc, self._log, self.stop_timeout)
                raise StoreError(
                    f"mooncake_master did not accept connections on {self.address} within "
                    f"{timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def restart(self) -> None:
        """Start the master again on the same ports after it died (a no-op while it runs).
        The new master knows no objects. Raises :class:`kvmove.StoreError` when it cannot
        start (e.g. the port was taken meanwhile)."""
        if self.running:
            # A master killed a moment ago can still look alive: its main thread is a zombie
            # that cannot be reaped until its other threads have exited. Give it a moment.
            try:
                self._proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                return
        if self._finalizer is not None:
            self._finalizer.detach()
        log.warning("restarting mooncake_master on %s (pid %d exited with %s)", self.address,
                    self.pid, self._proc.returncode if self._proc else None)
        self._start(self.argv, self.start_timeout, last_attempt=True)

    @property
    def address(self) -> str:
        """``host:port`` of the master's RPC service."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else -1

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The master's exit code once it has exited, else None."""
        return None if self._proc is None else self._proc.poll()

    @property
    def log_path(self) -> str | None:
        """The master's log file (None when it writes to this process's stderr)."""
        return self._log.path

    @property
    def keep_log(self) -> bool:
        """Whether the log file is kept when the master stops (it is after a failed start)."""
        return self._log.keep

    @keep_log.setter
    def keep_log(self, keep: bool) -> None:
        self._log.keep = bool(keep)

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the master's log, for error messages."""
        if self.log_path is None:
            return "(the log went to standard error)"
        return _tail(self.log_path, lines)

    def stop(self) -> None:
        """Stop the master (SIGTERM, then SIGKILL after ``stop_timeout``; 0: SIGKILL).
        Idempotent."""
        if self._finalizer is not None:
            self._finalizer()

    close = stop

    def __enter__(self) -> EmbeddedMaster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EmbeddedMaster({self.address}, pid {self.pid}, {state})"
