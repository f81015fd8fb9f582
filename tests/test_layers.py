"""The rooms and their import layers (docs/ARCHITECTURE.md): the core at the ground; policies,
simulator, engine and traces on it; config; then results, setup, report, run, sweeps and
fidelity; the CLI on top. Read from the source with ast, function-level (lazy) imports
included, so a lazy import cannot hide a wrong edge or a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

from sched_lab import policies
from sched_lab.core.scheduler import policy_names

ROOT = Path(__file__).resolve().parent.parent
# The folders of code and their import names.
PACKAGES = {
    "lab": "sched_lab",
    "policies": "sched_lab.policies",
    "backend": "sched_lab.backend",
    "traces": "sched_lab.traces",
}

# The rooms, bottom to top, and what each may import (itself included). The ground: the core
# (plain Python); above it the four that use only the core; then the typed config; then the
# rooms by job. A room imports only from rooms below it: nothing runs up.
ALLOWED = {
    "core": {"core"},
    "policies": {"core", "policies"},
    "sim": {"core", "sim"},
    "engine": {"core", "engine"},
    "traces": {"core", "traces"},
    "config": {"core", "policies", "sim", "traces", "config"},
}
BELOW_RESULTS = {"core", "policies", "sim", "engine", "traces", "config"}
ALLOWED["results"] = BELOW_RESULTS - {"engine"} | {"results"}
ALLOWED["setup"] = BELOW_RESULTS | {"results", "setup"}
ALLOWED["report"] = ALLOWED["setup"] | {"report"}
ALLOWED["run"] = ALLOWED["report"] | {"run"}
ALLOWED["sweeps"] = ALLOWED["run"] | {"sweeps"}
ALLOWED["fidelity"] = ALLOWED["run"] | {"fidelity"}
ALLOWED["client"] = set(ALLOWED) | {"client"}  # sched-lab bench / compare: a top room
ALLOWED["serve"] = ALLOWED["sweeps"] | {"serve"}  # sched-lab serve: a top room like the CLI
ALLOWED["cli"] = set(ALLOWED) | {"cli"}
ROOMS = (
    "core", "sim", "config", "results", "setup", "report", "run", "sweeps", "fidelity", "client",
    "serve",
)  # fmt: skip


def layer(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "sched_lab", module
    parts = parts[1:] or [""]
    if parts[0] in ("policies", "traces"):
        return parts[0]
    if parts[0] == "backend":
        return "engine"
    if module == "sched_lab":  # lab/__init__.py: the version string, importable from every room
        return "core"
    if parts[0] == "cli":
        return "cli"
    assert parts[0] in ROOMS, f"{module}: a module of lab/ outside its rooms {ROOMS}"
    return parts[0]


def modules() -> dict[str, Path]:
    out = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def project_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules that ``name`` imports anywhere in its source."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for t in targets:
            while t and t not in known:  # a name inside a module: the module itself
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: project_imports(name, path, known) for name, path in mods.items()}


def test_imports_point_one_way():
    bad = [
        f"{m} ({layer(m)}) imports {t} ({layer(t)})"
        for m, targets in graph().items()
        for t in sorted(targets)
        if layer(t) not in ALLOWED[layer(m)]
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                return stack[stack.index(t) :] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (cycle := visit(m)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_core_imports_no_third_party_io():
    """The core is pure Python: the standard library only (no numpy, pandas, torch, yaml)."""
    import sys

    stdlib = set(sys.stdlib_module_names)
    for name, path in modules().items():
        if layer(name) != "core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            for root in roots:
                assert root in {*stdlib, "sched_lab", "__future__"}, f"{name} imports {root}"


def test_every_policy_module_is_discovered():
    """Every module in policies/ registers a policy when the package is imported."""
    files = {p.stem for p in Path(policies.__file__).parent.glob("*.py") if p.stem != "__init__"}
    registered_modules = {
        policies.get_policy(n).__module__.rpartition(".")[2]
        for n in policy_names()
        if policies.get_policy(n).__module__.startswith("sched_lab.policies.")
    }
    assert files <= registered_modules, files - registered_modules


def test_new_policy_file_is_discovered(tmp_path, monkeypatch):
    """A new file in policies/ is a new policy: no list to edit."""
    import sys

    from sched_lab.core import scheduler

    (tmp_path / "zz_test_discovered.py").write_text(
        "from sched_lab.core.scheduler import register_policy\n"
        "from sched_lab.policies.fcfs import FCFS\n\n\n"
        "@register_policy('zz_test_discovered')\n"
        "class Discovered(FCFS):\n    pass\n"
    )
    monkeypatch.setattr(policies, "__path__", [*policies.__path__, str(tmp_path)])
    try:
        policies.discover()
        assert "zz_test_discovered" in policy_names()
        assert policies.get_policy("zz_test_discovered").__name__ == "Discovered"
    finally:
        scheduler.POLICIES.pop("zz_test_discovered", None)
        sys.modules.pop("sched_lab.policies.zz_test_discovered", None)


def test_broken_policy_file_is_one_line(tmp_path, monkeypatch):
    """A policy file that cannot be imported (here: a syntax error) stops every run with one
    line naming it, not a traceback at import."""
    import pytest

    from sched_lab.config import validate
    from sched_lab.core.errors import ConfigError

    (tmp_path / "zz_test_broken.py").write_text("def oops(:\n    pass\n")
    monkeypatch.setattr(policies, "__path__", [*policies.__path__, str(tmp_path)])
    monkeypatch.setattr(policies, "BROKEN", {})
    policies.discover()
    assert list(policies.BROKEN) == [f"{tmp_path}/zz_test_broken.py"]
    trace = {"format": "synthetic", "num_requests": 2, "arrival": {"process": "poisson",
             "rate": 1.0}, "prompt_len": 4, "output_len": 2}  # fmt: skip
    with pytest.raises(ConfigError, match=r"zz_test_broken\.py: the policy module cannot be "
                       r"imported \(SyntaxError: "):  # fmt: skip
        validate({"name": "x", "trace": trace})


def test_backend_names_are_compared_only_in_setup():
    """A backend is one module of lab/setup/: no other module asks which backend runs."""
    import re

    compare = re.compile(r"""backend\s*[!=]=\s*["']|["']\s*[!=]=\s*\S*backend\b""")
    bad = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for name, path in modules().items()
        if layer(name) != "setup"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if compare.search(line)
    ]
    assert not bad, "\n".join(bad)


def test_lab_top_level_is_small():
    """lab/ holds its rooms; at its top only the package and the CLI."""
    files = sorted(p.name for p in (ROOT / "lab").glob("*.py"))
    assert files == ["__init__.py", "cli.py"], files
