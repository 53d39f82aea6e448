"""charts/resilient-fsdp/README.md, generated from values.yaml by resilient_fsdp.deploy.values_docs."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from tests.support import REPO
from resilient_fsdp.deploy import values_docs

CHART = REPO / "charts" / "resilient-fsdp"


def test_should_match_the_generated_readme_when_values_yaml_changes():
    assert (CHART / "README.md").read_text() == values_docs.render(CHART), "stale: run scripts/chart-readme"


def test_should_list_every_documented_key_with_its_parsed_default_when_rendered():
    text = (CHART / "README.md").read_text()
    for key in (
        "workload.kind",
        "workload.jobSet.maxRestarts",
        "scheduling.topology.required",
        "job.backoffLimit",
        "releaseCheck.devices",
        "trainer.resilience.launcher.max_restarts",
    ):
        assert f"| `{key}` |" in text, key
    assert '| `workload.kind` | string | `"PyTorchJob"` |' in text
    assert "## Workload kind" in text and "## Release check" in text


def test_should_take_sections_continuations_and_defaults_from_the_file_when_parsed():
    sections = values_docs.parse(
        "# header, not a doc\n"
        "# @section First\n"
        "a:\n"
        "  # -- One: the first line,\n"
        "  # and its continuation | with a pipe.\n"
        "  b: 3\n"
        "  c: undocumented\n"
        "# -- A map whose children are documented.\n"
        "d:\n"
        "  # -- A list.\n"
        "  e: [1, 2]\n"
        "# @section Second\n"
        "# -- Null.\n"
        "f: null\n"
    )
    assert [s.name for s in sections] == ["First", "Second"]
    first = {e.key: e for e in sections[0].entries}
    assert list(first) == ["a.b", "d", "d.e"]
    assert first["a.b"].description == "One: the first line, and its continuation | with a pipe."
    assert first["a.b"].default == 3 and first["d.e"].default == [1, 2] and first["d"].children_documented
    assert sections[1].entries[0].default is None
    assert values_docs._cell("x | y") == "x \\| y"


def test_should_exit_1_naming_the_fix_when_the_readme_is_stale(tmp_path):
    chart = tmp_path / "chart"
    chart.mkdir()
    (chart / "Chart.yaml").write_text((CHART / "Chart.yaml").read_text())
    (chart / "values.yaml").write_text("# -- A key.\nkey: 1\n")
    script = REPO / "scripts" / "chart-readme"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(script), "--chart", str(chart), "--check"], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 1 and "run scripts/chart-readme" in proc.stderr
    assert (
        subprocess.run(
            ["bash", str(script), "--chart", str(chart)], capture_output=True, timeout=60, env=env
        ).returncode
        == 0
    )
    proc = subprocess.run(
        ["bash", str(script), "--chart", str(chart), "--check"], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert "| `key` | int | `1` | A key. |" in (chart / "README.md").read_text()
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["maintainers"]
