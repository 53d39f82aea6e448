"""In-job hang detection: the trainer's sections, reported to ``ft_launcher``'s rank monitor.

:class:`ProgressMonitor` reports sections ``init``, ``step`` and ``checkpoint`` through NVRx's
``RankMonitorClient``; a rank that overstays a section (a hang) is killed and ``ft_launcher``
respawns the node's workers. Section timeouts are learned from observed durations and saved in
checkpoints. Outside ``ft_launcher`` every call is a no-op.
"""

from __future__ import annotations

import os
from typing import Optional

from ..config import ResilienceConfig

SECTIONS = ("init", "step", "checkpoint")


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
            # Closed one by one first: NVRx 0.7's end_all_sections() sends nothing and updates
            # nothing (rank_monitor_client.py: it passes section None, which
            # _should_monitor_section drops as not configured), so the sections of the failed
            # attempt stay open and the next start_section("step") raises "Tried to open step
            # that is already open" in every in-process restart.
            for section in sorted(self.open):
                self.client.end_section(section)
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
