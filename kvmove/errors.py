"""Exception classes of kvmove. Invalid arguments raise the built-in
``ValueError`` / ``TypeError`` / ``IndexError``; these are for run-time conditions."""


class KVMoveError(Exception):
    """Base class of every kvmove run-time error."""


class StagingFull(KVMoveError):
    """The staging pool has fewer free slots than were asked for."""


class StagingInUse(KVMoveError):
    """The staging cannot be closed: slots are still allocated to transfers."""


class StoreError(KVMoveError):
    """The Mooncake store cannot be reached or set up."""
