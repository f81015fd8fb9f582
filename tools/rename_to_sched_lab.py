"""Convert a sched-lab checkout to install under one import name, ``sched_lab``.

    python tools/rename_to_sched_lab.py [ROOT]      # ROOT: the checkout (default: this one)

The folders stay where they are; only the import names change:

    lab/ -> sched_lab          policies/ -> sched_lab.policies     backend/ -> sched_lab.backend
    traces/ -> sched_lab.traces    experiments/ -> sched_lab.experiments
    profiles/ -> sched_lab.profiles

What it rewrites, in every tracked or untracked (not ignored) text file but this one and the
trace data:

* import statements: ``import lab.x``, ``from lab.x import``, ``from policies.y import``,
  ``import policies`` (-> ``from sched_lab import policies``, the local name kept), also inside
  strings and Markdown code blocks;
* dotted module names anywhere (strings given to importlib or ``mock.patch``, ``python -m
  lab.fidelity``, logger names, docstrings, YAML comments, the console script and the version
  attribute in pyproject.toml): ``lab.<module of lab/>``, ``backend.<module of backend/>``,
  ``traces.<module of traces/>``. ``policies.<name>`` is left alone outside import statements:
  it is also a config key path (``policies.fcfs.max_num_seqs``);
* pyproject.toml's ``[tool.setuptools]`` tables: the package list (every folder with an
  ``__init__.py``), ``package-dir`` and ``package-data``, regenerated from the tree;
* a few lines by hand (:data:`PATCHES`): where the bundled data is found, the Ray workers'
  PYTHONPATH, the layers test's module names.

It adds ``experiments/__init__.py`` and ``profiles/__init__.py`` (data-only packages, so that
``importlib.resources`` finds them in a checkout, an editable install and a wheel alike).

Running it again changes nothing. A hand patch whose old text is not found (the file changed
since) is listed at the end and the exit status is 1: apply that one by hand. Then the old names
still written in the tree are listed (for a look; most are paths like ``lab/config/paths.py``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

NEW = "sched_lab"
CODE = ("lab", "policies", "backend", "traces")  # folders of Python code
DATA = ("experiments", "profiles")  # folders of bundled data, packages of their own
TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini", ".rst", ""}
SKIP = ("traces/data/", "tools/rename_to_sched_lab.py")

DATA_INIT = {
    "experiments": '"""The bundled experiment YAMLs (data only: a package so that '
    'importlib.resources finds it)."""\n',
    "profiles": '"""The bundled engine profiles and their fits (data only: a package so that '
    'importlib.resources finds it)."""\n',
}


def new_name(top: str) -> str:
    return NEW if top == "lab" else f"{NEW}.{top}"


def module_names(root: Path, top: str) -> list[str]:
    """The first-level modules and packages of ``top`` (``core``, ``cli``, ...)."""
    folder = root / top
    names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    names |= {p.parent.name for p in folder.glob("*/__init__.py")}
    if top == "lab":
        names |= {"__version__", "__file__", "__path__"}
    return sorted(names, key=len, reverse=True)


