"""The ``kvmove`` command and its tools (demo, cluster demo, master, doctor, tune), apart
from the library: they use the public API and the store's public functions only. Building
the parser imports no torch (``kvmove --help`` is fast)."""
