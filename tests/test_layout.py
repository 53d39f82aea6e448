"""The package's layout rules, read from the source with ``ast`` so that they stay true.

- no import circles, module-level or inside functions;
- the pod side imports nothing of the workstation, the simulator or the measurements;
- NVRx is imported, and worked around, only in the modules named for it;
- files are replaced in place only through ``atomic.py``;
- the ``fault_tolerance:`` settings of the chart and of the local launcher agree;
- one concept per module: every package's docstring names each of its modules;
- ``tests/`` mirrors the package.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.support import REPO

PACKAGE = REPO / "train" / "resilient_fsdp"
# What runs in a pod, and what it may never import.
POD_SIDE = (
    "resilient_fsdp.config",
    "resilient_fsdp.atomic",
    "resilient_fsdp.train",
    "resilient_fsdp.data",
    "resilient_fsdp.hf",
    "resilient_fsdp.checkpoint",
    "resilient_fsdp.resilience",
)
NOT_IN_PODS = (
    "resilient_fsdp.local",
    "resilient_fsdp.deploy",
    "resilient_fsdp.bench",
    "resilient_fsdp.goodput",
    "resilient_fsdp.cli",
)
# The only modules that import nvidia_resiliency_ext or adapt to it, each named for what it wraps.
NVRX_MODULES = {
    "resilient_fsdp.checkpoint.writer.process",
    "resilient_fsdp.checkpoint.writer.worker",
    "resilient_fsdp.checkpoint.writer.dcp_plan",
    "resilient_fsdp.resilience.nvrx",
    "resilient_fsdp.resilience.inprocess",
    "resilient_fsdp.resilience.rank_monitor",
    "resilient_fsdp.bench.gpu.nvrx_local",
    "resilient_fsdp.resilience.straggler_detector",
}
# Names that only code adapting to NVRx's internals has reason to use: its CPU-only worker mode,
# its local (CUDA-free) polling, its 0.7 health checks, its private queue and worker handles, its
# plan cache's fields.
NVRX_INTERNALS = {
    "cpu_shm_mode",
    "no_dist",
    "restart_health_check",
    "_async_calls_queue",
    "persistent_caller",
    "_set_calculated_timeouts",
    "cached_central_plan",
    "cached_local_plan",
    "cached_global_metadata",
    "validated_cache_reuse",
}
# Calls that replace, rename or flush files: only the atomic-write helper makes them.
FILE_COMMIT_CALLS = {("os", "replace"), ("os", "rename"), ("os", "fsync"), ("os", "link"), ("shutil", "move")}
TOP_LEVEL = {"__init__", "atomic", "cli"}
# The top-level packages: the pod side, then the workstation side.
PACKAGES = {"config", "train", "data", "hf", "checkpoint", "resilience", "local", "deploy", "bench", "goodput"}


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text())


def is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def resolve(importer: str, level: int, module: str | None) -> str:
    """The absolute name a relative ``from`` import in ``importer`` refers to."""
    base = importer.split(".")
    if not is_package(importer):
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


def imported(name: str) -> list[tuple[str, int]]:
    """(module, line) for every import in ``name``, anywhere in the file (functions included), as
    absolute names; ``from X import y`` counts as importing ``X.y`` when that is a module."""
    out = []
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, node.level, node.module) if node.level else node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in modules() else base, node.lineno))
        elif isinstance(node, ast.Call) and _literal_import(node):
            out.append((node.args[0].value, node.lineno))
    return out


def _literal_import(node: ast.Call) -> bool:
    """``importlib.import_module("...")`` or ``__import__("...")`` with a literal name."""
    fn = node.func
    named = (isinstance(fn, ast.Attribute) and fn.attr == "import_module") or (
        isinstance(fn, ast.Name) and fn.id in ("import_module", "__import__")
    )
    return named and bool(node.args) and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)


def ours(module: str) -> str | None:
    """The module of this package that importing ``module`` loads last, or None."""
    while module and module not in modules():
        module = module.rpartition(".")[0]
    return module or None


def ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it makes Python execute: the target and the target's packages
    (their ``__init__`` runs first), except the importer's own packages, which are already loading."""
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for name in modules():
        own = set(ancestors(name)) | {name}
        for module, _ in imported(name):
            target = ours(module)
            if target is None:
                continue
            graph[name] |= {m for m in [*ancestors(target), target] if m not in own}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (or a self-loop): import circles."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def under(name: str, prefixes: tuple[str, ...] | set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# ---- the rules ---------------------------------------------------------------------------------


