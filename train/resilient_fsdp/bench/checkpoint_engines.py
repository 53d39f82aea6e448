"""The savers ``bench checkpoint`` compares, behind one interface (:class:`Saver`), and the loop
that measures each of them on the same trainer (:func:`measure`).

The savers (:data:`ENGINES`): the project's checkpointer with each engine (:class:`OurSaver`),
the memory tier (:class:`MemorySaver`), and torch DCP's own ``async_save`` (:class:`DcpSaver`).
Every saver's staging is awaited where the trainer awaits it, just before ``optimizer.step()``,
and commits are noticed when the loop polls after each step, for every saver alike.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from ..checkpoint.votes import Votes

DCP_PEERS = ("dcp_process", "dcp_thread")
# The first save of an engine may wait for its writer process to start (a niced interpreter
# importing torch while training keeps every core busy: tens of seconds on two cores).
COMMIT_TIMEOUT_S = 900
ENGINES = ("sync", "async", "torch-async", "memory") + DCP_PEERS


class Saver:
    """One way of checkpointing, as the measuring loop drives it."""

    def start(self, step: int) -> None:
        raise NotImplementedError

    def before_optimizer_step(self) -> float:
        return 0.0

    def votes(self) -> Votes:
        """What ``train_step`` adds to its all-reduce for the checkpointer (``Checkpointer.votes``):
        nothing due, nothing written, nothing committing, since the measuring loop starts and polls
        the saves."""
        return Votes()

    def poll(self) -> Optional[dict]:
        """The save's figures once committed (``write_s``, ``bytes``, ``wait_s``), else None."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class OurSaver(Saver):
    """The project's :class:`~..checkpoint.checkpointer.Checkpointer` with the ``sync``, ``async`` or
    ``torch-async`` engine (commit protocol, checksums, ``COMPLETE``).
    """

    def __init__(self, trainer: Any, mode: str, root: Path):
        from ..checkpoint.checkpointer import Checkpointer

        cfg = dataclasses.replace(trainer.cfg.checkpoint, mode=mode, keep_last=1, interval_steps=0)
        self.ckpt = Checkpointer(
            cfg, root / mode, trainer.checkpointer.group, trainer.checkpointer.state, trainer.checkpointer.identity
        )
        self.ckpt.preflight()
        self.record: Optional[dict] = None
        self.job: Any = None
        self.copy_wait_s = 0.0  # on CUDA: the wait for the device-to-host copy itself

    def start(self, step: int) -> None:
        self.record = self.ckpt.save(step)  # sync: committed here
        self.job = getattr(self.ckpt._engine, "job", None)  # the staging thread's CPU time
        self.copy_wait_s = 0.0

    def before_optimizer_step(self) -> float:
        waited = self.ckpt.before_optimizer_step()
        if self.job is not None and self.job.cuda:
            # Counted as DCP's staging counts it: until the device-to-host copy is over, not until
            # it is ordered before the optimizer step (which leaves the copy to the GPU's time).
            extra = self.job.wait_for_the_copy()
            self.copy_wait_s += extra
            waited += extra
        return waited

    def poll(self) -> Optional[dict]:
        record, self.record = self.record or self.ckpt.poll(), None
        if record is None:
            return None
        job, self.job = self.job, None
        cpu = {"staging_copy": job.copy_cpu_s, "staging_handoff": job.handoff_cpu_s} if job is not None else {}
        return {
            "write_s": record["write_s"],
            "bytes": record["bytes"],
            "wait_s": record["staging_wait_s"] + self.copy_wait_s,
            "call_s": record["save_call_s"],
            "commit_s": record["commit_on_thread_s"],
            "commit_background_s": _background(record),
            "thread_cpu_s": cpu,
        }

    def close(self) -> None:
        self.ckpt.close()


def _background(record: dict) -> float:
    """What rank 0's commit process did of a commit (``.metadata``, manifest, rename, the rest),
    beside training; 0 for a commit made on the training thread."""
    parts = record["commit_parts_s"]
    return parts["finalize_s"] + parts["manifest_s"] + parts["other_s"] if record["commit_background"] else 0.0


