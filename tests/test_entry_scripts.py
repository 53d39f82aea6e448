"""The front door: the README's two commands, what CI runs, and what each entry script installs.

A fresh clone has an empty ``.venv``: each command must install what it runs. The demo runs
``resilient-fsdp local``, so the extra it installs must hold every package that command (and the
pods it starts) imports; CI runs the README's commands in the README's order.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib

from tests.support import REPO
from tests.test_layout import import_graph, imported, ours

# What `resilient-fsdp local` runs in this process, and what its pods run (`python -m`).
LOCAL_ROOTS = ("resilient_fsdp.local.job", "resilient_fsdp.resilience.agent", "resilient_fsdp.train.__main__")


def readme_commands() -> list[str]:
    """The commands of the README's first code block, comments removed."""
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)[1]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_the_readme_starts_with_the_demo_then_the_tests():
    assert readme_commands() == ["./scripts/demo", "./scripts/test"]


def test_ci_runs_the_readmes_commands_in_its_order():
    commands = [
        line.strip()
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#") and "scripts/" in line
    ]
    assert [c.removeprefix("exec ").strip() for c in commands] == readme_commands()


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(spec: str) -> str:
    return _canonical(re.match(r"[A-Za-z0-9_.-]+", spec)[0])


def distributions_of(extra: str) -> set[str]:
    """The distributions ``pip install .[extra]`` brings directly: the base dependencies, the
    extra's, and those of the extras it names (``resilient-fsdp[chart,report]``)."""
    project = _project()
    found = {_requirement_name(d) for d in project["dependencies"]}
    pending, seen = [extra] if extra else [], set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        for spec in project["optional-dependencies"][name]:
            own = re.match(r"resilient-fsdp\[(.*)\]", spec)
            if own:
                pending += [e.strip() for e in own[1].split(",")]
            else:
                found.add(_requirement_name(spec))
    return found


def demo_extra() -> str:
    m = re.search(r"^ensure_venv (\S+)", (REPO / "scripts" / "demo").read_text(), re.M)
    assert m, "scripts/demo must call ensure_venv with the extra it needs"
    return m[1].strip("\"'")


def reachable(roots: tuple[str, ...]) -> set[str]:
    """Every module of the package that importing ``roots`` can load, function-level imports included."""
    graph, seen, pending = import_graph(), set(), list(roots)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        pending += sorted(graph[name])
    return seen


def test_the_demo_installs_every_package_resilient_fsdp_local_imports():
    to_distribution = importlib.metadata.packages_distributions()
    needed: dict[str, str] = {}
    for name in reachable(LOCAL_ROOTS):
        for module, line in imported(name):
            top = module.split(".")[0]
            if ours(module) or top in sys.stdlib_module_names or top == "resilient_fsdp":
                continue
            for dist in to_distribution.get(top, [top]):
                needed.setdefault(_canonical(dist), f"{name} line {line}: import {module}")
    installed = distributions_of(demo_extra())
    # What the installed distributions bring along (helm-python-sdk's own imports and the like)
    # is theirs to declare; only what this package imports must be declared by it.
    missing = {
        dist: where for dist, where in needed.items() if dist not in installed and not _required_by(dist, installed)
    }
    assert missing == {}, (
        f"scripts/demo installs .[{demo_extra()}], which lacks what `resilient-fsdp local` imports: {missing}"
    )
    assert "helm-python-sdk" in installed  # local renders the chart


def _required_by(dist: str, installed: set[str]) -> bool:
    """Whether ``dist`` comes with one of ``installed`` (a dependency of a dependency)."""
    for owner in installed:
        try:
            requires = importlib.metadata.requires(owner) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        if any(_requirement_name(r) == dist and "extra ==" not in r for r in requires):
            return True
    return False


def test_the_venv_helpers_cover_table_matches_pyprojects_extras():
    """``scripts/lib/venv.sh`` skips an install another install already holds; its table must say
    what pyproject.toml's extras really include."""
    text = (REPO / "scripts" / "lib" / "venv.sh").read_text()
    table = dict(re.findall(r"\[(\w+)\]=\"([^\"]*)\"", re.search(r"declare -A EXTRAS_COVER=\((.*)\)", text)[1]))
    project = _project()
    extras = set(project["optional-dependencies"])
    for extra, covered in table.items():
        assert extra in extras, f"EXTRAS_COVER names {extra!r}, which pyproject.toml does not define"
        for other in covered.split():
            want = distributions_of("" if other == "base" else other)
            assert want <= distributions_of(extra), f"[{extra}] does not hold all of {other!r}"


def test_an_install_without_the_chart_extra_names_it(tmp_path):
    """A command that needs a missing extra says which and how, and exits 2."""
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def refuse(name, *a, **k):\n"
        "    if name.split('.')[0] == 'helm_python': raise ImportError(name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = refuse\n"
        "from resilient_fsdp.cli import main\n"
        f"sys.exit(main(['local', '--run-dir', {str(tmp_path / 'run')!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert "the chart commands need the `chart` extra: pip install -c constraints.txt -e '.[chart]'" in proc.stderr
