"""Opening a Mooncake client only against a master that answers: an RPC request the master
must react to within ``connect_timeout``, sent before Mooncake's ``setup()`` (which would
retry for ~90 s against a master that is not there, and freeze the whole process, GIL held,
against one that accepts connections but does not answer, e.g. a stopped one)."""

from __future__ import annotations

import logging
import socket
import struct
import time

from kvmove.errors import StoreError
from kvmove.status import code_name
from kvmove.store.config import DEFAULT_TENANT_ID, StoreConfig
from kvmove.store.embedded_master import EmbeddedMaster
from kvmove.store.native_log import native_stderr_captured, quiet_mooncake_log
from kvmove.store.transport_limits import prepare_environment

log = logging.getLogger(__name__)

# A request the master must react to: a coro_rpc request header (magic 0xde, version 1,
# struct_pack, request, sequence 0) for a function id no service registers, with no body.
PROBE_REQUEST = struct.pack("<BBBBIIII", 0xDE, 1, 0, 0, 0, 0x6B766D76, 0, 0)
NO_CONNECTION = "no TCP connection"
NO_ANSWER = "no answer to an RPC request"


def master_silence(host: str, port: int, timeout: float) -> str | None:
    """``None`` when the master at ``host:port`` reacts to an RPC request within ``timeout``
    seconds; otherwise why not, for an error message. A TCP connect alone is not enough: a
    stopped or wedged master still accepts connections. The master answers the request of
    an unknown function, or closes the connection, at once (~0.2 ms on loopback)."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return NO_CONNECTION
    with sock:
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(PROBE_REQUEST)
            sock.recv(1)  # an answer, or b"" when the master closed the connection
        except TimeoutError:
            return NO_ANSWER
        except OSError:
            pass  # reset by the master: it reacted
    return None


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def open_client(config: StoreConfig, master: EmbeddedMaster | None):
    """A Mooncake client set up against ``config.master_address``, once the master answers
    (else :class:`kvmove.StoreError`, with the embedded ``master``'s log when given)."""
    prepare_environment(config.protocol)  # the TCP queues, read by setup()
    address = config.master_address
    silence = master_silence(*split_address(address), config.connect_timeout)
    if silence is not None:
        detail = ""
        if master is not None:
            detail = f"; embedded master log {master.log_path}:\n{master.log_tail()}"
        hint = ("is mooncake_master running there?" if silence == NO_CONNECTION else
                "it accepts connections: is the master stopped or hung?")
        raise StoreError(
            f"cannot reach the Mooncake master at {address}: {silence} within "
            f"{config.connect_timeout:g}s ({hint}){detail}"
        )
    quiet_mooncake_log()
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise StoreError(
            "the Mooncake Python package is not installed (pip install "
            "mooncake-transfer-engine, or mooncake-transfer-engine-non-cuda on a machine "
            f"without CUDA): {e}"
        ) from e
    said: list[str] = []
    try:
        with native_stderr_captured() as said:  # glog's set-up lines go to the logger
            client = MooncakeDistributedStore()
            tenant = ({} if config.tenant_id == DEFAULT_TENANT_ID
                      else {"tenant_id": config.tenant_id})  # older Mooncake lacks it
            rc = client.setup(
                config.local_hostname,
                config.metadata_server,
                config.global_segment_size,
                config.local_buffer_size,
                config.protocol,
                config.rdma_devices,
                address,
                **tenant,
            )
    except TypeError as e:
        if tenant and "tenant_id" in str(e):
            raise StoreError(f"tenant_id={config.tenant_id!r}: the installed Mooncake "
                             f"does not support tenants (upgrade it, or leave tenant_id "
                             f"unset): {e}") from e
        raise StoreError(f"Mooncake setup() against the master at {address} raised: {e}") \
            from e
    except Exception as e:  # a pybind argument or engine error
        raise StoreError(f"Mooncake setup() against the master at {address} raised: {e}") \
            from e
    if rc != 0:
        raise StoreError(
            f"Mooncake setup() against the master at {address} failed with code {rc} "
            f"({code_name(rc)}); protocol={config.protocol!r}, "
            f"metadata_server={config.metadata_server!r}, "
            f"global_segment_size={config.global_segment_size} (Mooncake needs at least "
            f"16 MiB, or 0), local_hostname={config.local_hostname!r}"
            + (f"; Mooncake said: {' | '.join(said[-3:])}" if said else "")
        )
    log.info("joined Mooncake store at %s (%s, %s)", address, config.protocol,
             config.metadata_server)
    return client
