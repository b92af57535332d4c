"""What the operating system says about processes, threads, sockets and memory (Linux
``/proc``), for the fault, lifecycle, soak and security tests."""

from __future__ import annotations

import os
import socket
import struct
import time


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether ``pid`` is gone within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (field 4 of ``/proc/<pid>/stat``), or None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def mooncake_masters(children_of: int | None = None) -> dict[int, list[str]]:
    """``{pid: argv}`` of every live ``mooncake_master`` process on the machine (only the
    children of ``children_of``, when given: other processes may run masters of their
    own meanwhile)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == "mooncake_master" and alive(pid) and (
                children_of is None or parent_of(pid) == children_of):
            found[pid] = argv
    return found


def masters_on_port(port: int) -> list[int]:
    """Pids of live ``mooncake_master`` processes started with ``--rpc_port=port``."""
    return [pid for pid, argv in mooncake_masters().items() if f"--rpc_port={port}" in argv]


def native_threads() -> int:
    """Threads of this process, native ones (Mooncake's) included."""
    return len(os.listdir("/proc/self/task"))


def rss_bytes() -> int:
    """Resident memory of this process (``VmRSS`` of ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def _address(hex_addr: str) -> str:
    ip, port = hex_addr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port, 16)}"
    # /proc/net/tcp6 prints the address as four host-order 32-bit words
    words = struct.unpack("<4I", raw)
    return f"[{socket.inet_ntop(socket.AF_INET6, struct.pack('>4I', *words))}]:{int(port, 16)}"


def listening_addresses(pid: int) -> list[str]:
    """``host:port`` of every TCP socket that process ``pid`` listens on (IPv4 and IPv6)."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                    found.append(_address(cols[1]))
    return found
