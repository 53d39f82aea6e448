"""In-job hang detection: the trainer's sections, reported to ``ft_launcher``'s rank monitor.

:class:`ProgressMonitor` reports the ``init``, ``step``, ``checkpoint`` and ``drain`` sections
through NVRx's ``RankMonitorClient``; a rank that overstays a section (a hang) is killed and
``ft_launcher`` respawns the node's workers. The timeouts of ``step``, ``checkpoint`` and
out-of-section time are learned from observed durations and saved in checkpoints, with the
configured values as floors (:func:`with_floors`). The attempt (:mod:`.attempt`) drives it;
outside ``ft_launcher`` every call is a no-op.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, Iterator, Optional

from ..config import HangDetectionConfig

SECTIONS = ("init", "step", "checkpoint", "drain")
LEARNED = ("step", "checkpoint")
PING_INTERVAL_S = 1.0


def with_floors(
    section: dict,
    out_of_section: Optional[float],
    calculated: set,
    oos_calculated: bool,
    configured: dict,
    configured_oos: Optional[float],
    minimum: float,
) -> tuple[dict, Optional[float]]:
    """Section timeouts with every learned value raised to its configured one (and to ``minimum``).

    A section not learned keeps its configured value; one configured ``None`` (no limit) stays
    unlimited; a section missing from ``section`` (an older checkpoint) gets its configured value.
    """

    def floor(learned: Optional[float], is_learned: bool, config: Optional[float]) -> Optional[float]:
        if config is None:
            return None
        if not is_learned or learned is None:
            return config
        return max(learned, minimum, config)

    raised = {name: floor(section.get(name), name in calculated, value) for name, value in configured.items()}
    return raised, floor(out_of_section, oos_calculated, configured_oos)


class ProgressMonitor:
    """Sections reported to ``ft_launcher``'s rank monitor; a no-op when not under ``ft_launcher``."""

    def __init__(self, cfg: HangDetectionConfig):
        self.cfg = cfg
        self.client = None
        self.open: set[str] = set()
        self.learned = False
        self.seen_checkpoint = False
        self.steps_seen = 0
        self._max_before: dict[str, float] = {}
        self.configured: dict = {}
        self.configured_oos: Optional[float] = None
        if os.environ.get("FT_RANK_MONITOR_IPC_SOCKET"):
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()
            # What ft_launcher enforces (its --ft-cfg-path file): the floors of every learned value.
            self.configured = dict(self.client.cfg.rank_section_timeouts)
            self.configured_oos = self.client.cfg.rank_out_of_section_timeout

    @property
    def active(self) -> bool:
        return self.client is not None

    def exclude_this_node(self, why: str) -> bool:
        """Ask ``ft_launcher`` to leave this node out of the next rendezvous (NVRx's workload
        control request, both versions): its launcher then fails the node as unhealthy (exit
        201) and a hot spare takes its place. False when not under ``ft_launcher``."""
        if self.client is None:
            return False
        from nvidia_resiliency_ext.fault_tolerance.data import WorkloadAction, WorkloadControlRequest

        self.client.send_workload_control_request(WorkloadControlRequest(WorkloadAction.ExcludeThisNode, why))
        return True

    def start(self, section: str) -> None:
        if self.client is not None and section not in self.open and section in self.configured:
            self._max_before[section] = self.client.timeouts_calc.section_to_max_time.get(section, -1)
            self.client.start_section(section)
            self.open.add(section)

    def end(self, section: str, learn: bool = True) -> None:
        """Close ``section``; ``learn=False``: its duration is not a sample for learning (a
        checkpoint call that neither saved nor committed one)."""
        if self.client is not None and section in self.open:
            self.client.end_section(section)
            self.open.discard(section)
            if not learn:
                self.client.timeouts_calc.section_to_max_time[section] = self._max_before.get(section, -1)
        if section == "step":
            self.steps_seen += 1
        elif section == "checkpoint" and learn:
            self.seen_checkpoint = True

    def reset(self) -> None:
        """Close whatever a failed attempt left open (in-process restart re-enters ``init``)."""
        if self.client is not None:
            # Closed one by one first: NVRx 0.7's end_all_sections() sends nothing and updates
            # nothing (rank_monitor_client.py: it passes section None, which
            # _should_monitor_section drops as not configured), so the sections of the failed
            # attempt stay open and the next start_section("step") raises "Tried to open step
            # that is already open" in every in-process restart.
            for section in sorted(self.open):
                self.client.end_section(section)
            self.client.end_all_sections()
        self.open.clear()

    @contextlib.contextmanager
    def draining(self, ping: Optional[Callable[[], None]] = None) -> Iterator[None]:
        """Run the block in the ``drain`` section (budget ``resilience.hang_detection.checkpoint_timeout_s``) and
        ping the in-process watchdog (``ping``) every second meanwhile, up to that budget.

        Sections open on entry are closed first (not learned from): their own, possibly learned,
        timeouts must not run while the block waits.
        """
        for section in list(self.open):
            if section != "drain":
                self.end(section, learn=False)
        self.start("drain")
        stop = threading.Event()
        pinger = None
        if ping is not None:
            budget = self.cfg.checkpoint_timeout_s
            deadline = time.monotonic() + budget if budget is not None else None

            def keep_alive() -> None:
                while not stop.wait(PING_INTERVAL_S):
                    if deadline is not None and time.monotonic() > deadline:
                        return  # over budget: let in-process restart's soft timeout act
                    ping()

            pinger = threading.Thread(target=keep_alive, name="drain-ping", daemon=True)
            pinger.start()
        try:
            yield
        finally:
            stop.set()
            if pinger is not None:
                pinger.join()
            self.end("drain", learn=False)

    def maybe_learn(self) -> Optional[dict]:
        """Learn section timeouts once enough was observed; collective. Returns them when learned."""
        if (
            self.client is None
            or self.learned
            or not self.cfg.learn_timeouts
            or self.steps_seen < self.cfg.learn_after_steps
            or not self.seen_checkpoint
        ):
            return None
        ok = self.client.calculate_and_set_section_timeouts(
            selected_sections=list(LEARNED), calc_out_of_section=True, skip_if_not_ready=True
        )
        if not ok:
            return None
        self.learned = True
        self._apply_floors()
        return self.timeouts()

    def _apply_floors(self) -> None:
        # NVRx replaces a configured value even by a lower one, and multiplies the longest
        # observation by the safety factor: a 20 ms step would give a 0.1 s timeout.
        st = self.client.section_timeouts
        section, oos = with_floors(
            dict(st.section),
            st.out_of_section,
            set(st.calculated_sections),
            bool(st.is_out_of_section_calculated),
            self.configured,
            self.configured_oos,
            self.cfg.min_learned_timeout_s,
        )
        if section != dict(st.section) or oos != st.out_of_section:
            updated = type(st)(
                section=section,
                out_of_section=oos,
                calculated_sections=set(st.calculated_sections) & set(section),
                is_out_of_section_calculated=st.is_out_of_section_calculated,
            )
            self.client._set_calculated_timeouts(new_hb_timeouts=None, new_section_timeouts=updated)

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
                self._apply_floors()  # never below what is configured now

    def close(self) -> None:
        if self.client is not None:
            # A drain still open (Trainer.close closes the monitor inside it) is closed first:
            # NVRx 0.7's monitor warns of sections left open at shutdown.
            for section in sorted(self.open):
                self.client.end_section(section)
            self.open.clear()
            self.client.shutdown_workload_monitoring()
            self.client = None
