"""Where the local cluster's pods run, without starting them: loopback's rewritten names and
paths, the image's code bound back under a pod volume, and a pod's paths as this machine sees them."""

from __future__ import annotations

from tests.local.manifest_support import rendered
from resilient_fsdp.local.manifests.kinds import pods_of
from resilient_fsdp.local.runtime.loopback import LoopbackRuntime
from resilient_fsdp.local.runtime.netns import hidden_image_paths
from resilient_fsdp.local.runtime.paths import IN_TEXT, replace_paths


def test_loopback_rewrites_names_and_paths_and_says_so(tmp_path):
    out = rendered("nodes=2", f"storage.mountPath={tmp_path}", f"trainer.run_dir={tmp_path}")
    workload = pods_of(out.documents())
    # This machine's own variables are the image: a checkout under /tmp (a pod mount path) stays put.
    runtime = LoopbackRuntime(
        workload, tmp_path, "t1", {"PATH": "/tmp/clone/.venv/bin:/usr/bin", "PYTHONPATH": "/tmp/clone/train"}
    )
    try:
        argv, env = runtime.command(workload.pods[1], {"X": "1"})
    finally:
        runtime.close()
    assert "--rdzv-endpoint=127.0.0.1:29400" in argv
    assert f"--ft-cfg-path={tmp_path}/cluster/configmaps/config/ft_config.yaml" in argv
    assert argv[-1] == f"--config={tmp_path}/cluster/configmaps/config/config.yaml"
    # Who hosts the store is the node agent's decision, from the pod's index, as on a cluster.
    assert not any("is_host" in a for a in argv)
    assert env["PET_LOCAL_ADDR"] == "127.0.0.2" and env["MASTER_ADDR"] == "127.0.0.1" and env["X"] == "1"
    assert env["TMPDIR"] == env["HOME"] and env["TMPDIR"].startswith(str(runtime.scratch))
    assert env["PYTHONPATH"] == "/tmp/clone/train" and env["PATH"].endswith(":/tmp/clone/.venv/bin:/usr/bin")
    assert (tmp_path / "cluster/configmaps/config/config.yaml").read_text().startswith("checkpoint:")


def test_code_under_a_pod_volume_is_bound_back_into_the_pod():
    assert hidden_image_paths(
        ["/tmp/clone/.venv/bin", "/tmp/clone/train", "/usr/lib/python3", "/tmpx/a"], ["/tmp", "/fsx", "/dev/shm"]
    ) == [("/tmp/clone", "/tmp")]


def test_a_mount_path_is_rewritten_where_it_stands_as_a_path_and_only_there():
    """What the console shows of a pod's line: ``/fsx`` is the run directory wherever it starts a
    path; a longer name that merely begins with it is left alone, and a rewritten path never again."""
    line = "summary /fsx/summary.json, config=/fsx/config.yaml (/fsx) [/fsx/a] '/fsx' /fsxy/z x/fsx /fsx:"
    out = replace_paths(line, [("/fsx", "/home/u/run"), ("/home", "/elsewhere")], IN_TEXT)
    assert out == (
        "summary /home/u/run/summary.json, config=/home/u/run/config.yaml (/home/u/run) "
        "[/home/u/run/a] '/home/u/run' /fsxy/z x/fsx /home/u/run:"
    )


def test_a_relative_pythonpath_reaches_the_pods_as_this_shell_meant_it(tmp_path, monkeypatch):
    """``PYTHONPATH=.venv/lane resilient-fsdp local ...``: the pods start in other directories, so
    the entry is made absolute against the directory the command ran in."""
    out = rendered("nodes=1", f"storage.mountPath={tmp_path}", f"trainer.run_dir={tmp_path}")
    workload = pods_of(out.documents())
    monkeypatch.chdir(tmp_path)
    runtime = LoopbackRuntime(workload, tmp_path, "t2", {"PATH": "/usr/bin", "PYTHONPATH": "lane/site:/abs/train"})
    try:
        _argv, env = runtime.command(workload.pods[0], {})
    finally:
        runtime.close()
    assert env["PYTHONPATH"] == f"{tmp_path}/lane/site:/abs/train"
