"""The OpenMP variables as torch's runtime read them. The runtime reads them (how its
threads wait between parallel regions) once, when torch loads it, and kvmove's CPU copies
choose by them (:mod:`kvmove.rows.torch_backend.host_copy`). kvmove's modules load lazily,
maybe after the caller changed a variable, so the package keeps the variables as they
were when torch loaded:

- torch already loaded when kvmove is imported: as they are then (a change made between
  the two imports is not seen: nothing records it);
- otherwise: as they are when torch's import starts, seen by a finder first on
  ``sys.meta_path`` that looks at the name asked for and finds nothing itself (it notes
  every search for torch until torch is loaded: the last one is the import).

Standard library only: ``import kvmove`` does not import torch.
"""

from __future__ import annotations

import os
import sys

VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")

_at_load: dict[str, str] | None = None  # as torch loaded with them, once seen


def _now() -> dict[str, str]:
    return {name: os.environ[name] for name in VARIABLES if name in os.environ}


class _TorchImportWatch:
    """Records the variables when torch's import starts: a meta path finder (duck-typed:
    ``importlib.abc`` costs 8 ms of import time). Stays on ``sys.meta_path`` (taking
    a finder out while the import system walks the list would skip the next one); once it
    has seen torch it answers every name by doing nothing."""

    def find_spec(self, fullname, path=None, target=None):
        global _at_load
        # Each search for torch until it is loaded: the last is its import (a library may
        # look for it earlier without importing it: importlib.util.find_spec).
        if fullname == "torch" and "torch" not in sys.modules:
            _at_load = _now()
        return None  # never finds a module: the next finder does


def watch() -> None:
    """Start keeping the variables (``kvmove``'s import calls this once)."""
    global _at_load
    if "torch" in sys.modules:
        _at_load = _now()
    elif not any(isinstance(f, _TorchImportWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportWatch())


def as_torch_loaded() -> dict[str, str]:
    """The variables as torch's runtime read them (as they are now, where torch has not
    loaded yet)."""
    return _now() if _at_load is None else dict(_at_load)