class MemorySaver(Saver):
    """The memory tier's save, its slots in a job directory of its own under ``/dev/shm``.

    The copy into the slot is awaited like the others' staging; the slot's CRC32C and record follow on
    its helper thread; committed means its record is written.
    """

    def __init__(self, trainer: Any, shm: Path = Path("/dev/shm")):
        import uuid

        from ..checkpoint.memory.tier import MemoryTier

        group = trainer.checkpointer.group
        self.state = trainer.checkpointer.state
        self.tier = MemoryTier(1, shm, f"bench-{uuid.uuid4().hex[:8]}", "bench", group.rank, group.world_size)
        self.t0, self.call_s, self.wait_s = 0.0, 0.0, 0.0
        self.step: Optional[int] = None

    def start(self, step: int) -> None:
        self.t0 = time.perf_counter()
        self.tier.save(step, self.state.state_dict())
        self.call_s, self.wait_s, self.step = time.perf_counter() - self.t0, 0.0, step

    def before_optimizer_step(self) -> float:
        job = self.tier._copy
        waited = self.tier.before_optimizer_step()
        if job is not None and job.cuda:  # until the copy is over, as for the other engines
            waited += job.wait_for_the_copy()
        self.wait_s += waited
        return waited

    def poll(self) -> Optional[dict]:
        self.before_optimizer_step()
        for record in self.tier.poll():
            if record["step"] == self.step:
                if record["error"]:
                    raise RuntimeError(f"memory: the save of step {self.step} failed: {record['error']}")
                return {
                    "write_s": time.perf_counter() - self.t0,
                    "bytes": record["bytes"],
                    "wait_s": self.wait_s,
                    "call_s": self.call_s,
                    "commit_s": 0.0,
                }
        return None

    def close(self) -> None:
        self.tier.close(remove=True)


