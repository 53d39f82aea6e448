"""The ``async`` engine's DCP save through NVRx (an NVRx module, with :mod:`.process`).

Planning uses NVRx's ``save_state_dict_async_plan`` with an explicit plan cache (:class:`PlanCache`:
NVRx's ``enable_cache=True`` does nothing without one), or a plan each rank made alone
(:mod:`.decentralized_plan`, handed to NVRx as a validated cache, :func:`prefill`). The write
buckets are built here from the staged buffers (:func:`_staged_writer_class`): references into
the arena the worker already holds, no copy. NVRx's own multi-process (0.4.1) or multi-threaded
(0.7) writer writes them in its persistent worker; the results go into the save's report and are
checked against the files written (:func:`check_layout`). Used by :mod:`..engines`.
"""

from __future__ import annotations

import functools
import os
import pickle
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import WriteItemType

from ... import atomic
from .. import integrity, metadata_index
from . import handoff
from .process import WriterProcess
from .report import SaveReport
from .worker import cpu_shim, worker_write_staged


class PlanCache:
    """NVRx's ``CheckpointMetadataCache`` for one state structure and world size. NVRx never
    invalidates a validated cache (an added key would be left out of the checkpoint, a changed shape
    kept in its metadata), so a new one is made whenever the structure, the world size or the
    attempt changes.

    A save plans with the cache only when every rank's cache is :meth:`valid_for` its state (the
    checkpointer agrees on it in one collective); otherwise every rank starts a fresh cache. NVRx
    validates a cache at its second save (the plans match) and from the third on skips planning
    and every collective of it.

    **Kept for the rank's next process** (``kept``: a file in the pod's memory). A validated cache
    is plain data (the rank's local and central ``SavePlan``, the coordinator's global
    ``Metadata``), so it is written there once; a new process of the same rank (an in-job or
    in-process restart) starts from it, and its first save skips planning when every rank kept one
    for the same structure and world size. A plan depends on the state's structure, the world size
    and the rank alone, never on the pod or process group; a file of another rank, a torn or
    unreadable one is not taken, nor one another user could have written (unpickling runs code;
    outside a pod ``/dev/shm`` is every user's). A new pod (a lost node's) keeps none: then every rank plans.

    The coordinator's global metadata is the size of ``.metadata`` and pickles at its rate (about
    8 MB/s, object by object: 68 MB for 20 of 70b's layers at 1,024 ranks); a pickle holds the
    interpreter's lock, so a plan whose metadata has more than :attr:`KEEP_MAX_CHUNKS` chunks is
    not kept, and after a restart every rank plans, as without it.
    """

    FORMAT = 1
    # About a second of pickling on the coordinator's staging thread.
    KEEP_MAX_CHUNKS = 100_000

    def __init__(self, kept: Optional[Path] = None, rank: int = 0) -> None:
        self.cache: Any = None
        self.key: Optional[tuple] = None
        self.kept, self.rank = kept, rank
        self.kept_key: Optional[tuple] = None  # the key of the cache in ``kept``

    def valid_for(self, key: tuple) -> bool:
        return self.cache is not None and self.key == key

    def validated(self) -> bool:
        """The cache will skip planning (and its collectives) at the next save."""
        return self.cache is not None and bool(self.cache.get_cache_metadata()[2])

    def use(self, key: tuple, keep: bool) -> Any:
        """The cache for a save of ``key``: this one if ``keep`` (every rank agreed), else a new one."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import CheckpointMetadataCache

        if not keep or self.cache is None:
            self.cache, self.key = CheckpointMetadataCache(), key
        return self.cache

    def forget(self) -> None:
        self.cache, self.key = None, None

    def attach(self, kept: Optional[Path], rank: int) -> None:
        """A new attempt as ``rank``: start from the cache the pod kept for that rank, if any."""
        self.forget()
        self.kept, self.rank, self.kept_key = kept, rank, None
        if kept is None:
            return
        try:
            with open(kept, "rb", opener=_open_no_follow) as f:
                if not _ours(os.fstat(f.fileno())) or not _ours(os.stat(kept.parent)):
                    return  # a pickle runs code: only one this user wrote, in a folder only it writes to
                record = pickle.load(f)
            if record["format"] != self.FORMAT or record["rank"] != rank:
                return
            self.cache, self.key = record["cache"], record["key"]
            self.kept_key = self.key
        except Exception:  # noqa: BLE001 - none kept, or not readable: this process plans
            self.forget()

    def keep(self) -> Optional[str]:
        """Write a validated cache not yet kept to ``kept`` (atomically); why not, on failure."""
        if self.kept is None or not self.validated() or self.kept_key == self.key:
            return None
        chunks = metadata_chunks(getattr(self.cache, "cached_global_metadata", None))
        if chunks > self.KEEP_MAX_CHUNKS:
            self.kept_key = self.key  # said once
            return (
                f"rank {self.rank}: the save plan is not kept for the next process: its global metadata has "
                f"{chunks:,} chunks (more than {self.KEEP_MAX_CHUNKS:,}, about a second of pickling); "
                "a restarted rank plans its first save"
            )
        try:
            self.kept.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            data = pickle.dumps(
                {"format": self.FORMAT, "rank": self.rank, "key": self.key, "cache": self.cache},
                protocol=pickle.HIGHEST_PROTOCOL,
            )
            atomic.write_bytes(self.kept, data)
        except OSError as exc:
            self.kept_key = self.key  # said once; the next process plans
            return f"rank {self.rank}: the save plan could not be kept for the next process in {self.kept} ({exc})"
        self.kept_key = self.key
        return None

    def remove_kept(self) -> None:
        """The job has ended: the kept plan goes, and its folder once no rank's plan is left in it."""
        if self.kept is None:
            return
        try:
            self.kept.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            return
        try:
            self.kept.parent.rmdir()
        except OSError:
            pass


