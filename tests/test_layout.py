"""The package's layout shows its data flow, bottom up: memory -> row moves -> descriptors ->
store -> mover / direct transfer, with the tools and engine integrations on top. Imports go
one way (no cycle, lazy imports inside functions included; nothing imports a level above
its own), the copy path never reaches the tuner, kernels know nothing of the host side, the
root of ``kvmove/`` holds the data path only, no module is named like a function it
exports, and a plain copy of the source tree imports without being installed."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"kvmove": ROOT / "kvmove"}

# Each module's level (the longest matching prefix decides); an import may only go to the
# same level or one below.
LEVELS = {
    "kvmove.errors": 0, "kvmove.status": 0, "kvmove.checks": 0, "kvmove.kernels": 0,
    "kvmove.metrics": 0,
    "kvmove.memory": 1,
    "kvmove.rows": 2,
    "kvmove.objects": 3,
    "kvmove.tuning": 4,
    "kvmove.store": 5,
    "kvmove.mover": 6,
    "kvmove.direct": 6,
    "kvmove.cli": 7, "kvmove.integrations": 7,
    "kvmove": 7,  # the package root re-exports the public API: only tools import it
}
ROOT_MODULES = {"__init__", "errors", "status", "checks"}
ROOT_PACKAGES = {"kernels", "metrics", "memory", "rows", "objects", "tuning", "store", "mover",
                 "direct", "cli", "integrations"}


def level_of(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LEVELS:
            return LEVELS[prefix]
    raise AssertionError(f"{module} has no level in LEVELS")


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every kvmove module ``name`` imports, at any depth of its code (lazy imports too)."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".") if is_package else name.split(".")[:-1]
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            subs = [f"{base}.{a.name}" for a in node.names]
            # ``from kvmove import cuda_api`` imports the module, not the package's exports
            targets = subs if all(m in known for m in subs) else [base, *subs]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycle_in(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m):], m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_imports_have_no_cycle():
    # The package's __init__ re-exports the public names: it imports everything, and
    # nothing inside the package may import it back.
    g = {n: {m for m in deps if m != "kvmove"} for n, deps in graph().items()}
    assert cycle_in(g) is None, f"import cycle: {' -> '.join(cycle_in(g))}"


def test_nothing_imports_a_level_above_its_own():
    upward = sorted(f"{n} ({level_of(n)}) -> {m} ({level_of(m)})"
                    for n, deps in graph().items() for m in deps if level_of(m) > level_of(n))
    assert upward == [], "imports that run up the data path:\n" + "\n".join(upward)


def test_the_root_holds_the_data_path_only():
    folder = ROOT / "kvmove"
    modules = {p.stem for p in folder.glob("*.py")}
    packages = {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    assert modules == ROOT_MODULES
    assert packages == ROOT_PACKAGES - ({"direct"} - packages)


def test_a_plain_copy_of_the_source_tree_imports_without_install(tmp_path):
    # What a user gets from `git archive` (or a checkout) on PYTHONPATH, nothing installed.
    shutil.copytree(ROOT / "kvmove", tmp_path / "kvmove",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    code = ("import sys, torch, kvmove, kvmove.kernels.row_copy, kvmove.cli.command\n"
            "assert kvmove.__file__.startswith(sys.argv[1]), kvmove.__file__\n"
            "assert kvmove.kernels.row_copy.__file__.startswith(sys.argv[1])\n"
            "kv = kvmove.KVCache({'kv': torch.zeros(2, 8, 4, dtype=torch.uint8)})\n"
            "print(kvmove.StagingBuffer(kv, num_slots=2, page_tokens=4).num_rows)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)},
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "8"


def test_the_copy_path_never_reaches_the_tuner():
    g = graph()
    below = [n for n in g if n.startswith(("kvmove.rows", "kvmove.kernels"))
             or n in ("kvmove.memory.cache", "kvmove.memory.staging", "kvmove.objects.descriptors")]

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for m in g.get(todo.pop(), ()):
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return seen

    for n in below:
        assert not any(m.startswith("kvmove.tuning") for m in reach(n)), n


def test_kernels_know_nothing_of_the_host_side():
    for name, deps in graph().items():
        if name.startswith("kvmove.kernels"):
            assert all(d.startswith("kvmove.kernels") for d in deps), (name, deps)


def test_no_module_is_named_like_a_function_it_exports():
    clashes = []
    for name, path in modules().items():
        leaf = name.rpartition(".")[2]
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        if leaf in defined:
            clashes.append(name)
    assert clashes == []


def test_autotune_runs_when_a_mover_is_built_never_in_a_copy_call(monkeypatch, store):
    import torch

    import kvmove
    from kvmove.mover import kv_mover as mover_module
    from kvmove.tuning import autotune

    monkeypatch.setenv(autotune.ENV_AUTOTUNE, "1")
    calls = []
    real = mover_module.tune_for_copies
    monkeypatch.setattr(mover_module, "tune_for_copies",
                        lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    monkeypatch.setattr(autotune, "tune_key", lambda *a, **k: calls.append("tuned inside"))
    kv = kvmove.KVCache({"kv": torch.zeros(2, 64, 656, dtype=torch.uint8)})
    with kvmove.KVMover(kv, store, page_tokens=16, staging_slots=4, path="staged") as mover:
        built = len(calls)
        assert mover.evict(["a"], torch.arange(16).reshape(1, 16)).wait(30) == [
            kvmove.Status.OK]
        mover.prefetch(["a"], torch.arange(16, 32).reshape(1, 16)).wait(30)
        st = kvmove.StagingBuffer(kv, num_slots=2, page_tokens=16)
        kvmove.gather(kv, st, torch.arange(16).reshape(1, 16), torch.tensor([0]))
        kvmove.scatter(st, torch.tensor([0]), kv, torch.arange(16).reshape(1, 16))
    assert built == 1  # (on a CPU it finds nothing to tune)
    assert len(calls) == built and "tuned inside" not in calls


def test_the_package_exports_load_lazily_and_name_their_submodules():
    code = (
        "import sys, kvmove\n"
        "assert 'torch' not in sys.modules, 'import kvmove imported torch'\n"
        "assert kvmove.status.BAD_ROWS < 0 and callable(kvmove.describe)\n"
        "assert kvmove.KVMover.__module__ == 'kvmove.mover.kv_mover'\n"
        "try:\n"
        "    kvmove.no_such_name\n"
        "except AttributeError:\n"
        "    print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
