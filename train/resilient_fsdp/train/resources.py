"""What outlives an in-process restart: :class:`ProcessResources`, one per rank process."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

from .. import atomic
from ..checkpoint import open_files
from ..checkpoint import store as checkpoint_store
from ..checkpoint.engines import Engine, build_engine
from ..checkpoint.s3.uploader import Uploader
from ..config import Config
from ..resilience.graceful_stop import GracefulStop
from ..resilience.rank_monitor import ProgressMonitor
from .metrics import MetricsLog


class ProcessResources:
    """What outlives an in-process restart: the checkpoint engine (its writer process and staging
    buffers), the rank's S3 uploader (its backlog), the link to ``ft_launcher``'s rank monitor, and
    the SIGTERM flag. Re-creating the first would cost a process spawn per restart, the second
    would drop uploads; the others belong to the process, not to an attempt. Made first thing in
    a rank's process: it raises the process's open-files limit (:mod:`..checkpoint.open_files`)."""

    def __init__(self, cfg: Config):
        # First: the checkpoint writer started below inherits the limit.
        limit, first = open_files.raise_soft_limit()
        if first and int(os.environ.get("RANK", "0")) == 0:
            print(f"[resilient-fsdp] {limit.describe()}", file=sys.stdout, flush=True)
        self.cfg = cfg
        self.engine: Optional[Engine] = None
        self.uploader: Optional[Uploader] = None
        # Rank 0's summary of a finished run, written once, when the process closes (after its
        # uploads, whose outcome it includes).
        self.summary_path: Optional[Path] = None
        self.summary: Optional[dict] = None
        self.monitor = ProgressMonitor(cfg.resilience.hang_detection)
        self.stop = GracefulStop()
        self.stop.install()
        if cfg.checkpoint.mode != "sync":
            # The writer process starts now, in the background and at low priority, so that it is
            # ready when the first save after a (re)start comes (it imports torch for seconds).
            self.checkpoint_engine(int(os.environ.get("RANK", "0")))

    def checkpoint_engine(self, rank: int) -> Engine:
        if self.engine is not None and self.engine.hung:
            # A writer that outlived checkpoint.write_timeout_s may never take another write.
            self.engine.close(abort=True)
            self.engine = None
        if self.engine is not None:
            self.engine.rank = rank
        if self.engine is None:
            # The launcher signals a node's ranks by process group, which includes the writer
            # processes NVRx spawns: the engines start them with SIGTERM blocked, so they outlive
            # it for the graceful stop's final checkpoint; the engine's close ends them.
            self.engine = build_engine(
                self.cfg.checkpoint.mode, rank, self.cfg.checkpoint.writer_threads, self.cfg.checkpoint.planning
            )
        return self.engine

    def s3_uploader(self, rank: int, world_size: int = 1) -> Optional[Uploader]:
        """This rank's uploader (each rank uploads the files it wrote; rank 0 also the markers);
        None without ``checkpoint.s3.uri``. A new world size gets a new one."""
        s3 = self.cfg.checkpoint.s3
        if not s3.uri or not s3.upload:
            return None
        if self.uploader is not None and (self.uploader.rank, self.uploader.world_size) != (rank, world_size):
            self.uploader.close()
            self.uploader = None
        if self.uploader is None:
            self.uploader = Uploader(s3, rank, world_size)
        return self.uploader

    def keep_summary(self, path: Path, summary: dict) -> Path:
        """Rank 0: ``summary`` is written to ``path`` when this process closes; returns ``path``."""
        self.summary_path, self.summary = path, summary
        return path

    def close(self, failed: bool) -> None:
        try:
            if self.engine is not None:
                self.engine.close(abort=failed)
                self.engine = None
            # Before the uploads drain: a rank monitor would take a long drain for a hang.
            self.monitor.close()
            if self.uploader is not None:
                self.finish_uploads(failed)
        finally:
            if self.summary is not None:
                atomic.write_json(self.summary_path, self.summary)
                self.summary = None
            self.stop.uninstall()

    def finish_uploads(self, failed: bool) -> None:
        """Every rank, after the process group is gone (no peer waits in a collective meanwhile):
        give pending uploads ``checkpoint.s3.drain_timeout_s`` unless the attempt failed (then the
        restarted one uploads them); rank 0, which also waits for the markers, reports, applies
        local retention and puts the outcome into the summary.

        A SIGTERM during the wait ends it (the pod is going away; the next run uploads the rest).
        """
        uploader, self.uploader = self.uploader, None
        s3, ckpt = self.cfg.checkpoint.s3, self.cfg.checkpoint
        rank0 = uploader.rank == 0
        log = MetricsLog(Path(self.cfg.run_dir), rank0, self.cfg.train.log_every)
        try:
            pending = uploader.pending()
            if pending and not failed:
                log.info(
                    f"waiting up to {s3.drain_timeout_s:g} s for the S3 upload of step(s) "
                    f"{', '.join(map(str, pending))} (checkpoint.s3.drain_timeout_s)"
                )
                deadline, stopping = time.monotonic() + s3.drain_timeout_s, self.stop.requested
                # In slices, so errors show in the log as they happen and a SIGTERM is noticed.
                while not uploader.drain(min(1.0, max(0.0, deadline - time.monotonic()))):
                    report_s3_events(log, uploader)
                    if time.monotonic() >= deadline:
                        break
                    if self.stop.requested and not stopping:
                        log.info("SIGTERM received while waiting for S3 uploads: not waiting any longer")
                        break
            uploader.close()
            report_s3_events(log, uploader)
            if not rank0:
                return
            # Checkpoints kept only for their upload can go now (an abandoned one stays held).
            checkpoint_store.apply_retention(self.cfg.checkpoint_dir, ckpt.keep_last, held=uploader.holds, say=log.info)
            status = uploader.summary()
            if status["pending"]:
                log.info(
                    f"warning: step(s) {', '.join(map(str, status['pending']))} not uploaded to {s3.uri} "
                    f"(last error: {status['last_error']}); the next run with this checkpoint.dir uploads them"
                )
            if self.summary is not None:
                self.summary["s3"] = {**(self.summary.get("s3") or {}), **status}
        finally:
            log.close()


def report_s3_events(metrics: MetricsLog, uploader: Uploader) -> None:
    for event, message in uploader.take_events():
        metrics.event(event)
        metrics.info(message)