def prefill(cache: Any, plan: Any) -> Any:
    """NVRx's ``CheckpointMetadataCache`` holding a plan made alone
    (:class:`.decentralized_plan.DecentralizedPlan`) as a validated plan: NVRx's planning then
    skips every collective and hands back ``plan.metadata`` on the coordinator."""
    cache.cached_local_plan = plan.local
    cache.cached_central_plan = plan.central
    cache.cached_global_metadata = plan.metadata
    cache.validated_cache_reuse = True
    return cache


def _open_no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def _ours(st: os.stat_result) -> bool:
    """Owned by this user and writable by no one else (``/dev/shm`` is shared by every user of a
    machine outside a pod)."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def metadata_chunks(metadata: Any) -> int:
    """How many chunks a DCP ``Metadata`` describes (0 for None): what its pickle costs."""
    if metadata is None:
        return 0
    return sum(len(getattr(entry, "chunks", ())) for entry in metadata.state_dict_metadata.values())


@dataclass
class DcpSave:
    """What the trainer keeps of one async DCP save until it is collected."""

    token: str
    report: SaveReport
    plan: tuple  # (storage writer, global metadata or None, dist wrapper), from NVRx's planning
    has_data: bool


@functools.lru_cache(maxsize=1)
def _staged_writer_class() -> type:
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fsa

    class _StagedWriter(fsa.FileSystemWriterAsync):
        """NVRx's async DCP writer whose write buckets refer to registered staging buffers: NVRx
        0.7's own ``prepare_write_data`` clones every CPU tensor on the training thread and copies
        them into shared memory again; 0.4.1 sends a file descriptor per tensor with every save."""

        registry: handoff.Registry

        def prepare_write_data(self, plan: Any, planner: Any) -> None:
            file_count = 0
            buckets = []
            for bucket in fsa._split_by_size_and_type(self.thread_count, plan.items):
                data = [(item, planner.resolve_data(item)) for item in bucket]
                bytes_data = [(i, d) for i, d in data if i.type == WriteItemType.BYTE_IO]
                tensor_data = [(i, d.detach()) for i, d in data if i.type != WriteItemType.BYTE_IO]
                if bytes_data or tensor_data:
                    name = f"{plan.storage_data.prefix}{file_count}{DEFAULT_SUFFIX}"
                    file_count += 1
                    buckets.append((os.path.join(self.checkpoint_dir, name), name, (bytes_data, tensor_data)))
            self.write_buckets = buckets  # 0.4.1 checks its results against their number
            self.has_data_to_write = bool(buckets)  # 0.7
            self.consistent_data_identifier = None  # 0.7: no tensor cache of its own
            self.cached_tensor_data = self.uncached_tensor_data = self.byte_io_data = None
            self.storage_plan = plan.storage_data
            self.results_queue = None  # set per save: the save's report

    return _StagedWriter


def plan_dcp_save(
    staged: Any, path: Path, thread_count: int, report: SaveReport, registry: handoff.Registry, cache: Any
) -> tuple:
    """Plan a DCP save of ``staged`` into ``path`` with the plan ``cache``; collective unless the
    cache is validated. Returns NVRx's (storage writer, global metadata, dist wrapper)."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    writer = _staged_writer_class()(str(path), thread_count=thread_count)
    writer.registry = registry
    if hasattr(writer, "open_file"):  # 0.7+: the writer threads open files with this
        writer.open_file = report.open_hashed
    return save_state_dict_async_plan(
        staged, writer, None, 0, planner=DefaultSavePlanner(), enable_cache=True, metadata_cache=cache
    )


