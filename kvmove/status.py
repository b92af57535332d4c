"""Per-key outcome of a store operation, and the mapping from Mooncake's codes."""

from __future__ import annotations

import enum


class Status(enum.Enum):
    """Outcome of one key of a put, get or remove."""

    OK = "ok"
    MISS = "miss"  # get / remove: no such key (or its put has not finished yet)
    EXISTS = "exists"  # put: key already stored; the stored object is kept
    NO_SPACE = "no_space"  # put: the store has no room
    SIZE_MISMATCH = "size_mismatch"  # get: stored object is not the described size
    FAILED = "failed"  # anything else (transport, RPC, lease, corrupt object, ...)

    @property
    def ok(self) -> bool:
        return self is Status.OK


# Mooncake error codes (mooncake-transfer-engine 0.3.13).
NO_SPACE_CODES = frozenset({-200})
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703  # the key's put has not finished yet
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
CHECKSUM_MISMATCH = -801
RPC_FAIL = -900
RPC_TIMEOUT = -901
# kvmove's code for the keys of a Mooncake call that raised instead of answering
# (Mooncake itself uses -1 for INTERNAL_ERROR; either way the key FAILED).
CLIENT_EXCEPTION = -1
# kvmove's codes for keys that FAILED before reaching the store (never Mooncake's):
BAD_ROWS = -10001  # a row index of the key's page was out of range (check=False, device indices)
STAGING_TIMEOUT = -10002  # no staging slots came free within the mover's alloc_timeout
# kvmove's codes for pages of a direct send (kvmove.PageSender) that FAILED:
WRITE_TIMEOUT = -10003  # a write to the receiver did not return within the call timeout
NOT_SENT = -10004  # not tried: an earlier write to the same receiver had failed, or the
# sender was closed while the send was split into pieces
CALL_TIMEOUT = -10005  # the store call timed out at its bound (or not tried after one did)
MOVER_CLOSED = -10006  # not tried: the KVMover was closed while the call was being split up

CODE_NAMES = {
    CLIENT_EXCEPTION: "INTERNAL_ERROR",
    BAD_ROWS: "KVMOVE_BAD_ROWS",
    STAGING_TIMEOUT: "KVMOVE_STAGING_TIMEOUT",
    WRITE_TIMEOUT: "KVMOVE_WRITE_TIMEOUT",
    NOT_SENT: "KVMOVE_NOT_SENT",
    CALL_TIMEOUT: "KVMOVE_CALL_TIMEOUT",
    MOVER_CLOSED: "KVMOVE_MOVER_CLOSED",
    -200: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    LEASE_EXPIRED: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    CHECKSUM_MISMATCH: "CHECKSUM_MISMATCH",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}


def code_name(code: int) -> str:
    """A readable name of a Mooncake result code, for logs."""
    if code >= 0:
        return "OK"
    return CODE_NAMES.get(code, f"ERROR_{code}")
