"""NVRx's straggler detector, as this project drives it: ``attribution.straggler`` in NVRx 0.7,
``straggler`` in 0.4.1 (the same ``Detector``), found by import, not by version.

This module only starts the detector, opens its sections and turns a report into plain numbers;
what counts as a straggler, and what is done about one, is :mod:`.stragglers`'. Without a GPU
(or with a CUPTI extension that cannot load) NVRx's CUPTI manager is replaced by one that
profiles nothing, so only section timings are reported, and :attr:`StragglerDetector.kernels`
says why.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from ..checkpoint.writer.worker import cpu_shim


def _nvrx_straggler() -> Any:
    try:
        from nvidia_resiliency_ext.attribution import straggler  # NVRx 0.7
    except ImportError:
        from nvidia_resiliency_ext import straggler  # NVRx 0.4.1
    return straggler


class _NoKernelProfiler:
    """NVRx's ``CuptiManager`` interface, profiling no kernel: section timings only."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def initialize(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def start_profiling(self) -> None:
        pass

    def stop_profiling(self) -> None:
        pass

    def get_results(self) -> dict:
        return {}

    def reset_results(self) -> None:
        pass


@dataclass
class Scores:
    """One report, on rank 0: per section, each rank's score (the fastest rank's median time of
    the section over its own, 1.0 for the fastest) and this rank's own median; per rank, its
    kernels' score (NaN without kernel timings)."""

    sections: dict[str, dict[int, float]] = field(default_factory=dict)
    own_medians: dict[str, float] = field(default_factory=dict)
    kernels: dict[int, float] = field(default_factory=dict)

    def fastest_median(self, section: str, rank: int) -> Optional[float]:
        """The fastest rank's median time of ``section``, from ``rank``'s (this one's) own."""
        score, own = self.sections.get(section, {}).get(rank), self.own_medians.get(section)
        return None if score is None or own is None or not math.isfinite(score) else score * own


class StragglerDetector:
    """NVRx's ``Detector`` for one attempt: started here, shut down by :meth:`close` (it is one
    per process, and an in-process restart starts a new attempt)."""

    def __init__(self, cuda: bool, node_name: str):
        module = _nvrx_straggler()
        self.detector = module.Detector
        if self.detector.initialized:  # left by an attempt an in-process restart ended
            self.detector.shutdown()
        self.kernels: Optional[str] = None  # why CUDA kernels are not profiled, when they are not
        self.profile_cuda = cuda
        if not cuda:
            self.kernels = "no GPU: section timings only"
            module.straggler.CuptiManager = _NoKernelProfiler
        try:
            self._initialize(node_name)
        except ImportError as exc:  # NVRx's CUPTI extension (or libcupti) is missing on this GPU node
            self.kernels = f"NVRx's CUPTI extension did not load ({exc}): section timings only"
            self.profile_cuda = False
            module.straggler.CuptiManager = _NoKernelProfiler
            self._initialize(node_name)

    def _initialize(self, node_name: str) -> None:
        # The report is asked for every N steps (``report``), never on NVRx's clock.
        self.detector.initialize(
            scores_to_compute=["relative_perf_scores"],
            gather_on_rank0=True,
            profiling_interval=1,
            report_time_interval=float("inf"),
            node_name=node_name,
        )

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        with self.detector.detection_section(name, profile_cuda=self.profile_cuda):
            yield

    def report(self) -> Optional[Scores]:
        """Collective: score the steps since the last report; the scores on rank 0, else None."""
        with cpu_shim():
            report = self.detector.generate_report()
        if report is None:
            return None
        own = {name: summary[_median()] for name, summary in (report.local_section_summaries or {}).items()}
        sections = {name: dict(scores) for name, scores in (report.section_relative_perf_scores or {}).items()}
        return Scores(sections, own, dict(report.gpu_relative_perf_scores or {}))

    def close(self) -> None:
        if self.detector.initialized:
            self.detector.shutdown()


def _median() -> Any:
    return _nvrx_straggler().Statistic.MED