def schedule_dcp_save(
    writer_process: WriterProcess,
    plan: tuple,
    registry: handoff.Registry,
    token: str,
    report: SaveReport,
    fault: Optional[str],
) -> DcpSave:
    """Hand a planned save's write to the writer process: references into the arena (and the
    arena itself if this writer lacks it). Never waits for the writer. A rank with nothing
    to write schedules nothing; it still takes part in finalize."""
    writer = plan[0]
    if not writer.write_buckets:
        return DcpSave(token, report, plan, False)
    writer.results_queue = report
    save_fn, _staging_fn, save_args = writer.get_save_function_and_args()
    rank, _, results = save_args
    buffers = registry.payload_for(writer_process.pid)
    writer_process.send(
        report,
        buffers,
        partial(worker_write_staged, report, fault, registry.key, save_fn),
        (rank, registry.pack(writer.write_buckets), results),
    )
    registry.sent_to = writer_process.pid
    return DcpSave(token, report, plan, True)


class _OneItem:
    """A results queue holding exactly one item, for the writer's own ``retrieve_write_results``."""

    def __init__(self, item: Any):
        self.item = item

    def get_nowait(self) -> Any:
        return self.item


def collect_save(save: DcpSave) -> tuple[Optional[list], Optional[str]]:
    """This rank's write results of ``save`` (after its write finished), or the error; never raises.
    The writer's own ``retrieve_write_results`` checks the item (an exception, a missing bucket)."""
    storage_writer = save.plan[0]
    if not save.has_data:
        storage_writer.results_queue = None
        return _retrieve(storage_writer)
    try:
        item = save.report.results()
    except Exception as exc:  # noqa: BLE001 - nothing written, an unreadable file
        return None, f"{type(exc).__name__}: {exc}"
    storage_writer.results_queue = _OneItem(item)
    return _retrieve(storage_writer)


def _retrieve(storage_writer: Any) -> tuple[Optional[list], Optional[str]]:
    try:
        results = storage_writer.retrieve_write_results()  # 0.4 raises on a failure
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"
    if isinstance(results, tuple) and results and isinstance(results[0], BaseException):
        return None, f"{type(results[0]).__name__}: {results[0]}"  # 0.7 returns it wrapped
    return list(results), None


def write_metadata(path: Path, metadata: Any, all_results: list[list]) -> dict[str, dict]:
    """Coordinator (or its commit process): write DCP's ``.metadata`` into ``path`` from the plan's
    global ``metadata`` and every rank's write results, with torch's ``FileSystemWriter.finish``
    (what NVRx's writer does too), and the resume's index of it (:mod:`..metadata_index`), each
    hashed while written; returns their checksums. Raises on failure."""
    from torch.distributed.checkpoint import FileSystemWriter

    recorder = integrity.Recorder()
    writer = FileSystemWriter(str(path))
    writer.fs = integrity.HashingFileSystem(recorder)
    with cpu_shim():
        writer.finish(metadata, all_results)
    index = metadata_index.encode(metadata, metadata_index.storage_of(all_results))
    if index is not None:
        with writer.fs.create_stream(path / metadata_index.INDEX_FILE, "wb") as stream:
            stream.write(index)
            atomic.fsync_stream(stream)  # durable before the commit's manifest names it
    return recorder.take(renames={".metadata.tmp": ".metadata"})


def check_layout(results: list, checksums: dict[str, dict]) -> Optional[str]:
    """Every file the write results point into must have a checksum and end exactly where the
    last item written into it ends: results of another save would not."""
    ends: dict[str, int] = {}
    for r in results:
        info = r.storage_data
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        if name not in checksums:
            return f"no checksum was recorded for {name} (its writer bypassed the hashing stream)"
        if checksums[name]["bytes"] != end:
            return (
                f"the write results do not match {name}: its items end at byte {end} but "
                f"{checksums[name]['bytes']} bytes were written"
            )
    return None
