"""The trainer's side of the three restart layers.

- **In-job** (``ft_launcher``): :class:`ProgressMonitor` reports sections ``init``, ``step`` and
  ``checkpoint`` to the node's rank monitor through NVRx's ``RankMonitorClient``; a rank that
  overstays a section (a hang) is killed and ``ft_launcher`` respawns the node's workers. Section
  timeouts are learned from observed durations and saved in checkpoints. :func:`ft_config` is
  the ``fault_tolerance:`` YAML the launcher reads: a file works with every NVRx version this
  project supports, whose command-line flag names differ.
- **In-process** (``inprocess.Wrapper``): :func:`run_in_process` re-enters the training function
  in the same processes after an exception or a hang on any rank.
- **Graceful stop**: :class:`GracefulStop` turns SIGTERM into "finish the step, commit a
  checkpoint, exit with a retryable code".

No ``from __future__ import annotations`` here: ``inprocess.Wrapper`` finds the parameter that
receives its ``CallWrapper`` by the annotation's class, which string annotations would hide.
"""

import datetime
import logging
import os
import signal
import socket
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .config import ResilienceConfig

# Set by the node wrapper: a file that exists once the node was asked to stop (SIGTERM).
NODE_STOP_ENV = "RESILIENT_FSDP_NODE_STOP_FILE"
# NVRx in-process restart warns at every start that its own logging was not configured.
warnings.filterwarnings("ignore", message="logging not initialized, logs are disabled")

SECTIONS = ("init", "step", "checkpoint")
log = logging.getLogger(__name__)


class StopRequested(BaseException):
    """The job was asked to stop (SIGTERM) and has committed a checkpoint.

    A BaseException so that in-process restart, which restarts on ``Exception``, lets it through.
    """

    def __init__(self, step: int, exit_code: int):
        super().__init__(f"stopped on request after step {step}, checkpoint committed")
        self.step, self.exit_code = step, exit_code


class InProcessRestartsExhausted(BaseException):
    """Passes through in-process restart to the in-job restart below it."""


def ft_config(cfg: ResilienceConfig) -> dict:
    """The ``fault_tolerance:`` section ``ft_launcher --ft-cfg-path`` reads (NVRx 0.4 to 0.7)."""
    return {"fault_tolerance": {
        # Hang detection uses sections; heartbeats are off.
        "initial_rank_heartbeat_timeout": None,
        "rank_heartbeat_timeout": None,
        "rank_section_timeouts": {"init": cfg.init_timeout_s, "step": cfg.step_timeout_s,
                                  "checkpoint": cfg.checkpoint_timeout_s},
        "rank_out_of_section_timeout": cfg.out_of_section_timeout_s,
        "safety_factor": cfg.safety_factor,
        "rank_termination_signal": cfg.termination_signal,
        "workload_check_interval": cfg.workload_check_interval_s,
        # Watches InfiniBand link counters through NVML; EFA and CPU-only nodes have none.
        "enable_nic_monitor": False,
    }}


def ft_launcher_flags(cfg: ResilienceConfig) -> list[str]:
    """Launcher flags spelled the same in every supported NVRx version (torchrun's own)."""
    return [f"--max-restarts={cfg.max_restarts}", f"--workers-stop-timeout={cfg.workers_stop_timeout_s:g}",
            f"--term-timeout={cfg.graceful_stop_timeout_s:g}"]


