"""The fault_tolerance: settings and the launcher flags, as both NVRx versions read them."""

from __future__ import annotations

import signal

import yaml

from resilient_fsdp.config import load_config
from resilient_fsdp.resilience.ft_config import ft_config, ft_launcher_flags


def test_ft_config_carries_the_resilience_settings_for_every_nvrx_version():
    cfg = load_config(
        None,
        [
            "resilience.hang_detection.step_timeout_s=30",
            "resilience.hang_detection.termination_signal=SIGTERM",
            "resilience.launcher.max_restarts=5",
            "resilience.launcher.workers_stop_timeout_s=4",
        ],
    ).resilience
    ft = ft_config(cfg)["fault_tolerance"]
    assert ft["rank_section_timeouts"] == {"init": 900.0, "step": 30.0, "checkpoint": 900.0, "drain": 900.0}
    assert ft["rank_out_of_section_timeout"] == 600.0 and ft["rank_termination_signal"] == "SIGTERM"
    assert ft["rank_heartbeat_timeout"] is None and ft["enable_nic_monitor"] is False
    yaml.safe_dump(ft_config(cfg))  # plain YAML types only
    assert ft["gpu_memory_poll_interval"] == 0.2
    assert ft_launcher_flags(cfg) == [
        "--max-restarts=5",
        "--workers-stop-timeout=4",
        "--term-timeout=600",
        "--monitor-interval=0.1",
    ]
    # Both NVRx versions read these keys from the YAML file.
    from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig

    parsed = FaultToleranceConfig.from_kwargs(**ft)
    parsed._fix_rank_termination_signal_type()
    assert parsed.rank_section_timeouts["step"] == 30.0 and parsed.rank_termination_signal == signal.SIGTERM


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