def rules(root: Path) -> list[tuple[re.Pattern[str], str]]:
    """(pattern, replacement) pairs, applied in order to every line."""
    out: list[tuple[re.Pattern[str], str]] = []
    lead = r"""(?P<lead>^|[\s"'`(;>])"""
    for top in CODE:
        new = new_name(top)
        # from lab.x import y / from policies.fcfs import FCFS (anywhere: also in strings)
        out.append((re.compile(lead + rf"from {top}(?P<rest>(?:\.\w+)*) import "),
                    rf"\g<lead>from {new}\g<rest> import "))  # fmt: skip
        # import lab.x.y [as z] / import backend.runner
        out.append((re.compile(lead + rf"import {top}(?P<rest>(?:\.\w+)+)"),
                    rf"\g<lead>import {new}\g<rest>"))  # fmt: skip
        # a statement of its own: import policies [as p] -> from sched_lab import policies
        bare = rf"^(?P<ind>\s*)import {top}(?P<alias>\s+as\s+\w+)?(?P<end>\s*(?:#.*)?)$"
        repl = (rf"\g<ind>import {NEW}\g<alias>\g<end>" if top == "lab"
                else rf"\g<ind>from {NEW} import {top}\g<alias>\g<end>")  # fmt: skip
        out.append((re.compile(bare), repl))
        # import lab; print(lab.__file__) (in a string) -> import sched_lab; ...
        if top == "lab":
            out.append(
                (re.compile(lead + r"import lab(?P<end>;)"), rf"\g<lead>import {NEW}\g<end>")
            )
        # dotted names: lab.core.x, backend.attention.torch_ref, traces.loaders
        if top != "policies":
            names = "|".join(map(re.escape, module_names(root, top)))
            out.append((re.compile(rf"(?<![\w.\-/]){top}\.(?=(?:{names})\b)"), f"{new}."))
        # a logger by its package name: getLogger("traces"), caplog's logger="traces"
        out.append((re.compile(rf"""(?P<pre>(?:logger=|getLogger\()\s*)(?P<q>["']){top}(?P=q)"""),
                    rf"\g<pre>\g<q>{new}\g<q>"))  # fmt: skip
        # a module-name prefix: __module__.startswith("policies.")
        out.append((re.compile(rf"""(?P<pre>startswith\()(?P<q>["']){top}\.(?P=q)"""),
                    rf"\g<pre>\g<q>{new}.\g<q>"))  # fmt: skip
        # a name in a docstring role: :func:`traces.load_table`, :mod:`~policies.fcfs`
        out.append((re.compile(rf"(?P<role>:[a-z]+:`~?){top}\."), rf"\g<role>{new}."))
    return out


def rewrite(text: str, compiled: list[tuple[re.Pattern[str], str]]) -> str:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        for pattern, repl in compiled:
            line = pattern.sub(repl, line)
        lines[i] = line
    return "\n".join(lines)


def pyproject_tables(root: Path) -> str:
    """The ``[tool.setuptools]`` tables: every package folder mapped under ``sched_lab``."""
    packages = []
    for top in CODE + DATA:
        for init in sorted((root / top).rglob("__init__.py")):
            rel = init.parent.relative_to(root / top).parts
            packages.append(".".join((new_name(top), *rel)))
    listed = "".join(f'    "{p}",\n' for p in packages)
    dirs = "".join(f'"{new_name(t)}" = "{t}"\n' for t in CODE + DATA)
    return f"""[tool.setuptools]
# One import name, sched_lab, over the repository's top-level folders (package-dir below): in
# site-packages only sched_lab/ (its rooms, policies/, backend/, traces/ and the bundled data
# experiments/ and profiles/ inside it). Bundled data is found by package (lab/config/paths.py).
packages = [
{listed}]
include-package-data = false

[tool.setuptools.package-dir]
{dirs}
[tool.setuptools.package-data]
"{NEW}.traces" = ["data/*"]
"{NEW}.experiments" = ["*.yaml", "data/*"]
"{NEW}.profiles" = ["*.csv", "*.json"]

"""


def convert_pyproject(text: str, root: Path) -> str:
    start = text.index("[tool.setuptools]\n")
    end = text.index("[tool.setuptools.dynamic]")
    text = text[:start] + pyproject_tables(root) + text[end:]
    if "[tool.ruff.lint.isort]" not in text:  # sched_lab is no folder of the root: say it is ours
        text = text.rstrip("\n") + f'\n\n[tool.ruff.lint.isort]\nknown-first-party = ["{NEW}"]\n'
    return text