def test_the_checker_sees_circles_and_package_inits():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": set()}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d"]]
    # A package __init__ importing its own submodule is no circle: the submodule does not
    # import the package it is being loaded by.
    assert "resilient_fsdp.train" not in import_graph()["resilient_fsdp.train.trainer"]
    assert "resilient_fsdp.checkpoint" in import_graph()["resilient_fsdp.train.trainer"]


def test_no_import_circles_anywhere_in_the_package():
    assert cycles(import_graph()) == []


def test_config_and_atomic_import_nothing_of_the_package():
    for name in modules():
        if not under(name, ("resilient_fsdp.config", "resilient_fsdp.atomic")):
            continue
        mine = [
            f"line {line}: {m}" for m, line in imported(name) if ours(m) and not under(m, ("resilient_fsdp.config",))
        ]
        assert mine == [], f"{name} imports {mine}"


def test_the_pod_side_imports_nothing_of_the_workstation_simulator_or_measurements():
    wrong = [
        f"{name} line {line}: {module}"
        for name in modules()
        if under(name, POD_SIDE)
        for module, line in imported(name)
        if under(module, NOT_IN_PODS)
    ]
    assert wrong == [], "pod-side modules import:\n" + "\n".join(wrong)


def test_the_checkpoint_package_imports_nothing_of_the_trainer():
    """The checkpoint layer sits below ``train/``: the trainer hands it what it needs (the batch a
    resume trains with, the summed votes), and no checkpoint module reaches back."""
    wrong = [
        f"{name} line {line}: {module}"
        for name in modules()
        if under(name, ("resilient_fsdp.checkpoint",))
        for module, line in imported(name)
        if under(module, ("resilient_fsdp.train",))
    ]
    assert wrong == [], "checkpoint modules import train/:\n" + "\n".join(wrong)


def test_nvrx_is_imported_only_by_the_modules_named_for_it():
    assert NVRX_MODULES <= set(modules()), "an allowlisted NVRx module is missing"
    wrong = [
        f"{name} line {line}: {module}"
        for name in modules()
        if name not in NVRX_MODULES
        for module, line in imported(name)
        if under(module, ("nvidia_resiliency_ext",))
    ]
    assert wrong == [], "NVRx imported outside " + ", ".join(sorted(NVRX_MODULES)) + ":\n" + "\n".join(wrong)


def test_nvrx_internals_and_cpu_workarounds_stay_in_the_nvrx_modules():
    wrong = []
    for name in modules():
        if name in NVRX_MODULES:
            continue
        # torch DCP's own single-process load takes a ``no_dist`` of its own: not NVRx's polling.
        torchs = {
            id(k)
            for n in ast.walk(tree(name))
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "dcp.load"
            for k in n.keywords
        }
        for node in ast.walk(tree(name)):
            used = (
                node.attr
                if isinstance(node, ast.Attribute)
                else node.arg
                if isinstance(node, ast.keyword)
                else node.id
                if isinstance(node, ast.Name)
                else None
            )
            if used in NVRX_INTERNALS and id(node) not in torchs:
                wrong.append(f"{name} line {node.lineno if hasattr(node, 'lineno') else '?'}: {used}")
            # Patching torch.cuda (the CPU shim) is an NVRx workaround too.
            if isinstance(node, ast.Assign) and any(ast.unparse(t).startswith("torch.cuda.") for t in node.targets):
                wrong.append(f"{name} line {node.lineno}: {ast.unparse(node.targets[0])} = ...")
    assert wrong == [], "NVRx adaptations outside its modules:\n" + "\n".join(wrong)


def test_files_are_replaced_in_place_only_through_the_atomic_helper():
    wrong = []
    for name in modules():
        if name == "resilient_fsdp.atomic":
            continue
        for node in ast.walk(tree(name)):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            # Strings have no .rename; Path.rename is a rename whatever the receiver is called.
            if (owner, node.func.attr) in FILE_COMMIT_CALLS or (node.func.attr == "rename" and owner != "atomic"):
                wrong.append(f"{name} line {node.lineno}: {ast.unparse(node.func)}(...)")
        if "O_EXCL" in {n.attr for n in ast.walk(tree(name)) if isinstance(n, ast.Attribute)}:
            wrong.append(f"{name}: os.O_EXCL")
    assert wrong == [], "use resilient_fsdp.atomic instead of:\n" + "\n".join(wrong)


