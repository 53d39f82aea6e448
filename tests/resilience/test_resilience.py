"""Fault specs, the once-per-job ledger, launcher settings and exit codes, and the accounting
that turns attempt records into restarts, recoveries and goodput (no processes started here)."""

from __future__ import annotations

import json
import signal

import pytest
import yaml

from resilient_fsdp.config import ConfigError, FaultSpec, load_config, parse_fault, parse_faults
from resilient_fsdp.resilience.faults import NODE_INDEX_ENV, REQUESTS_ENV, FaultInjector
from resilient_fsdp.resilience.ledger import FaultLedger
from resilient_fsdp.resilience.ft_config import ft_config, ft_launcher_flags
from resilient_fsdp.resilience.accounting import record_recoveries, summarize


def test_fault_specs_parse_and_bad_ones_name_the_fix():
    assert parse_fault("sigkill@20:rank=3") == FaultSpec("sigkill", 20, 3)
    assert parse_fault("node-loss@5") == FaultSpec("node-loss", 5, 0)
    assert parse_fault("sigkill@20:rank=0") == FaultSpec("sigkill", 20, 0)
    assert parse_fault("node-loss@12:node=0") == FaultSpec("node-loss", 12, node=0)
    partition = parse_fault("partition@28:node=1:for=20")
    assert partition == FaultSpec("partition", 28, node=1, for_s=20.0)
    assert str(partition) == "partition@28:node=1:for=20" and partition.key == "partition@28-node1"
    assert str(parse_fault("hang-in-collective@36:rank=2")) == "hang-in-collective@36:rank=2"
    with pytest.raises(ConfigError, match="unknown fault kind 'segfault'; choose one of exception, hang"):
        parse_fault("segfault@3")
    with pytest.raises(ConfigError, match=r"expected KIND@STEP\[:rank=R \| :node=N\]\[:for=SECONDS\], e.g. "
                                          "sigkill@20:rank=1"):
        parse_fault("sigkill:3")
    with pytest.raises(ConfigError, match="STEP must be 1 or more"):
        parse_fault("hang@0")
    with pytest.raises(ConfigError, match="give rank=R or node=N, not both"):
        parse_fault("node-loss@3:rank=1:node=0")
    with pytest.raises(ConfigError, match="for=SECONDS applies to partition, writer-slow only"):
        parse_fault("node-loss@3:node=0:for=5")
    with pytest.raises(ConfigError, match="for= must be a number of seconds above 0"):
        parse_fault("partition@3:for=-1")
    with pytest.raises(ConfigError, match="unknown option 'nodes=1'"):
        parse_fault("partition@3:nodes=1")
    with pytest.raises(ConfigError, match="rank 4 does not exist in a job of 4 ranks"):
        parse_faults(["exception@3:rank=4"], world_size=4)
    with pytest.raises(ConfigError, match="node 2 does not exist in a job of 2 node"):
        parse_faults(["node-loss@3:node=2"], world_size=4, nodes=2)
    with pytest.raises(ConfigError, match="resilience.inject"):
        load_config(None, ["resilience.inject=[hang@x]"])