class ProgressMonitor:
    """Sections reported to ``ft_launcher``'s rank monitor; a no-op when not under ``ft_launcher``."""

    def __init__(self, cfg: ResilienceConfig):
        self.cfg = cfg
        self.client = None
        self.open: set[str] = set()
        self.learned = False
        self.seen_checkpoint = False
        self.steps_seen = 0
        if os.environ.get("FT_RANK_MONITOR_IPC_SOCKET"):
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()

    @property
    def active(self) -> bool:
        return self.client is not None

    def start(self, section: str) -> None:
        if self.client is not None and section not in self.open:
            self.client.start_section(section)
            self.open.add(section)

    def end(self, section: str) -> None:
        if self.client is not None and section in self.open:
            self.client.end_section(section)
            self.open.discard(section)
        if section == "step":
            self.steps_seen += 1
        elif section == "checkpoint":
            self.seen_checkpoint = True

    def reset(self) -> None:
        """Close whatever a failed attempt left open (in-process restart re-enters ``init``)."""
        if self.client is not None:
            self.client.end_all_sections()
        self.open.clear()

    def maybe_learn(self) -> Optional[dict]:
        """Learn section timeouts once enough was observed; collective. Returns them when learned."""
        if (self.client is None or self.learned or not self.cfg.learn_timeouts
                or self.steps_seen < self.cfg.learn_after_steps or not self.seen_checkpoint):
            return None
        ok = self.client.calculate_and_set_section_timeouts(selected_sections=["step", "checkpoint"],
                                                            calc_out_of_section=True, skip_if_not_ready=True)
        if not ok:
            return None
        self.learned = True
        self._apply_floor()
        return self.timeouts()

    def _apply_floor(self) -> None:
        # NVRx multiplies the longest observation by the safety factor; a 20 ms step would give a
        # 0.1 s timeout that any pause (GC, a slow disk, a busy host) exceeds.
        floor = self.cfg.min_learned_timeout_s
        st = self.client.section_timeouts
        raised = {k: (max(v, floor) if v is not None else None) for k, v in st.section.items()}
        oos = max(st.out_of_section, floor) if st.out_of_section is not None else None
        if raised != dict(st.section) or oos != st.out_of_section:
            st.section, st.out_of_section = raised, oos
            self.client._set_calculated_timeouts(new_hb_timeouts=None, new_section_timeouts=st)

    def timeouts(self) -> dict:
        if self.client is None:
            return {}
        st = self.client.section_timeouts
        return {"sections": dict(st.section), "out_of_section": st.out_of_section}

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the learned timeouts (the same on every rank)."""
        return dict(self.client.state_dict()) if self.client is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.client is not None and state:
            self.client.load_state_dict(state)
            if "section" in state.get(self.client.CURRENT_TIMEOUTS_STATE_KEY, {}):
                self.learned = True

    def close(self) -> None:
        if self.client is not None:
            self.client.shutdown_workload_monitoring()
            self.client = None


class GracefulStop:
    """SIGTERM to a node being evicted sets a flag the loop checks after each step.

    The flag is agreed across ranks with the step's loss all-reduce, so every rank stops at the
    same step and takes part in the final checkpoint. Two other SIGTERMs must still end the rank
    at once: the launcher's, when it restarts workers after a fault (their peers are gone, so a
    step could never finish), and a second one. They are told apart by the node wrapper
    (:mod:`resilient_fsdp.agent`), which marks the node as stopping before it forwards the signal.

    A rank blocked in a collective runs no Python signal handler until the collective returns,
    so the decision is made on a watcher thread woken through ``signal.set_wakeup_fd``.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._reader: Optional[socket.socket] = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._writer = writer
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._previous = signal.signal(signal.SIGTERM, lambda *_: None)  # the watcher acts
        threading.Thread(target=self._watch, name="sigterm-watcher", daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                data = self._reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self._on_sigterm()

    def _on_sigterm(self) -> None:
        rank = os.environ.get("RANK", "0")
        if self.requested or not node_is_stopping():
            # Restarting workers, or asked twice: leave now, as SIGTERM's default would.
            os._exit(128 + signal.SIGTERM)
        self.requested = True
        print(f"[resilient-fsdp] rank {rank}: SIGTERM received (node stopping): finishing the step, then "
              "checkpointing and exiting", file=sys.stderr, flush=True)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            signal.set_wakeup_fd(-1)
            self._previous = None


def node_is_stopping() -> bool:
    """True when the node wrapper received SIGTERM (or no wrapper runs: then every SIGTERM is
    treated as a request to stop gracefully)."""
    marker = os.environ.get(NODE_STOP_ENV)
    return marker is None or os.path.exists(marker)


# ---- in-process restart -------------------------------------------------------------------------

def _inprocess():
    from nvidia_resiliency_ext import inprocess
    return inprocess


def abort_process_groups() -> None:
    """Abort every process group's backend, then destroy them.

    NVRx's default abort handles NCCL only; gloo's ``abort`` (torch >= 2.7) fails the operations
    a rank can still be woken from. An operation waiting on a peer that never answers still runs
    to ``dist.timeout_s``: gloo has no way to cancel it, which is why tests keep that timeout short.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    for group in list(dist.distributed_c10d._world.pg_names):
        for device in ("cpu", "cuda"):
            try:
                backend = group._get_backend(torch.device(device))
            except (RuntimeError, ValueError, AttributeError):
                continue
            try:
                backend.abort()
            except (RuntimeError, AttributeError):
                pass
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError, AssertionError):
        pass


def _make_abort():
    inprocess = _inprocess()

    class AbortProcessGroups(inprocess.abort.Abort):
        def __call__(self, state):
            abort_process_groups()
            return state

    return AbortProcessGroups()


@dataclass(frozen=True)
class InProcessAttempt:
    """One call of the training function under in-process restart.

    ``number``: 0 for the first call, then one more per restart (equal on every rank).
    ``ping``: marks progress (once per step) for the wrapper's hang detection.
    ``store``: the key space this attempt's process group must rendezvous in.
    """
    number: int
    ping: Callable[[], None]
    store: Any


def run_in_process(cfg: ResilienceConfig, body: Callable[[InProcessAttempt], Any]) -> Any:
    """Run ``body(attempt)`` under ``inprocess.Wrapper``; on a fault anywhere, every rank calls it
    again (``attempt.number`` + 1) in the same process.

    ``body`` must create the process group (in ``attempt.store``) and the model itself and load
    the newest checkpoint.
    """
    inprocess = _inprocess()
    from nvidia_resiliency_ext.inprocess import CallWrapper

    seconds = datetime.timedelta
    soft = cfg.in_process_soft_timeout_s
    # Monitoring intervals must be shorter than the timeouts they serve; short timeouts (tests)
    # get proportionally short intervals.
    interval = seconds(seconds=min(1.0, soft / 5, cfg.in_process_heartbeat_timeout_s / 5))
    wrapper = inprocess.Wrapper(
        store_kwargs={"port": int(os.environ["MASTER_PORT"]) + cfg.in_process_store_port_offset},
        abort=_make_abort(),
        health_check=None,
        soft_timeout=seconds(seconds=soft),
        hard_timeout=seconds(seconds=cfg.in_process_hard_timeout_s),
        heartbeat_timeout=seconds(seconds=cfg.in_process_heartbeat_timeout_s),
        barrier_timeout=seconds(seconds=cfg.in_process_barrier_timeout_s),
        completion_timeout=seconds(seconds=cfg.in_process_barrier_timeout_s),
        monitor_thread_interval=interval,
        monitor_process_interval=interval,
        heartbeat_interval=interval,
        progress_watchdog_interval=interval,
        last_call_wait=seconds(seconds=min(1.0, soft / 10)),
        termination_grace_time=seconds(seconds=min(5.0, soft)),
    )
    # NVRx 0.7 adds GPU, NVLink and NIC health checks when LOCAL_RANK is set; on a CPU-only host
    # they fail and would turn every restart into a termination.
    if hasattr(wrapper, "restart_health_check"):
        wrapper.restart_health_check = None

    def attempt(call_wrapper: CallWrapper = None):
        iteration = call_wrapper.iteration
        if iteration >= cfg.in_process_max_iterations:
            raise InProcessRestartsExhausted(
                f"{iteration} in-process restarts reached resilience.in_process_max_iterations="
                f"{cfg.in_process_max_iterations}; leaving recovery to the in-job restart")
        # The wrapper's own store is hosted by rank 0 of this generation of processes, so it is
        # new after every in-job restart, and every rank of a generation agrees on the iteration.
        # Keys derived from TORCHELASTIC_RESTART_COUNT would not do: a node restarted because a
        # peer failed keeps its count, so nodes would rendezvous under different keys and hang.
        store = dist.PrefixStore(f"/resilient_fsdp/in_process_{iteration}", call_wrapper.base_store)
        return body(InProcessAttempt(iteration, call_wrapper.ping, store))

    return wrapper(attempt)()