def test_the_atomic_helper_is_what_the_writers_use():
    users = {name for name in modules() for module, _ in imported(name) if module == "resilient_fsdp.atomic"}
    # summary.json, the fault ledger, the GPU check's reports, the checkpoint commit, S3 downloads.
    assert {
        "resilient_fsdp.train.resources",
        "resilient_fsdp.resilience.ledger",
        "resilient_fsdp.resilience.faults",
        "resilient_fsdp.bench.gpu.check",
        "resilient_fsdp.bench.gpu.section",
        "resilient_fsdp.checkpoint.store",
        "resilient_fsdp.checkpoint.s3.transfer",
    } <= users


def test_every_module_says_what_it_is():
    missing = [name for name in modules() if not ast.get_docstring(tree(name))]
    assert missing == []


def test_every_package_docstring_names_each_of_its_modules():
    """A package's docstring is its index: each module and subpackage directly in it is named
    there (as ``name``), so the tree reads from the top down."""
    unnamed = []
    for name, path in modules().items():
        if path.name != "__init__.py":
            continue
        doc = ast.get_docstring(tree(name)) or ""
        children = sorted(
            {p.stem for p in path.parent.glob("*.py") if p.stem not in ("__init__", "__main__")}
            | {p.parent.name for p in path.parent.glob("*/__init__.py")}
        )
        unnamed += [f"{name}.{child}" for child in children if f"``{child}``" not in doc and f"``{child}/``" not in doc]
    assert unnamed == [], "name these in their package's docstring:\n" + "\n".join(unnamed)


def test_the_top_level_holds_only_the_command_atomic_writes_and_the_packages():
    files = {p.stem for p in PACKAGE.glob("*.py")}
    assert files == TOP_LEVEL, f"move {sorted(files - TOP_LEVEL)} into a subpackage"
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == PACKAGES, (
        f"top-level packages {sorted(packages)}; the layout (README, docs/tests.md) names {sorted(PACKAGES)}"
    )


def test_tests_mirror_the_package():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    folders = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == packages


# ---- one source for the fault_tolerance: settings -----------------------------------------------

# Every key of ft_config.yaml away from its default, a timeout switched off (null) included.
FT_SETTINGS = {
    "hang_detection": {
        "init_timeout_s": 1200,
        "step_timeout_s": None,
        "checkpoint_timeout_s": 450.5,
        "out_of_section_timeout_s": 700,
        "safety_factor": 3.5,
        "termination_signal": "SIGTERM",
        "workload_check_interval_s": 2.5,
    }
}


@pytest.mark.parametrize("profile", ["dev-cpu", "p5-4node"])
@pytest.mark.parametrize("settings", [{}, FT_SETTINGS], ids=["profile", "every-key-set"])
def test_the_chart_and_the_local_launcher_write_the_same_fault_tolerance_settings(profile, settings, tmp_path):
    """The ConfigMap's ft_config.yaml (Helm template) equals what resilience.ft_config makes of the
    same trainer settings for the local launcher: the two copies cannot drift apart."""
    from resilient_fsdp.config import load_config
    from resilient_fsdp.deploy import chart
    from resilient_fsdp.resilience.ft_config import ft_config, write_ft_config

    profiles = REPO / "values"
    files = [profiles / f"{profile}.yaml"] + (
        [] if profile == "dev-cpu" else [profiles / "examples" / "my-cluster.yaml"]
    )
    values = chart.deep_merge(chart.load_values(files), {"trainer": {"resilience": settings}})
    rendered = chart.render(values)
    data = rendered.find("ConfigMap")["data"]
    (tmp_path / "config.yaml").write_text(data["config.yaml"])
    resilience = load_config(tmp_path / "config.yaml").resilience
    from_chart = yaml.safe_load(data["ft_config.yaml"])
    from_python = yaml.safe_load(write_ft_config(tmp_path / "ft_config.yaml", resilience).read_text())
    assert from_chart == from_python == ft_config(resilience)
    if settings:
        section = from_chart["fault_tolerance"]
        assert section["rank_section_timeouts"]["step"] is None and section["safety_factor"] == 3.5


def test_module_headers_are_short():
    """A module's docstring is at most 13 lines: what it is and who uses it; the why of a line sits
    beside that line. A package's may add one line per module or subpackage it names."""
    long = []
    for name, path in modules().items():
        lines = len((ast.get_docstring(tree(name)) or "").splitlines())
        children = (
            (
                {p.stem for p in path.parent.glob("*.py") if p.stem not in ("__init__", "__main__")}
                | {p.parent.name for p in path.parent.glob("*/__init__.py")}
            )
            if is_package(name)
            else set()
        )
        if lines > 13 + len(children):
            long.append(f"{name}: {lines} lines (at most {13 + len(children)})")
    assert long == [], "shorten these module docstrings:\n" + "\n".join(long)
