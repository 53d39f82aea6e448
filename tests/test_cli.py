"""Every ``resilient-fsdp`` command's help, and a table of mistakes: each exits 2 naming what is wrong.

The commands run in this process (``resilient_fsdp.cli.main``); a mistake must be refused before
any job, download or benchmark starts, with ``error: ...`` naming the flag or key and no traceback.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from resilient_fsdp import cli

ADVISE = ["advise", "--instance", "p5.48xlarge", "--nodes", "16", "--preset", "8b"]
LOCAL = ["local", "--run-dir", "{tmp}/run"]

# (argv, what stderr must name); "{tmp}" is a fresh directory holding the files FILES writes.
BAD_INPUTS = [
    # the command line itself
    ([], "COMMAND"),
    (["nope"], "invalid choice: 'nope'"),
    (["render", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench"], "BENCHMARK"),
    (["bench", "nope"], "invalid choice: 'nope'"),
    (["checkpoints"], "ACTION"),
    (["data"], "ACTION"),
    (["data", "prepare"], "--input"),
    # the trainer's configuration
    (["config", "--set", "train.stepz=5"], "did you mean 'train.steps'"),
    (["config", "--set", "train.steps=abc"], "train.steps"),
    (["config", "--set", "train.steps"], "train.steps"),
    (["config", "--config", "{tmp}/missing.yaml"], "missing.yaml"),
    (["config", "--config", "{tmp}/broken.yaml"], "broken.yaml"),
    (["train", "--set", "optim.lrr=1"], "did you mean 'optim.lr'"),
    (["train", "--inject", "explode@5"], "unknown fault kind 'explode'"),
    # the chart's values
    (["render", "--set", "train.steps=300"], "--set trainer.train.steps=300"),
    (["render", "--set-json", 'model.preset="1b"'], "--set-json trainer.model.preset"),
    (["render", "--set", "nodez=2"], "did you mean 'nodes'"),
    (["render", "--set", "efa.enabledd=true"], "did you mean 'efa.enabled'"),
    (["render", "--set", "nodes=0"], "nodes: got 0; allowed: 1 or more"),
    (["render", "--set", "image.tag=latest"], 'image.tag: got "latest"; allowed: anything but "latest"'),
    (["render", "--set", "workload.kind=PytorchJob"], "did you mean 'PyTorchJob'"),
    (["render", "--set", "spares=yes"], 'spares: got "yes" (text); allowed: a whole number'),
    (["render", "--set", "chaos.inject={explode@5}"], 'chaos.inject[0]: got "explode@5"'),
    (["render", "--set", "noequals"], "--set 'noequals'"),
    (["render", "--set-json", "nodes=[bad"], "--set-json"),
    (["render", "-f", "{tmp}/missing.yaml"], "-f {tmp}/missing.yaml"),
    (["render", "-f", "{tmp}/list.yaml"], "-f {tmp}/list.yaml"),
    (["render", "--chart", "{tmp}"], "--chart"),
    (["render", "--release", "9lives"], "9lives"),
    (["validate", "--pod-security", "lax"], "--pod-security"),
    (["validate", "--crds", "{tmp}/no-crds"], "--crds"),
    (["validate", "-f", "{tmp}/missing.yaml"], "-f {tmp}/missing.yaml"),
    # advise
    (["advise"], "--instance"),
    (["advise", "--instance", "p9.mega", "--nodes", "2"], "--instance 'p9.mega'"),
    (["advise", "--instance", "p5.48xlarge", "--nodes", "abc"], "--nodes"),
    (["advise", "--instance", "p5.48xlarge", "--nodes", "0", "--preset", "8b"], "--nodes"),
    (["advise", "--instance", "p5.48xlarge", "--nodes", "4", "--preset", "huge"], "--preset"),
    ([*ADVISE, "--spares", "two"], "--spares 'two'"),
    ([*ADVISE, "--kind", "Deployment"], "--kind"),
    ([*ADVISE, "--storage-size", "lots"], "--storage-size 'lots'"),
    ([*ADVISE, "--memory", "--memory-coverage", "2"], "--memory-coverage"),
    ([*ADVISE, "--from-bench", "{tmp}/missing.json"], "--from-bench"),
    ([*ADVISE, "--from-bench", "{tmp}/broken.json"], "--from-bench"),
    ([*ADVISE, "--memory", "--from-run", "{tmp}/no-run"], "--from-run"),
    # report
    (["report"], "--run-dir"),
    (["report", "--run-dir", "{tmp}/no-run"], "--run-dir"),
    (["report", "--run-dir", "{tmp}/bad-summary"], "summary.json is not valid JSON"),
    (["report", "--run-dir", "{tmp}/empty-summary"], "summary.json has no number for job_wall_s"),
    (["report", "--run-dir", "{tmp}/no-records"], "metrics.jsonl holds no timed records"),
    (["report", "--run-dir", "{tmp}/run-ok", "--out", "{tmp}/no-dir/report.png"], "--out"),
    (["report", "--run-dir", "{tmp}/run-ok", "--json", "{tmp}/no-dir/parts.json"], "--json"),
    (["report", "--run-dir", "{tmp}/run-ok", "--out", "{tmp}"], "--out {tmp}: is a directory"),
    # simulate
    (["simulate", "--nodes", "abc"], "--nodes 'abc'"),
    (["simulate", "--nodes", "0"], "--nodes"),
    (["simulate", "--mix", "1,2"], "--mix"),
    (["simulate", "--mix", "a,b,c"], "--mix"),
    (["simulate", "--runs", "0"], "--runs"),
    (["simulate", "--recovery-s", "warp=3"], "--recovery-s"),
    (["simulate", "--recovery-from-bench", "{tmp}/missing.json"], "--recovery-from-bench"),
    (["simulate", "--spares", "many"], "--spares 'many'"),
    (["simulate", "--gpus-per-node", "x"], "--gpus-per-node"),
    (["simulate", "--runs", "1", "--out", "{tmp}/no-dir/sim.json"], "--out"),
    (["simulate", "--runs", "1", "--plot", "{tmp}/no-dir/sim.png"], "--plot"),
    # checkpoints
    (["checkpoints", "list", "--run-dir", "{tmp}/no-run"], "--run-dir"),
    (["checkpoints", "list", "--set", "checkpoint.dirr=x"], "did you mean 'checkpoint.dir'"),
    (["checkpoints", "push", "--run-dir", "{tmp}"], "checkpoint.s3.uri"),
    (["checkpoints", "verify", "--step", "x"], "--step"),
    (["checkpoints", "export", "--run-dir", "{tmp}"], "--out"),
    (["checkpoints", "list", "--dir", "{tmp}"], "unrecognized arguments: --dir"),
    # data
    (["data", "prepare", "--input", "{tmp}/x.jsonl", "--tokenizer", "t.json", "--out", "s3://b/p"], "--out"),
    (
        ["data", "prepare", "--input", "{tmp}/x.jsonl", "--tokenizer", "{tmp}/missing-tok.json", "--out", "{tmp}/tok"],
        "--tokenizer",
    ),
    (
        [
            "data",
            "prepare",
            "--input",
            "{tmp}/missing.jsonl",
            "--tokenizer",
            "{tmp}/missing-tok.json",
            "--out",
            "{tmp}/tokens",
        ],
        "missing",
    ),
    # local
    (["local"], "--run-dir"),
    ([*LOCAL, "--nodes", "abc"], "--nodes"),
    ([*LOCAL, "--isolation", "docker"], "--isolation"),
    ([*LOCAL, "--set", "train.stepz=3"], "did you mean 'train.steps'"),
    ([*LOCAL, "-f", "{tmp}/missing.yaml"], "missing.yaml"),
    ([*LOCAL, "--inject", "explode@5"], "explode"),
    ([*LOCAL, "--value", "nodez=2"], "did you mean 'nodes'"),
    ([*LOCAL, "--pod-start-delay", "soon"], "--pod-start-delay"),
    ([*LOCAL, "--manifests", "{tmp}/missing.yaml"], "argument --manifests"),
    ([*LOCAL, "--nofile", "many"], "--nofile 'many'"),
    # benchmarks
    (["bench", "checkpoint", "--bogus"], "--bogus"),
    (["bench", "scale", "--case", "bad"], "--case"),
    (["bench", "checkpoint", "--modes", "nope"], "argument --modes"),
    (["bench", "checkpoint", "--set", "train.stepz=1"], "did you mean 'train.steps'"),
    (["bench", "recovery", "--layers", "nope"], "argument --layers"),
    (["bench", "soak", "--kinds", "explode"], "argument --kinds: 'explode' is not a fault kind"),
    (["bench", "soak", "--seeds", "x-y"], "argument --seeds: 'x-y'"),
    (["bench", "campaign", "--kinds", "explode", "--run-dir", "{tmp}/campaign"], "--kinds"),
]


def _files(tmp) -> None:
    (tmp / "broken.yaml").write_text("train: [steps\n")
    (tmp / "list.yaml").write_text("- nodes\n")
    (tmp / "broken.json").write_text("{not json")
    (tmp / "bad-summary").mkdir()
    (tmp / "bad-summary" / "summary.json").write_text("{half")
    (tmp / "bad-summary" / "metrics.jsonl").write_text("")
    summary = json.dumps({"job_wall_s": 10.0, "productive_s": 8.0, "goodput": 0.8})
    (tmp / "empty-summary").mkdir()
    (tmp / "empty-summary" / "summary.json").write_text("{}")
    (tmp / "empty-summary" / "metrics.jsonl").write_text("")
    (tmp / "no-records").mkdir()
    (tmp / "no-records" / "summary.json").write_text(summary)
    (tmp / "no-records" / "metrics.jsonl").write_text("torn\n")
    (tmp / "run-ok").mkdir()
    (tmp / "run-ok" / "summary.json").write_text(summary)
    (tmp / "run-ok" / "metrics.jsonl").write_text(json.dumps({"t": 0.0, "event": "finish"}) + "\n")
    (tmp / "x.jsonl").write_text('{"text": "a"}\n')


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # what `sys.exit(main())` would end with
        rc = exc.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_the_table_holds_at_least_42_mistakes():
    assert len(BAD_INPUTS) >= 42


@pytest.mark.parametrize("argv,named", BAD_INPUTS, ids=[" ".join(a) or "(none)" for a, _ in BAD_INPUTS])
def test_a_mistake_exits_2_naming_what_is_wrong(argv, named, tmp_path, capsys):
    _files(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc, out, err = _run(argv, capsys)
    assert rc == 2, f"exit {rc}\nstdout: {out}\nstderr: {err}"
    assert named.replace("{tmp}", str(tmp_path)) in err, err
    assert "error" in err and "Traceback" not in err + out


def test_a_subcommands_parse_error_prints_that_subcommands_usage(capsys):
    rc, _, err = _run(["simulate", "--bogus"], capsys)
    assert rc == 2 and err.startswith("usage: resilient-fsdp simulate")
    rc, _, err = _run(["checkpoints", "list", "--bogus"], capsys)
    assert rc == 2 and err.startswith("usage: resilient-fsdp checkpoints list")


def _commands(parser: argparse.ArgumentParser, prefix: list[str]):
    """Every (sub)command's argv, walking the parser's subparsers."""
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, prefix + [name])


COMMANDS = list(_commands(cli.build_parser(), []))


def test_every_command_is_walked():
    names = {" ".join(c) for c in COMMANDS}
    assert {
        "local",
        "render",
        "validate",
        "advise",
        "report",
        "simulate",
        "bench scale",
        "checkpoints pull",
        "data prepare",
        "config",
        "train",
    } <= names


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c) or "(top)" for c in COMMANDS])
def test_every_command_prints_its_help(argv, capsys):
    rc, out, err = _run([*argv, "--help"], capsys)
    assert rc == 0, err
    assert out.startswith(f"usage: {' '.join(['resilient-fsdp', *argv])}") and "Traceback" not in out + err


def test_version_names_the_package_nvrx_torch_and_the_chart(capsys):
    from importlib import metadata

    rc, out, _ = _run(["--version"], capsys)
    assert rc == 0
    assert f"resilient-fsdp {metadata.version('resilient-fsdp')}" in out
    assert f"nvidia-resiliency-ext {metadata.version('nvidia-resiliency-ext')}" in out
    assert f"torch {metadata.version('torch')}" in out and "chart 0." in out


def test_the_installed_command_exits_2_without_a_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_fsdp.cli", "simulate", "--nodes", "abc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--nodes 'abc'" in proc.stderr and "Traceback" not in proc.stderr