class DcpSaver(Saver):
    """``torch.distributed.checkpoint.async_save`` as its documentation and torchtitan use it.

    In process or thread mode, with its ``DefaultStager`` and cached save plans
    (``DefaultSavePlanner(enable_plan_caching=True)``), as torchtitan configures it. Committed means
    DCP wrote its ``.metadata``.
    """

    def __init__(self, trainer: Any, mode: str, root: Path):
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        cuda = trainer.info.device.type == "cuda"
        self.state, self.root = trainer.checkpointer.state, root / mode
        self.root.mkdir(parents=True, exist_ok=True)
        self.kind = AsyncCheckpointerType.PROCESS if mode == "dcp_process" else AsyncCheckpointerType.THREAD
        # Pinned memory and non-blocking copies need an accelerator (DCP refuses them without one).
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=cuda
            )
        )
        self.planner = DefaultSavePlanner(enable_plan_caching=True)
        # DCP's async save needs a CPU backend; a GPU job's default group is NCCL only.
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo") if cuda else None
        self.response: Any = None
        self.t0 = 0.0
        self.path: Optional[Path] = None
        self.wait_s = 0.0
        self.staged = False

    def start(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        self.t0 = time.perf_counter()
        self.path = self.root / f"step_{step:08d}"
        self.response = dcp.async_save(
            self.state.state_dict(),
            storage_writer=FileSystemWriter(str(self.path)),
            planner=self.planner,
            process_group=self.group,
            async_checkpointer_type=self.kind,
            async_stager=self.stager,
        )
        self.wait_s, self.staged = 0.0, False

    def before_optimizer_step(self) -> float:
        if self.response is None or self.staged:
            return 0.0
        t0 = time.perf_counter()
        self.response.staging_completion.result()
        self.staged = True
        self.wait_s = time.perf_counter() - t0
        return self.wait_s

    def poll(self) -> Optional[dict]:
        self.before_optimizer_step()
        if not self.response.upload_completion.done():
            return None
        self.response.upload_completion.result()  # raises what failed
        write_s = time.perf_counter() - self.t0
        nbytes = sum(p.stat().st_size for p in self.path.iterdir())
        self.response = None
        return {"write_s": write_s, "bytes": nbytes, "wait_s": self.wait_s}

    def close(self) -> None:
        self.stager.close()


_CORE_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def core_times(since: Optional[dict] = None) -> dict:
    """Seconds each CPU spent in each state (``/proc/stat``), or since ``since``: who else used the
    cores (the writer at its nice level, the kernel writing back pages, the hypervisor's steal)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *values = line.split()
            if name.startswith("cpu") and name != "cpu":
                out[name] = {k: int(v) / tick for k, v in zip(_CORE_FIELDS, values)}
    if since is not None:
        out = {c: {k: v - since[c][k] for k, v in fields.items()} for c, fields in out.items() if c in since}
    return out


def page_faults() -> int:
    """Pages this process has faulted in so far (each a zeroed page on the training core's clock)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def make_saver(trainer: Any, mode: str, root: Path) -> Saver:
    if mode == "memory":
        return MemorySaver(trainer)
    return DcpSaver(trainer, mode, root) if mode in DCP_PEERS else OurSaver(trainer, mode, root)


def pin(training_cpu: int, writer_cpu: int) -> None:
    """Every thread of this (training) process on ``training_cpu``, every process it started (the
    writers and their helpers) on ``writer_cpu``."""
    import psutil

    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {training_cpu})
        except OSError:
            pass
    for child in psutil.Process().children(recursive=True):
        try:
            child.cpu_affinity([writer_cpu])
        except psutil.Error:
            pass


def measure(
    trainer: Any,
    mode: str,
    root: Path,
    saves: int,
    warmup_saves: int,
    step: int,
    pinned: Optional[tuple[int, int]] = None,
    saver: Optional[Saver] = None,
) -> tuple[dict, int]:
    """Save ``warmup_saves + saves`` times with ``mode`` (or with ``saver``, which ``mode`` then
    names), training between saves until each is committed; figures of the measured saves
    (median and min) and the next step number."""
    saver = saver or make_saver(trainer, mode, root)
    original = trainer.checkpointer
    trainer.checkpointer = saver  # train_step awaits this saver's staging before optimizer.step()
    cols: dict[str, list] = {
        "save_call_s": [],
        "wait_before_step_s": [],
        "commit_s": [],
        "commit_background_s": [],
        "stall_s": [],
        "write_s": [],
    }
    during: list[float] = []
    cpu: dict[str, list] = {}
    cores: dict[str, dict[str, list]] = {}
    faults: list[int] = []
    nbytes = 0
    try:
        for i in range(warmup_saves + saves):
            step += 1
            t0 = time.perf_counter()
            process_cpu0, main_cpu0, cores0 = time.process_time(), time.thread_time(), core_times()
            faults0 = page_faults()
            saver.start(step)
            call = time.perf_counter() - t0
            if pinned:
                pin(*pinned)
            steps: list[float] = []
            figures = saver.poll()
            while figures is None:
                t1 = time.perf_counter()
                trainer.train_step()
                figures = saver.poll()
                steps.append(time.perf_counter() - t1)
                if time.perf_counter() - t0 > COMMIT_TIMEOUT_S:
                    raise RuntimeError(f"{mode}: the save of step {step} was not committed within {COMMIT_TIMEOUT_S} s")
            if i < warmup_saves:
                continue
            # Where this process's CPU went from the save to its commit: what competes with the
            # step on its core (with --pin, all of it does).
            window = {
                "process": time.process_time() - process_cpu0,
                "main_thread": time.thread_time() - main_cpu0,
                **figures.get("thread_cpu_s", {}),
            }
            window["other_threads"] = window["process"] - sum(v for k, v in window.items() if k != "process")
            for name, value in window.items():
                cpu.setdefault(name, []).append(value)
            faults.append(page_faults() - faults0)
            for core, fields in core_times(cores0).items():
                for field, value in fields.items():
                    cores.setdefault(core, {}).setdefault(field, []).append(value)
            call = figures.get("call_s", call)
            cols["save_call_s"].append(call)
            cols["wait_before_step_s"].append(figures["wait_s"])
            # What the training thread spent on the commit: all of it when the commit is made
            # there (sync), the gather and the broadcast when rank 0's commit process made the rest
            # (``commit_background_s``, beside training like DCP's commit thread, which has no
            # commit_s); the background's cost to training shows in the step time during the write.
            commit = figures.get("commit_s", 0.0)
            cols["commit_s"].append(commit)
            cols["commit_background_s"].append(figures.get("commit_background_s", 0.0))
            cols["stall_s"].append(call + figures["wait_s"] + commit)
            cols["write_s"].append(figures["write_s"])
            during += steps
            nbytes = figures["bytes"]
    finally:
        trainer.checkpointer = original
        saver.close()
    out: dict = {"saves": saves, "bytes": nbytes, "steps_during_write": len(during) / max(1, saves)}
    for name, values in cols.items():
        out[name] = statistics.median(values)
        out[f"{name}_min"] = min(values)
        out[f"{name}_all"] = values
    out["cpu_s_during_write"] = {name: statistics.median(values) for name, values in cpu.items()}
    out["page_faults_during_write"] = statistics.median(faults) if faults else None
    out["core_s_during_write"] = {
        core: {f: statistics.median(v) for f, v in fields.items()} for core, fields in cores.items()
    }
    out["step_time_s"] = statistics.median(during) if during else None
    out["step_time_s_min"] = min(during) if during else None
    out["step_time_s_all"] = during
    return out, step
