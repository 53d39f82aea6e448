"""The rendered pod's command, run for real: the chart starts what the trainer expects."""

from __future__ import annotations

import sys

from tests.deploy.chart_support import VALUES_DIR, config_map, container, render
from tests.support import assert_no_leftovers, read_summary, run_guarded
from resilient_fsdp.local.cluster.launcher import free_port


def test_should_train_and_exit_0_when_the_rendered_pod_command_runs(tmp_path):
    """The dev-cpu profile's Master container, run as its pod would run it, with the cluster's
    paths mapped into a temporary directory: the node wrapper, ft_launcher with the rendered flags
    and fault_tolerance file, and the trainer with the rendered ConfigMap."""
    shared = tmp_path / "fsx"
    rendered = render(
        f"storage.mountPath={shared}",
        "trainer.train.steps=6",
        "trainer.checkpoint.interval_steps=3",
        files=[VALUES_DIR / "dev-cpu.yaml"],
        base=[],
        release="smoke",
    )
    etc = tmp_path / "etc"
    etc.mkdir()
    data = rendered.find("ConfigMap")["data"]
    for name, text in data.items():
        (etc / name).write_text(text)
    c = container(rendered)
    host_port = "smoke-resilient-fsdp-master-0:29400"
    port = free_port()
    args = [a.replace("/etc/resilient-fsdp/", f"{etc}/").replace(host_port, f"127.0.0.1:{port}") for a in c["args"]]
    assert c["command"][0] == "python"
    run_dir = shared / "runs" / "smoke-resilient-fsdp"
    assert config_map(rendered, "config.yaml")["run_dir"] == str(run_dir)
    proc = run_guarded([sys.executable, *c["command"][1:], *args], run_dir, None, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["final_step"] == 6 and summary["world_size"] == 2
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMPLETE").is_file())
    assert saved and int(saved[-1].split("_")[1]) == 6, saved
    assert_no_leftovers(run_dir)
