"""The package's layout shows its data flow: imports go one way (no cycle, lazy imports
inside functions included), the copy path never reaches the tuner, and no module is named
like a function it exports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"kvmove": ROOT / "kvmove", "kvmove.kernels": ROOT / "kernels"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if name.startswith("kvmove.kernels.") and package == "kvmove":
                continue
            found[name] = path
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


def test_nothing_below_the_public_api_imports_the_package_root():
    # Applications built on the public API may use it as users do.
    apps = {"demo", "cluster_demo", "cluster_node", "cli", "doctor", "master_command",
            "integrations"}
    users = sorted(n for n, deps in graph().items() if "kvmove" in deps
                   and n.split(".")[1] not in apps)
    assert users == [], f"modules that import the kvmove package itself: {users}"


def test_the_copy_path_never_reaches_the_tuner():
    g = graph()
    below = [n for n in g if n.startswith(("kvmove.rows", "kvmove.kernels"))
             or n in ("kvmove.cache", "kvmove.staging", "kvmove.descriptors")]

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
    from kvmove import mover as mover_module
    from kvmove.tuning import autotune

    monkeypatch.setenv(autotune.ENV_AUTOTUNE, "1")
    calls = []
    real = mover_module.tune_for_copies
    monkeypatch.setattr(mover_module, "tune_for_copies",
                        lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    monkeypatch.setattr(autotune, "tune_key", lambda *a, **k: calls.append("tuned inside"))
    kv = kvmove.KVCache({"kv": torch.zeros(2, 64, 656, dtype=torch.uint8)})
    with kvmove.KVMover(kv, store, page_tokens=16, staging_slots=4) as mover:
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
        "assert kvmove.KVMover.__module__ == 'kvmove.mover'\n"
        "try:\n"
        "    kvmove.no_such_name\n"
        "except AttributeError:\n"
        "    print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