# (file, old text, new text): lines no pattern can convert. Applied after the rewrite rules,
# so an old text is written as the rules leave it.
PATCHES: list[tuple[str, str, str]] = [
    (
        "lab/config/paths.py",
        "from pathlib import Path\n\n"
        "DATA_ROOT = Path(__file__).resolve().parents[2]  # holds lab/, traces/data/, profiles/\n",
        "from importlib.resources import files\n"
        "from pathlib import Path\n\n"
        "# The folder holding the bundled experiments/, profiles/ and traces/ (packages of sched_lab):\n"
        "# the repository root in a checkout or an editable install, sched_lab/ in a wheel.\n"
        'DATA_ROOT = Path(str(files("sched_lab.profiles"))).parent\n',
    ),
    (
        "lab/sim/analytic_defaults.py",
        "from dataclasses import dataclass\nfrom pathlib import Path\n\n"
        "ROOT = Path(__file__).resolve().parents[2]\n",
        "from dataclasses import dataclass\nfrom importlib.resources import files\n"
        "from pathlib import Path\n\n"
        'ROOT = Path(str(files("sched_lab.profiles"))).parent  # holds profiles/ (see ROOT / rel)\n',
    ),
    (
        "lab/sweeps/executors.py",
        "from sched_lab.config.paths import DATA_ROOT\n",  # as the rules left it
        "",
    ),
    (
        "lab/sweeps/executors.py",
        "        if address is None:  # a local Ray: its workers import this checkout's lab\n"
        '            path = os.pathsep.join(p for p in (str(DATA_ROOT), os.environ.get("PYTHONPATH")) if p)\n',
        "        if address is None:  # a local Ray: its workers run this python and its sched_lab\n"
        '            path = os.environ.get("PYTHONPATH", "")\n',
    ),
    (
        "lab/sim/calibrated.py",
        'BUNDLED_PROFILES = Path(__file__).resolve().parents[2] / "profiles"  # installed beside lab/\n',
        'BUNDLED_PROFILES = Path(str(files("sched_lab.profiles")))  # a checkout\'s, or in the wheel\n',
    ),
    (
        "lab/sim/calibrated.py",
        "from dataclasses import fields\nfrom pathlib import Path\n",
        "from dataclasses import fields\nfrom importlib.resources import files\nfrom pathlib import Path\n",
    ),
    (
        "lab/sweeps/run.py",
        '    loggers = [logging.getLogger(n) for n in ("lab", "traces")]\n',
        '    loggers = [logging.getLogger("sched_lab")]  # traces and backend included\n',
    ),
    (  # a package in the cwd named as the lab's import name must not shadow it
        "tests/test_bad_inputs.py",
        '        (tmp_path / "lab").mkdir()\n'
        '        (tmp_path / "lab" / "__init__.py").write_text("")\n',
        '        (tmp_path / "sched_lab").mkdir()\n'
        '        (tmp_path / "sched_lab" / "__init__.py").write_text("")\n',
    ),
    (
        "tests/test_layers.py",
        'PACKAGES = ("lab", "policies", "backend", "traces")\n',
        "# The folders of code and their import names.\n"
        "PACKAGES = {\n"
        '    "lab": "sched_lab",\n'
        '    "policies": "sched_lab.policies",\n'
        '    "backend": "sched_lab.backend",\n'
        '    "traces": "sched_lab.traces",\n'
        "}\n",
    ),
    (
        "tests/test_layers.py",
        "def layer(module: str) -> str:\n"
        '    parts = module.split(".")\n'
        '    if parts[0] in ("policies", "traces"):\n'
        "        return parts[0]\n"
        '    if parts[0] == "backend":\n'
        '        return "engine"\n'
        '    if module == "lab":',
        "def layer(module: str) -> str:\n"
        '    parts = module.split(".")\n'
        '    assert parts[0] == "sched_lab", module\n'
        '    parts = parts[1:] or [""]\n'
        '    if parts[0] in ("policies", "traces"):\n'
        "        return parts[0]\n"
        '    if parts[0] == "backend":\n'
        '        return "engine"\n'
        '    if module == "sched_lab":',
    ),
    (
        "tests/test_layers.py",
        '    if parts[1] == "cli":\n'
        '        return "cli"\n'
        '    assert parts[1] in ROOMS, f"{module}: a module of lab/ outside its rooms {ROOMS}"\n'
        "    return parts[1]\n",
        '    if parts[0] == "cli":\n'
        '        return "cli"\n'
        '    assert parts[0] in ROOMS, f"{module}: a module of lab/ outside its rooms {ROOMS}"\n'
        "    return parts[0]\n",
    ),
    (
        "tests/test_layers.py",
        "    for pkg in PACKAGES:\n"
        '        for path in sorted((ROOT / pkg).rglob("*.py")):\n'
        '            parts = list(path.relative_to(ROOT).with_suffix("").parts)\n'
        '            if parts[-1] == "__init__":\n'
        "                parts.pop()\n"
        '            out[".".join(parts)] = path\n',
        "    for folder, name in PACKAGES.items():\n"
        '        for path in sorted((ROOT / folder).rglob("*.py")):\n'
        '            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]\n'
        '            if parts[-1] == "__init__":\n'
        "                parts.pop()\n"
        '            out[".".join(parts)] = path\n',
    ),
    (
        "tests/test_layers.py",
        'assert root in stdlib or root in ("lab", "__future__")',
        'assert root in {*stdlib, "sched_lab", "__future__"}',
    ),
    (
        "tests/test_layers.py",
        'sys.modules.pop("policies.zz_test_discovered", None)',
        'sys.modules.pop("sched_lab.policies.zz_test_discovered", None)',
    ),
]

