"""Every command the README and the docs show runs as shown, or, where it cannot run here (a
cluster, Docker, a GPU), names what exists and renders.

The commands are read from the pages themselves: each line of a code block that starts with one
of this project's commands, and each inline command with arguments. Then:

- ``resilient-fsdp render|validate|advise|config|simulate ...`` runs, and must exit 0;
- ``resilient-fsdp local ...`` and ``./scripts/demo ...`` are checked as ``local`` checks them
  before it starts a pod: the flags, the trainer configuration, the render, the fault specs;
- ``helm install NAME charts/resilient-fsdp -f ...`` renders through Helm's engine with the same
  values (``mine.yaml`` is the example cluster file, ``values/examples/my-cluster.yaml``);
- every other ``resilient-fsdp`` command parses with the real parser, every script exists and is
  executable, every ``python -m`` module exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO

PAGES = sorted(
    [
        REPO / "README.md",
        *(REPO / "docs").glob("*.md"),
        REPO / "charts" / "resilient-fsdp" / "README.md",
        REPO / "images" / "custom-model" / "README.md",
    ]
)
OURS = ("resilient-fsdp ", "./scripts/", "scripts/", "python -m resilient_fsdp", "helm install ", "helm test ")
MY_CLUSTER = REPO / "values" / "examples" / "my-cluster.yaml"
# Run as shown: quick, and they touch nothing outside their output.
RUNS_HERE = {"render", "validate", "advise", "config", "simulate"}
# Placeholders the pages write for what the reader fills in.
PLACEHOLDERS = {
    "runs/demo-…": "{run_dir}",
    "mine.yaml": str(MY_CLUSTER),
    "FILE": "{tmp}/file",
    "KIND": "JobSet",
    "k=v": "train.steps=1",
    "job.yaml": "{tmp}/job.yaml",
    "DIR": "{tmp}/dir",
    "N": "1",
}


@dataclass(frozen=True)
class Shown:
    page: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def _starts_ours(text: str) -> bool:
    text = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", text)  # PYTHONPATH=... resilient-fsdp ...
    return text.startswith(OURS) or text in ("./scripts/demo", "./scripts/test")


def shown_commands() -> list[Shown]:
    """Each of this project's commands the pages show: code-block lines (continuations joined,
    prompts and comments dropped) and inline commands that carry arguments."""
    found = []
    for page in PAGES:
        name = str(page.relative_to(REPO))
        lines = page.read_text().splitlines()
        in_block, pending, start = False, "", 0
        for number, raw in enumerate(lines, 1):
            if raw.lstrip().startswith("```"):
                in_block = not in_block
                continue
            if in_block:
                text = raw.strip()
                text = text[2:] if text.startswith("$ ") else text
                if pending:
                    text, pending = pending + " " + text, ""
                else:
                    start = number
                if text.endswith("\\"):
                    pending = text[:-1].strip()
                    continue
                text = re.split(r"\s+#\s", text, maxsplit=1)[0].strip()
                if _starts_ours(text):
                    found.append(Shown(name, start, text))
                continue
            for inline in re.findall(r"`([^`]+)`", raw):
                # A command with flags or arguments; a bare name (`resilient-fsdp local`) is a mention.
                if _starts_ours(inline) and re.search(r"\s(-|\S+=)", inline) and not inline.startswith("helm "):
                    found.append(Shown(name, number, inline.strip()))
    return found


def _words(shown: Shown, tmp: Path) -> list[str]:
    text = shown.text.replace("[", "").replace("]", "")  # optional flags: shown with them
    text = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", text)
    words = shlex.split(text)
    values = {k: v.format(run_dir=tmp / "run", tmp=tmp) for k, v in PLACEHOLDERS.items()}
    return [values.get(w, w) for w in words]


def _subcommand_words(words: list[str]) -> list[str]:
    return words[1:] if words[0] == "resilient-fsdp" else words


@pytest.mark.parametrize("shown", shown_commands(), ids=str)
def test_a_command_the_docs_show_runs_or_renders_as_shown(shown, tmp_path):
    words = _words(shown, tmp_path)
    (tmp_path / "file").write_text("{}\n")
    (tmp_path / "job.yaml").write_text("checkpoint:\n  dir: " + str(tmp_path / "ckpt") + "\n")
    if words[0] in ("./scripts/demo", "scripts/demo"):
        _check_local(
            [
                "--nodes",
                "2",
                "--nproc-per-node",
                "2",
                "--run-dir",
                str(tmp_path / "run"),
                "--set",
                "train.steps=100",
                *words[1:],
            ],
            shown,
        )
    elif words[0].startswith(("./scripts/", "scripts/")):
        script = REPO / words[0].removeprefix("./")
        assert script.is_file() and os.access(script, os.X_OK), f"{shown}: no executable {script}"
    elif words[:2] == ["python", "-m"]:
        assert importlib.util.find_spec(words[2]) is not None, f"{shown}: no module {words[2]}"
    elif words[:2] == ["helm", "install"]:
        _check_helm_install(words[2:], shown)
    elif words[:2] == ["helm", "test"]:
        assert len(words) >= 3 and re.fullmatch(r"[a-z0-9-]+", words[2]), f"{shown}: helm test RELEASE"
    else:
        assert words[0] == "resilient-fsdp", shown
        _check_resilient_fsdp(words[1:], shown, tmp_path)


def _parse(argv: list[str], shown: Shown) -> argparse.Namespace:
    from resilient_fsdp.cli import build_parser

    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{shown}: the command line does not parse (exit {exc.code})")


def _check_resilient_fsdp(argv: list[str], shown: Shown, tmp: Path) -> None:
    if argv == ["--help"]:
        return
    if argv == ["--version"]:
        from resilient_fsdp.cli import main

        assert main(argv) == 0, shown
        return
    args = _parse(argv, shown)
    if args.command == "local":
        _check_local(argv[1:], shown)
    elif args.command in RUNS_HERE:
        # Outputs go to the test's directory, never into the checkout.
        argv = [str(tmp / Path(a).name) if n and argv[n - 1] in ("--out", "--plot") else a for n, a in enumerate(argv)]
        if args.command == "simulate":  # the page's many runs make its table; two show it runs
            argv = [a for n, a in enumerate(argv) if a != "--runs" and (n == 0 or argv[n - 1] != "--runs")]
            argv += ["--runs", "2"]
        proc = subprocess.run(
            [sys.executable, "-m", "resilient_fsdp.cli", *argv], capture_output=True, text=True, cwd=REPO, timeout=300
        )
        expected = 2 if "presett" in shown.text else 0  # docs/config.md shows the error a typo gives
        assert proc.returncode == expected, f"{shown}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


def _check_local(argv: list[str], shown: Shown) -> None:
    """What ``resilient-fsdp local`` checks before it starts a pod (flags, configuration, render)."""
    from resilient_fsdp.config import ConfigError
    from resilient_fsdp.local import job as local_job

    if "--run-dir" not in " ".join(argv):
        pytest.fail(f"{shown}: resilient-fsdp local needs --run-dir")
    parser = argparse.ArgumentParser(prog="resilient-fsdp local")
    local_job.add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{shown}: the command line does not parse (exit {exc.code})")
    if "presett" in shown.text:
        with pytest.raises(ConfigError, match="unknown key 'model.presett'"):
            local_job.prepare(args)
        return
    pythonpath = re.match(r"PYTHONPATH=(\S+)", shown.text)
    if pythonpath:
        sys.path.insert(0, str(REPO / pythonpath[1]))
    try:
        job, _, _ = local_job.prepare(args)
    except ConfigError as exc:
        if "factory" in str(exc) and "my_models" in shown.text:
            return  # docs/config.md's factories are the reader's own modules
        pytest.fail(f"{shown}: {exc}")
    finally:
        if pythonpath:
            sys.path.remove(str(REPO / pythonpath[1]))
    assert job.workload.pods, shown


def _check_helm_install(words: list[str], shown: Shown) -> None:
    from resilient_fsdp.deploy import chart

    release, path, rest = words[0], words[1], [w for w in words[2:] if w != "--wait"]  # --wait: no render change
    assert path == "charts/resilient-fsdp", shown
    files, sets = [], []
    for flag, value in zip(rest[::2], rest[1::2]):
        assert flag in ("-f", "--set", "--timeout"), f"{shown}: {flag}"
        if flag == "--timeout":
            assert re.fullmatch(r"\d+[smh]", value), f"{shown}: --timeout {value}"
            continue
        (files if flag == "-f" else sets).append(
            value if flag == "--set" else REPO / value if not value.startswith("/") else value
        )
    sets = [s.replace("<account>", "123456789012") for s in sets]
    rendered = chart.render(chart.load_values(files, sets), release=release)
    # A job's release has its config; a storage-only one (storage.only=true) its claim.
    assert rendered.find("ConfigMap" if "storage.only=true" not in sets else "PersistentVolumeClaim"), shown


def test_every_command_the_docs_name_exists():
    """A bare mention (`resilient-fsdp checkpoints`, `resilient-fsdp bench soak`) names a real command."""
    from resilient_fsdp.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    named = []
    for page in PAGES:
        for number, raw in enumerate(page.read_text().splitlines(), 1):
            for m in re.finditer(r"`resilient-fsdp ([a-z][a-z0-9-]*)(?: ([a-z][a-z0-9-]*))?", raw):
                named.append((f"{page.relative_to(REPO)}:{number}", m[1], m[2]))
    assert len(named) > 20
    for where, command, sub in named:
        assert command in commands, f"{where}: no command `resilient-fsdp {command}`"
        sub_actions = [a for a in commands[command]._actions if isinstance(a, argparse._SubParsersAction)]
        if sub and sub_actions:
            assert sub in sub_actions[0].choices, f"{where}: no command `resilient-fsdp {command} {sub}`"


def test_the_pages_show_commands_of_every_kind():
    """The reader above finds what the pages hold (a change to how pages write commands would
    otherwise leave these tests with nothing to check)."""
    texts = [s.text for s in shown_commands()]
    assert "./scripts/demo" in texts
    assert any(t.startswith("resilient-fsdp advise") for t in texts)
    assert any(t.startswith("helm install") for t in texts) and any(
        t.startswith("resilient-fsdp render") for t in texts
    )
    assert any(t.startswith("./scripts/demo --") for t in texts)


def test_the_error_docs_config_shows_is_the_one_a_typo_gives():
    text = (REPO / "docs" / "config.md").read_text()
    block = re.search(r"```\n\$ (resilient-fsdp local [^\n]*presett[^\n]*)\n(.*?)```", text, re.S)
    assert block, "docs/config.md shows a typo's error"
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_fsdp.cli", *shlex.split(block[1])[1:]],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr == block[2], proc.stderr


def test_every_test_the_docs_cite_exists():
    """A page that names a test (``dir/test_x.py::test_name``, with or without ``tests/``) names
    one that is there, so the fault matrix and the test tables describe the suite as it is."""
    cited = []
    for page in PAGES:
        for number, raw in enumerate(page.read_text().splitlines(), 1):
            for path, name in re.findall(r"`(?:tests/)?([a-z_]+/test_[a-z0-9_]+\.py)::(test_[a-z0-9_]+)", raw):
                cited.append((f"{page.relative_to(REPO)}:{number}", path, name))
    assert len(cited) > 10
    missing = [
        f"{where}: tests/{path}::{name}"
        for where, path, name in cited
        if not (REPO / "tests" / path).is_file()
        or not re.search(rf"^def {name}\(", (REPO / "tests" / path).read_text(), re.M)
    ]
    assert missing == [], "the docs cite tests that do not exist:\n" + "\n".join(missing)
