"""The ``fault_tolerance:`` settings ``ft_launcher`` reads, and the launcher flags, from ``resilience``.

One function each, used by the local launcher (``resilient-fsdp local`` writes ``ft_config.yaml``).
The chart's ConfigMap writes the same file from the same values in its own template
(``resilient-fsdp.ftConfig`` in ``_helpers.tpl``); ``tests/test_layout.py`` renders the chart and
requires the two to be equal.

A file rather than flags: NVRx renamed its launcher flags between releases while the YAML keys
stayed (and unknown keys are ignored), so one file works with every NVRx version this project
supports. The flags left are torchrun's own, spelled the same in every version.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ..config import ResilienceConfig


def ft_config(cfg: ResilienceConfig) -> dict:
    """The ``fault_tolerance:`` section ``ft_launcher --ft-cfg-path`` reads (NVRx 0.4 to 0.7)."""
    hang = cfg.hang_detection
    return {
        "fault_tolerance": {
            # Hang detection uses sections; heartbeats are off.
            "initial_rank_heartbeat_timeout": None,
            "rank_heartbeat_timeout": None,
            # "drain": waiting for checkpoint writes and the end of the job, never learned; its budget
            # is the checkpoint timeout (resilience.rank_monitor).
            "rank_section_timeouts": {
                "init": hang.init_timeout_s,
                "step": hang.step_timeout_s,
                "checkpoint": hang.checkpoint_timeout_s,
                "drain": hang.checkpoint_timeout_s,
            },
            "rank_out_of_section_timeout": hang.out_of_section_timeout_s,
            "safety_factor": hang.safety_factor,
            "rank_termination_signal": hang.termination_signal,
            "workload_check_interval": hang.workload_check_interval_s,
            "gpu_memory_poll_interval": cfg.launcher.gpu_memory_poll_interval_s,
            # Watches InfiniBand link counters through NVML; EFA and CPU-only nodes have none.
            "enable_nic_monitor": False,
        }
    }


def ft_launcher_flags(cfg: ResilienceConfig) -> list[str]:
    """Launcher flags spelled the same in every supported NVRx version (torchrun's own)."""
    return [
        f"--max-restarts={cfg.launcher.max_restarts}",
        f"--workers-stop-timeout={cfg.launcher.workers_stop_timeout_s:g}",
        f"--term-timeout={cfg.stop.timeout_s:g}",
        f"--monitor-interval={cfg.launcher.monitor_interval_s:g}",
    ]


def write_ft_config(path: Path, cfg: ResilienceConfig) -> Path:
    """Write :func:`ft_config` as YAML to ``path`` (``ft_launcher --ft-cfg-path``)."""
    path.write_text(yaml.safe_dump(ft_config(cfg), sort_keys=False))
    return path