def test_node_targets_fire_on_the_nodes_local_rank_zero(tmp_path, monkeypatch):
    specs = parse_faults(["sigterm@3:node=1", "sigkill@4:rank=0", "exception@5:node=0"])
    monkeypatch.setenv(NODE_INDEX_ENV, "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert [s.kind for s in FaultInjector(specs, rank=2, ledger=FaultLedger(tmp_path)).mine] == ["sigterm"]
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert FaultInjector(specs, rank=3, ledger=FaultLedger(tmp_path)).mine == []
    monkeypatch.setenv(NODE_INDEX_ENV, "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert [s.kind for s in FaultInjector(specs, rank=0, ledger=FaultLedger(tmp_path)).mine] == ["sigkill",
                                                                                                   "exception"]


def test_a_partition_is_refused_where_nothing_can_execute_it(tmp_path, monkeypatch):
    monkeypatch.delenv(REQUESTS_ENV, raising=False)
    with pytest.raises(ConfigError, match=r"'partition@9:node=0:for=5': a partition takes a pod's network link "
                                          r"down.*RESILIENT_FSDP_FAULT_REQUESTS"):
        FaultInjector(parse_faults(["partition@9:node=0:for=5"]), rank=0, ledger=FaultLedger(tmp_path))
    monkeypatch.setenv(REQUESTS_ENV, str(tmp_path / "requests"))
    FaultInjector(parse_faults(["partition@9:node=0:for=5"]), rank=0, ledger=FaultLedger(tmp_path))


def test_a_partition_request_is_written_atomically_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv(REQUESTS_ENV, str(tmp_path / "requests"))
    monkeypatch.setenv(NODE_INDEX_ENV, "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    ledger = FaultLedger(tmp_path)
    injector = FaultInjector(parse_faults(["partition@9:node=1:for=5"]), rank=2, ledger=ledger)
    injector.at_step_start(9, 8)  # returns: the cluster cuts the link, the rank does not stop
    request = json.loads((tmp_path / "requests" / "partition-step9-node1.json").read_text())
    assert request.pop("time") > 0
    assert request == {"kind": "partition", "node": 1, "step": 9, "for_s": 5.0, "rank": 2}
    assert [p.name for p in (tmp_path / "requests").iterdir()] == ["partition-step9-node1.json"]
    (fired,) = ledger.fired()
    assert fired["fault"] == "partition@9:node=1:for=5" and fired["request"].endswith("partition-step9-node1.json")
    injector.at_step_start(9, 8)  # once per job
    assert len(ledger.fired()) == 1
    # Still training after its 5 s: it healed (or nothing cut the link), so the next restart
    # is not its recovery, and the summary lists it as unrecovered.
    injector.partitions = [(spec, t - 10) for spec, t in injector.partitions]
    injector.at_step_start(12, 11)
    assert ledger.went_on()["partition@9-node1"]["step"] == 11
    assert record_recoveries(ledger, "in_job", resumed_step=8, now=fired["t_fault"] + 30) == []
    (unrecovered,) = summarize(tmp_path / "metrics.jsonl", ledger)["unrecovered"]
    assert unrecovered["fault"] == "partition@9:node=1:for=5" and "training went on (step 11" in unrecovered["why"]


def test_in_process_timeouts_must_be_ordered():
    with pytest.raises(ConfigError, match="resilience.in_process.soft_timeout_s=90.0 must be less than "
                                          "resilience.in_process.hard_timeout_s=90.0"):
        load_config(None, ["resilience.in_process.enabled=true", "resilience.in_process.soft_timeout_s=90"])
    with pytest.raises(ConfigError, match="resilience.hang_detection.step_timeout_s=30.0 must exceed "
                                          "resilience.in_process.hard_timeout_s=90.0"):
        load_config(None, ["resilience.in_process.enabled=true", "resilience.hang_detection.step_timeout_s=30"])
    with pytest.raises(ConfigError, match="stop.exit_code"):
        load_config(None, ["resilience.stop.exit_code=1"])  # would fail the job instead of restarting it


def test_a_fault_is_claimed_once_per_job(tmp_path):
    ledger = FaultLedger(tmp_path)
    spec = FaultSpec("sigkill", 7, 1)
    assert ledger.claim(spec, {"fault": str(spec), "key": spec.key, "t_fault": 1.0, "completed_step": 6})
    assert not ledger.claim(spec, {"fault": str(spec), "key": spec.key, "t_fault": 2.0, "completed_step": 6})
    assert [f["t_fault"] for f in ledger.fired()] == [1.0]


def test_ft_config_carries_the_resilience_settings_for_every_nvrx_version():
    cfg = load_config(None, ["resilience.hang_detection.step_timeout_s=30", "resilience.hang_detection.termination_signal=SIGTERM",
                             "resilience.launcher.max_restarts=5", "resilience.launcher.workers_stop_timeout_s=4"]).resilience
    ft = ft_config(cfg)["fault_tolerance"]
    assert ft["rank_section_timeouts"] == {"init": 900.0, "step": 30.0, "checkpoint": 900.0, "drain": 900.0}
    assert ft["rank_out_of_section_timeout"] == 600.0 and ft["rank_termination_signal"] == "SIGTERM"
    assert ft["rank_heartbeat_timeout"] is None and ft["enable_nic_monitor"] is False
    yaml.safe_dump(ft_config(cfg))  # plain YAML types only
    assert ft_launcher_flags(cfg) == ["--max-restarts=5", "--workers-stop-timeout=4", "--term-timeout=600"]
    # Both NVRx versions read these keys from the YAML file.
    from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig

    parsed = FaultToleranceConfig.from_kwargs(**ft)
    parsed._fix_rank_termination_signal_type()
    assert parsed.rank_section_timeouts["step"] == 30.0 and parsed.rank_termination_signal == signal.SIGTERM


def _write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_summary_counts_restarts_by_layer_and_goodput_from_the_files(tmp_path):
    ledger = FaultLedger(tmp_path)
    spec = FaultSpec("exception", 5, 0)
    ledger.claim(spec, {"fault": str(spec), "key": spec.key, "kind": "exception", "t_fault": 110.0,
                        "completed_step": 4})
    new = record_recoveries(ledger, "in_process", resumed_step=2, now=113.0)
    assert new == [{"fault": "exception@5:rank=0", "kind": "exception", "layer": "in_process", "recovery_s": 3.0,
                    "fault_step": 4, "resumed_from_step": 2, "lost_steps": 2}]
    assert record_recoveries(ledger, "in_job", resumed_step=2, now=120.0) == []  # each fault recovers once
    metrics = tmp_path / "metrics.jsonl"
    _write_metrics(metrics, [
        {"event": "start", "t": 100.0, "layer": "start"},
        {"event": "step", "step": 1, "step_time_s": 2.0},
        {"event": "step", "step": 2, "step_time_s": 2.0},
        {"event": "start", "t": 112.0, "layer": "in_process"},
        {"event": "step", "step": 3, "step_time_s": 2.0},
        {"event": "start", "t": 130.0, "layer": "job"},
        {"event": "step", "step": 4, "step_time_s": 2.0},
    ])
    s = summarize(metrics, ledger, now=140.0)
    assert s["restarts"] == {"in_process": 1, "in_job": 0, "job": 1}
    assert s["faults_injected"] == ["exception@5:rank=0"]
    assert s["recoveries"][0]["layer"] == "in_process"
    assert s["productive_s"] == 8.0 and s["job_wall_s"] == 40.0 and s["goodput"] == pytest.approx(0.2)


def test_a_recovery_says_where_its_time_went():
    from resilient_fsdp.resilience.accounting import phases

    marks = {"attempt": 105.0, "group": 105.5, "model": 106.25, "built": 106.5, "resumed": 107.0}
    # In-job or job: the new process started at 103 and spent 2 s importing before the attempt.
    assert phases(100.0, marks, now=107.25, process_start=103.0) == {
        "restart_s": 3.0, "process_start_s": 2.0, "group_s": 0.5, "model_s": 0.75, "engine_s": 0.25, "load_s": 0.5,
        "first_step_s": 0.25}
    # In-process: the process is older than the fault, so all of it before the attempt is restart.
    p = phases(100.0, marks, now=107.25, process_start=50.0)
    assert p["restart_s"] == 5.0 and p["process_start_s"] == 0.0
    assert sum(p.values()) == pytest.approx(7.25)  # the phases add up to recovery_s
    # An attempt that failed before its model was built: the later phases are 0, the sum holds.
    early = phases(100.0, {"attempt": 105.0, "group": 106.0}, now=107.0)
    assert early["model_s"] == early["engine_s"] == early["load_s"] == 0.0 and early["first_step_s"] == 1.0


def test_the_trainers_marks_put_the_phases_in_the_recovery_record(tmp_path):
    ledger = FaultLedger(tmp_path)
    spec = FaultSpec("exception", 5, 0)
    ledger.claim(spec, {"fault": str(spec), "key": spec.key, "kind": "exception", "t_fault": 100.0,
                        "completed_step": 4})
    (record,) = record_recoveries(ledger, "in_process", resumed_step=4, now=107.25,
                                  marks={"attempt": 105.0, "group": 105.5, "model": 106.25, "built": 106.5,
                                         "resumed": 107.0})
    assert record["recovery_s"] == 7.25
    assert sum(record["phases_s"].values()) == pytest.approx(record["recovery_s"])
    assert record["phases_s"]["group_s"] == 0.5 and record["phases_s"]["first_step_s"] == 0.25


def test_launcher_settings_are_understood_by_the_image_nvrx(nvrx_lane):
    """The image's NVRx (0.7) cannot be imported here without its service dependencies, so its
    sources are read: every key this project writes is a field of its FaultToleranceConfig, and
    every flag it passes is one its ft_launcher defines."""
    import ast

    ft_dir = nvrx_lane / "nvidia_resiliency_ext" / "fault_tolerance"
    tree = ast.parse((ft_dir / "config.py").read_text())
    (cls,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "FaultToleranceConfig"]
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    cfg = load_config(None, []).resilience
    assert set(ft_config(cfg)["fault_tolerance"]) <= fields
    launcher = (ft_dir / "launcher.py").read_text()
    for flag in [f.split("=")[0] for f in ft_launcher_flags(cfg)] + ["--ft-cfg-path"]:
        assert f'"{flag}"' in launcher, flag


def test_benchmarks_only_ever_delete_their_own_scratch_directories(tmp_path):
    from resilient_fsdp.bench.recovery import fresh_dir

    users = tmp_path / "users-data"
    users.mkdir()
    (users / "precious.txt").write_text("keep me")
    with pytest.raises(RuntimeError, match="refusing to delete it.*--run-dir"):
        fresh_dir(users)
    assert (users / "precious.txt").read_text() == "keep me"
    scratch = tmp_path / "scratch"
    fresh_dir(scratch)
    (scratch / "metrics.jsonl").write_text("{}")
    fresh_dir(scratch)  # a benchmark's own directory is emptied again
    assert [p.name for p in scratch.iterdir()] == [".resilient-fsdp-bench-scratch"]


def test_node_wrapper_kills_a_dead_ranks_helpers_but_not_detached_monitors():
    """Real processes: a rank is SIGKILLed and leaves a helper that ignores SIGTERM, plus a
    detached monitor in its own session (as NVRx's in-process monitor is)."""
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).with_name("sweeper_probe.py")
    proc = subprocess.run([sys.executable, "-W", "ignore", str(probe)], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["killed"] == [result["helper"]]
    assert result["alive"][str(result["helper"])] is False
    assert len(result["monitors"]) == 1 and result["alive"][str(result["monitors"][0])] is True


# ---- hang detection: configured timeouts are floors ---------------------------------------------

def test_learned_timeouts_never_go_below_the_configured_ones():
    from resilient_fsdp.resilience.rank_monitor import with_floors

    configured = {"init": 900.0, "step": 600.0, "checkpoint": 610.0, "drain": 610.0}
    # NVRx learned 5 x a few milliseconds for step and checkpoint, and for out-of-section time.
    learned = {"init": 900.0, "step": 0.4, "checkpoint": 0.6, "drain": 610.0}
    section, oos = with_floors(learned, 0.2, {"step", "checkpoint"}, True, configured, 300.0, 60.0)
    assert section == configured and oos == 300.0
    # A step that really takes long raises its timeout above the configured one.
    section, _ = with_floors({**learned, "step": 1500.0}, 0.2, {"step", "checkpoint"}, True, configured, 300.0, 60.0)
    assert section["step"] == 1500.0 and section["checkpoint"] == 610.0
    # Values restored from an older checkpoint: a missing section gets its configured value, a
    # section configured without a limit stays without one, and a short configured value still
    # gets the minimum when learned.
    section, oos = with_floors({"step": 2.0, "checkpoint": 3.0}, 1.0, {"step", "checkpoint"}, True,
                               {**configured, "step": 30.0, "checkpoint": None}, None, 60.0)
    assert section == {"init": 900.0, "step": 60.0, "checkpoint": None, "drain": 610.0} and oos is None


# ---- NVRx 0.7's restart health checks --------------------------------------------------------------

def _health_checks(names):
    """NVRx 0.7's ``Wrapper.restart_health_check``: a ``Compose`` of its checks. Stand-ins that carry
    their class names (the real ones need a GPU to run), composed by the installed NVRx's own
    ``Compose``; the real 0.7 wrapper is built below, in the image's lane."""
    from types import SimpleNamespace

    from nvidia_resiliency_ext.inprocess.compose import Compose
    from nvidia_resiliency_ext.inprocess.health_check import HealthCheck

    def check_class(name):
        return type(name, (HealthCheck,), {"__call__": lambda self, state, train_ex=None: state})

    checks = [check_class(n)() for n in names]
    return SimpleNamespace(restart_health_check=Compose(*checks)), checks


def test_without_a_gpu_only_the_gpu_nvlink_and_nic_checks_are_dropped_and_said(capsys):
    from resilient_fsdp.resilience.nvrx import adapt_health_checks

    wrapper, (user, *_hw) = _health_checks(["UserCheck", "ChainedGPUHealthCheck", "ChainedNVLHealthCheck",
                                             "ChainedNicHealthCheck"])
    dropped = adapt_health_checks(wrapper, gpu_present=False)
    assert dropped == ["ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "ChainedNicHealthCheck"]
    assert wrapper.restart_health_check is user
    assert "no GPU: in-process restart runs without NVRx's ChainedGPUHealthCheck" in capsys.readouterr().err
    wrapper, _ = _health_checks(["ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "ChainedNicHealthCheck"])
    adapt_health_checks(wrapper, gpu_present=False)
    assert wrapper.restart_health_check is None
    wrapper, checks = _health_checks(["UserA", "ChainedGPUHealthCheck", "UserB"])
    adapt_health_checks(wrapper, gpu_present=False)
    assert [type(c).__name__ for c in wrapper.restart_health_check.instances] == ["UserA", "UserB"]


def test_on_a_gpu_node_every_health_check_is_kept(capsys):
    """Simulated: this machine has no GPU, so the GPU branch is taken by passing gpu_present."""
    from resilient_fsdp.resilience.nvrx import adapt_health_checks

    wrapper, checks = _health_checks(["ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "ChainedNicHealthCheck"])
    before = wrapper.restart_health_check
    assert adapt_health_checks(wrapper, gpu_present=True) == []
    assert wrapper.restart_health_check is before and list(before.instances) == checks
    assert capsys.readouterr().err == ""


def test_nvrx_0_4_has_no_restart_health_checks_to_adapt():
    from nvidia_resiliency_ext import inprocess

    from resilient_fsdp.resilience.nvrx import adapt_health_checks

    wrapper = inprocess.Wrapper()
    assert not hasattr(wrapper, "restart_health_check") and adapt_health_checks(wrapper, gpu_present=False) == []


NVRX07_WRAPPER = """
import os, sys
os.environ["LOCAL_RANK"] = "0"
from nvidia_resiliency_ext import inprocess
from resilient_fsdp.resilience.nvrx import new_wrapper
wrapper = new_wrapper(inprocess.Wrapper, gpu_present=sys.argv[1] == "gpu", health_check=None)
checks = wrapper.restart_health_check
print("checks:", ",".join(type(c).__name__ for c in getattr(checks, "instances", ())) if checks else "none")
print("LOCAL_RANK:", os.environ["LOCAL_RANK"])
"""


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu-simulated"])
def test_nvrx07_wrapper_is_built_without_gpu_checks_only_without_a_gpu(nvrx_lane, gpu):
    """NVRx 0.7's real ``Wrapper`` (the image's lane). Without a GPU it is built without its GPU,
    NVLink and NIC checks, so no NVML error is logged, and the rank says so. The GPU branch is
    simulated (``gpu_present=True`` on this GPU-less machine): the three checks are built and
    kept, and constructing them on CPU is what logs the NVML errors the other branch avoids."""
    import subprocess
    import sys

    from resilient_fsdp.resilience.nvrx import GPU_HEALTH_CHECKS
    from tests.support import REPO, _env

    proc = subprocess.run([sys.executable, "-c", NVRX07_WRAPPER, "gpu" if gpu else "cpu"], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=_env([nvrx_lane]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOCAL_RANK: 0" in proc.stdout
    if gpu:
        assert f"checks: {','.join(GPU_HEALTH_CHECKS)}" in proc.stdout
        assert "no GPU" not in proc.stderr
        assert "NVMLError" in proc.stderr  # what the CPU branch must not log
    else:
        assert "checks: none" in proc.stdout
        assert "NVMLError" not in proc.stderr and "Failed to shut down NVML" not in proc.stderr, proc.stderr[-3000:]
        assert ("no GPU: in-process restart runs without NVRx's ChainedGPUHealthCheck, ChainedNVLHealthCheck, "
                "ChainedNicHealthCheck") in proc.stderr


def test_a_writer_fault_is_claimed_once_and_handed_to_the_checkpoint_writer(tmp_path):
    ledger = FaultLedger(tmp_path)
    injector = FaultInjector(parse_faults(["writer-slow@4:rank=1:for=2.5", "writer-hang@8:rank=1", "writer-exit@8"]),
                             rank=1, ledger=ledger)
    assert injector.writer_fault(3) is None
    assert injector.writer_fault(4) == "slow=2.5"
    assert injector.writer_fault(4) is None  # once per job: the save after a restart writes normally
    assert injector.writer_fault(8) == "hang"  # writer-exit@8 is rank 0's
    assert [f["fault"] for f in ledger.fired()] == ["writer-slow@4:rank=1:for=2.5", "writer-hang@8:rank=1"]
    with pytest.raises(ConfigError, match="writer-slow needs :for=SECONDS"):
        parse_fault("writer-slow@4")
