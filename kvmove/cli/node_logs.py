"""The end of a multi-process demo: every process's exit code checked, and the folder of
their logs removed when the demo passed, kept (its path printed) when it failed."""

from __future__ import annotations

import shutil
from pathlib import Path


def settle(console, logs: Path, exit_codes: list, ok: bool, verbose: bool) -> bool:
    """Whether the demo passed: ``ok`` and every process exited 0. Removes ``logs`` if so,
    else prints where they are (unless ``verbose``: the processes logged to the terminal)."""
    if any(exit_codes):
        console.print(f"[bold red]process exit codes[/]: {exit_codes}")
        ok = False
    if ok:
        shutil.rmtree(logs, ignore_errors=True)
    elif not verbose:
        console.print(f"logs of the processes: {logs}")
    return ok