# Old names that may remain by design: paths (lab/config/paths.py), config key paths
# (policies.fcfs.max_num_seqs) and words.
LEFTOVER = re.compile(
    r"""(?<![\w.\-/])(?:(?:lab|backend|traces)\.[a-z_]+\b(?!/)"""
    r"""|(?<!from sched_lab )(?:from|import) (?:lab|policies|backend|traces|experiments|profiles)\b(?![\w/-]))"""
)


def text_files(root: Path) -> list[Path]:
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    out = []
    for rel in listed:
        path = root / rel
        if not rel or rel.startswith(SKIP) or path.suffix not in TEXT or not path.is_file():
            continue
        out.append(path)
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parents[1]).resolve()
    if not (root / "lab" / "__init__.py").is_file():
        print(f"{root}: not a sched-lab checkout (no lab/__init__.py)", file=sys.stderr)
        return 2
    for top, doc in DATA_INIT.items():
        init = root / top / "__init__.py"
        if not init.exists():
            init.write_text(doc)
            print(f"added {init.relative_to(root)}")
    compiled = rules(root)
    changed = []
    for path in text_files(root):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        new = rewrite(text, compiled)
        if path.relative_to(root).as_posix() == "pyproject.toml":
            new = convert_pyproject(new, root)
        if new != text:
            path.write_text(new)
            changed.append(path.relative_to(root).as_posix())
    missed = []
    for rel, old, new in PATCHES:
        path = root / rel
        text = path.read_text()
        if new and new in text:  # applied before
            continue
        if old not in text:
            if not new:  # a removal already done
                continue
            missed.append(f"{rel}: not found (apply by hand):\n{old}")
            continue
        path.write_text(text.replace(old, new))
        if rel not in changed:
            changed.append(rel)
    print(f"rewrote {len(changed)} files")
    code = [str(root / rel) for rel in changed if rel.endswith(".py")]
    if code:  # import order (sched_lab.policies now sorts among the rooms) and line breaks
        ruff = [sys.executable, "-m", "ruff"]
        subprocess.run([*ruff, "check", "-q", "--fix", "--select", "I001", *code], cwd=root)
        subprocess.run([*ruff, "format", "-q", *code], cwd=root)
    for path in text_files(root):
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if LEFTOVER.search(line):
                print(f"old name left: {path.relative_to(root)}:{i}: {line.strip()[:120]}")
    for m in missed:
        print("PATCH MISSED", m, file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
