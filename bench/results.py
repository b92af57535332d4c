"""The results file: ``RESULTS_DIR/<machine>-<date>[-quick].json``, one JSON object with
the machine, the settings, one record per kernel case and the optional suites' results."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

SCHEMA = "kvmove-bench/1"
RESULTS_DIR = Path(__file__).with_name("results")


def today() -> str:
    return datetime.date.today().strftime("%Y%m%d")


def results_path(out_dir: Path, machine: str, *, quick: bool) -> Path:
    return Path(out_dir) / f"{machine}-{today()}{'-quick' if quick else ''}.json"


def new(machine: dict, settings: dict, command: str) -> dict:
    return {
        "schema": SCHEMA,
        "machine": machine,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "settings": settings,
        "kernels": [],
        "suites": {},
    }


def save(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def load(path: Path) -> dict:
    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a kvmove benchmark results file (schema "
                         f"{data.get('schema')!r}, expected {SCHEMA!r})")
    return data


def finish_suite(result: dict, report, json_path: Path | None) -> int:
    """The end of a suite's ``main``: print its report (``report(result, console)``), write
    its JSON where asked (``--json``); the exit code."""
    from rich.console import Console

    report(result, Console())
    if json_path is not None:
        save(result, json_path)
    return 0
