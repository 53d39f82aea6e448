"""Every adaptation this project makes to NVRx's async checkpointing, in one place.

Two kinds live here and nowhere else:

1. **CPU-only torch builds.** NVRx assumes CUDA in its async path: ``torch.cuda.synchronize()``
   after staging (0.4.x, in the worker and in ``TorchAsyncCheckpoint.async_save``), CUDA tensors
   for its cross-rank "done" and "call index" checks, a CUDA tensor when it verifies cached save
   plans, and (0.7.x) ``torch.cuda.set_device`` at worker start. Without a GPU we

   - run staging / write calls under :func:`cpu_shim`, which makes ``torch.cuda.synchronize`` a
     no-op. The shim is installed only when ``torch.cuda.is_available()`` is False, and it is
     installed *inside NVRx's spawned worker* too, by the wrappers in :mod:`.nvrx_worker`,
     which wrap the functions NVRx sends there (a spawned worker starts from a fresh interpreter,
     so a patch made in the trainer would not reach it);
   - never ask NVRx for its CUDA-tensor collectives: the caller polls with ``no_dist=True`` and
     agrees across ranks with its own collective on the job's backend;
   - disable save-plan caching (its verification allocates on ``cuda``);
   - on 0.7.x start the worker in ``cpu_shm_mode`` (no CUDA context, shared-memory tensors).

2. **Version differences** between the pinned 0.4.1 (the newest release for glibc < 2.39) and the
   0.7.x the image ships: detected by feature (constructor parameters), not by version strings.

It also guarantees snapshot semantics: NVRx 0.4.1 hands CPU tensors to its worker without
copying them, so a later optimizer step could change what is written. The checkpointer stages
(copies) state into reused buffers before scheduling; see :mod:`.staging`.

3. **Correctness around NVRx's process-wide state.** NVRx's DCP writer returns every save's write
   results through one queue per process, and its finalize takes the oldest item, whatever save it
   belongs to. A write left in flight by a failed attempt (in-process restart) would make every
   later commit of the process use the previous write's offsets. Each save here puts its results
   into that queue *tagged* (:class:`TaggedResults`) and takes only its own (:func:`collect_save`);
   stale items are dropped. Errors of the worker (its write, its staging function, a worker that
   died) are recorded per save (:mod:`.integrity`'s channel) and never lost to an early reader. A
   worker that died is noticed before the next save (a new one is started) and at close (nothing
   waits for it); no call here waits without a deadline.

4. **Checksums while writing.** The files of a save are written through
   :class:`.integrity.HashingStream`: NVRx 0.7 takes the ``open`` to use (``open_file``); 0.4.1
   calls the name ``open`` of its module, which the worker sets for the duration of a write.

The engines (:mod:`.engines`) reach NVRx only through this module: planning and scheduling an
async DCP save, polling a queue without NVRx's CUDA-tensor collectives, finalizing, closing.
The restart layers' adaptations are in :mod:`resilient_fsdp.resilience.nvrx`.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import signal
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from queue import Empty
from typing import Any, Callable, Optional

from . import integrity
from .nvrx_worker import (_TAG, TaggedResults, _noop, cpu_shim, cuda_present, worker_preload, worker_torch_save,
                          worker_write)

NVRX_VERSION = importlib.metadata.version("nvidia-resiliency-ext")
# What checkpointing imports of NVRx, for reports of what a machine can import.
NVRX_MODULES = ("nvidia_resiliency_ext.checkpointing.async_ckpt.core",)


# ---- construction, by feature ------------------------------------------------------------------

def _accepts(fn: Any, name: str) -> bool:
    """Whether ``fn`` (a class: its ``__init__``) takes parameter ``name``. Classes are inspected
    through ``__init__`` because 0.7's queue has a metaclass whose ``__call__`` hides it."""
    target = fn.__init__ if isinstance(fn, type) else fn
    return name in inspect.signature(target).parameters


def make_calls_queue() -> Any:
    """NVRx's ``AsyncCallsQueue`` with a persistent worker, set up for this machine."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

    kwargs: dict[str, Any] = {"persistent": True}
    if _accepts(AsyncCallsQueue, "cpu_shm_mode") and not cuda_present():
        kwargs["cpu_shm_mode"] = True  # 0.7+: skip the worker's CUDA device setup
    return AsyncCallsQueue(**kwargs)


def make_torch_async_checkpoint() -> Any:
    """NVRx's ``TorchAsyncCheckpoint``; on 0.7+ without a GPU, its queue in ``cpu_shm_mode``."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import TorchAsyncCheckpoint

    ckpt = TorchAsyncCheckpoint()
    if not cuda_present() and _accepts(type(ckpt._async_calls_queue), "cpu_shm_mode"):
        ckpt._async_calls_queue.close()  # never started a worker; replace it
        ckpt._async_calls_queue = make_calls_queue()
    return ckpt


def calls_queue_of(ckpt: Any) -> Any:
    """The ``AsyncCallsQueue`` inside a ``TorchAsyncCheckpoint`` (NVRx keeps it private)."""
    return ckpt._async_calls_queue


def set_calls_queue(ckpt: Any, calls_queue: Any) -> None:
    ckpt._async_calls_queue = calls_queue


def warm_up(calls_queue: Any) -> None:
    """Start the persistent worker now, with a no-op request, instead of at the first save.

    Starting a spawned interpreter that imports torch takes seconds; done at the first save it
    would all count as training-loop stall. Its completion is drained by the next poll.
    """
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

    calls_queue.schedule_async_request(AsyncRequest(_noop, (), []))


def _results_queue_module() -> Any:
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

    return filesystem_async


def start_results_queue() -> threading.Thread:
    """Start, in the background, the multiprocessing Manager through which NVRx's DCP writer
    returns its results (NVRx starts it at the first save, and waits seconds for the new
    interpreter). Join the returned thread before the first save.

    The thread blocks SIGTERM before starting the Manager: the mask is inherited across fork and
    exec, so the Manager ignores the SIGTERM a launcher sends to the rank's process group and
    lives on for a graceful stop's final checkpoint (it is ended by the rank at exit).
    """
    fsa = _results_queue_module()
    start = getattr(fsa, "_get_write_results_queue", None)

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        if start is not None:
            start()

    thread = threading.Thread(target=run, name="nvrx-results-queue", daemon=True)
    thread.start()
    return thread


# ---- one async DCP save ------------------------------------------------------------------------

@dataclass
class DcpSave:
    """What the trainer keeps of one scheduled async DCP save until it is collected."""

    token: str
    channel: str
    plan: tuple  # (storage writer, global metadata or None, dist wrapper), from NVRx's planning
    has_data: bool


def schedule_dcp_save(calls_queue: Any, staged: Any, path: Path, thread_count: int, token: str, channel: str,
                      fault: Optional[str]) -> DcpSave:
    """Plan an async DCP save of ``staged`` (already staged in host buffers) into ``path`` and hand
    its write to the queue's worker; its results come back tagged with ``token``.

    A rank with nothing to write schedules nothing; it still takes part in finalize.
    """
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    writer = FileSystemWriterAsync(str(path), thread_count=thread_count)
    if hasattr(writer, "open_file"):  # 0.7+: the writer threads open files with this
        writer.open_file = partial(integrity.hashing_open, channel)
    with cpu_shim():
        plan = save_state_dict_async_plan(staged, writer, None, 0, planner=DefaultSavePlanner(),
                                          enable_cache=plan_cache_enabled())
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        if save_fn is not None:
            save_args = list(save_args)
            save_args[2] = TaggedResults(save_args[2], token)  # the results queue, in both versions
            request = AsyncRequest(partial(worker_write, channel, fault, save_fn), save_args, [],
                                   async_fn_kwargs={},
                                   preload_fn=partial(worker_preload, channel, preload_fn) if preload_fn else None)
            calls_queue.schedule_async_request(request)
    return DcpSave(token, channel, plan, save_fn is not None)


class _OneItem:
    """A results queue holding exactly one item, for the writer's own ``retrieve_write_results``."""

    def __init__(self, item: Any):
        self.item = item

    def get_nowait(self) -> Any:
        return self.item


def collect_save(save: DcpSave) -> tuple[Optional[list], Optional[str]]:
    """This rank's write results of ``save`` (after its write finished), or the error; never raises.

    Takes the save's own item from NVRx's results queue and drops stale ones. The writer's own
    ``retrieve_write_results`` then checks the item (an exception, a missing bucket).
    """
    storage_writer = save.plan[0]
    if not save.has_data:
        storage_writer.results_queue = None
        return _retrieve(storage_writer)
    try:
        item = _take_tagged(save.token)
    except Exception as exc:  # noqa: BLE001 - a dead Manager, an empty queue
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


def _take_tagged(token: str) -> Any:
    """The item tagged ``token`` in NVRx's results queue; older items are stale and dropped."""
    fsa = _results_queue_module()
    try:
        queue = fsa._get_write_results_queue()
        while True:
            try:
                item = queue.get_nowait()
            except Empty:
                raise RuntimeError("the checkpoint writer reported completion but left no write results") from None
            if isinstance(item, tuple) and len(item) == 3 and item[0] == _TAG and item[1] == token:
                return item[2]
    except (EOFError, BrokenPipeError, ConnectionError) as exc:
        fsa._results_queue = None  # its Manager died: the next save starts a new one
        raise RuntimeError(f"the writer's results queue is gone ({type(exc).__name__})") from exc


def drop_stale_results() -> int:
    """Empty NVRx's results queue (every item in it is stale once no write is in flight)."""
    fsa = _results_queue_module()
    if getattr(fsa, "_results_queue", None) is None:
        return 0
    dropped = 0
    try:
        while True:
            fsa._results_queue.get_nowait()
            dropped += 1
    except Empty:
        return dropped
    except (EOFError, BrokenPipeError, ConnectionError):
        fsa._results_queue = None
        return dropped


def write_dcp_metadata(save: DcpSave, all_results: list[list], recorder: integrity.Recorder) -> dict[str, dict]:
    """Coordinator: write ``.metadata`` from every rank's write results (hashed while written);
    returns its checksum. Raises on failure (the caller agrees on it with the other ranks)."""
    storage_writer, global_metadata, _ = save.plan
    storage_writer.fs = integrity.HashingFileSystem(recorder)
    with cpu_shim():
        storage_writer.finish(global_metadata, all_results)
    return recorder.take(renames={".metadata.tmp": ".metadata"})


def torch_async_save(ckpt: Any, staged: Any, path: Path, channel: str, fault: Optional[str]) -> None:
    """Schedule one rank's ``torch.save`` of ``staged`` into the file ``path`` on the worker of the
    ``TorchAsyncCheckpoint`` (its ``async_save`` would stage again, and its file is not hashed)."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

    calls_queue_of(ckpt).schedule_async_request(
        AsyncRequest(partial(worker_torch_save, channel, fault), (staged, str(path)), []))


# ---- polling and closing -----------------------------------------------------------------------

def poll_queue(calls_queue: Any, finalize: Optional[Callable[..., Any]] = None) -> tuple[bool, Optional[str]]:
    """(this rank's writes finished, an error if its worker died); never blocks.

    Finalizes finished calls locally (``no_dist``: NVRx's own agreement is a CUDA-tensor
    collective; the caller agrees across ranks on the job's backend). ``finalize``: the owner's
    finalize function when it is not the queue's (``TorchAsyncCheckpoint.finalize_async_save``).
    """
    finalize = finalize or calls_queue.maybe_finalize_async_calls
    if calls_queue.get_num_unfinalized_calls():
        finalize(blocking=False, no_dist=True)
    if calls_queue.get_num_unfinalized_calls():
        proc = worker_process(calls_queue)
        if proc is not None and not proc.is_alive():
            return True, f"the checkpoint writer process exited with code {proc.exitcode} before finishing"
        return False, None
    return True, None


def plan_cache_enabled() -> bool:
    # NVRx verifies a cached plan with a tensor allocated on "cuda".
    return cuda_present()


def worker_process(calls_queue: Any) -> Optional[Any]:
    """The ``multiprocessing.Process`` of the queue's persistent worker, if started."""
    caller = getattr(calls_queue, "persistent_caller", None)
    return getattr(caller, "process", None) if caller is not None else None


def worker_died(calls_queue: Any) -> Optional[int]:
    """The exit code of the queue's worker if it was started and is no longer running, else None."""
    proc = worker_process(calls_queue)
    if proc is not None and not proc.is_alive():
        return proc.exitcode
    return None


def _forget_worker(calls_queue: Any) -> None:
    """Drop every reference NVRx keeps to the worker, so that neither a later call nor garbage
    collection (whose ``close()`` would wait for it) ever waits for it again."""
    caller = getattr(calls_queue, "persistent_caller", None)
    if caller is not None:
        caller.process = None
    calls_queue.async_calls.clear()
    calls_queue.persistent_caller = None


def close_queue(calls_queue: Any, abort: bool = False, timeout_s: float = 60.0) -> None:
    """Stop the persistent worker; ``abort`` kills it without waiting for a write in flight.

    Never waits without a deadline: a worker that already died is only forgotten (NVRx's
    ``close()`` would wait forever for it to take its stop message); a live one gets ``timeout_s``
    to finish its writes and stop, then is killed.
    """
    proc = worker_process(calls_queue)
    if proc is None or not proc.is_alive():
        if proc is not None:
            proc.join(timeout=1)
        _forget_worker(calls_queue)
        return
    deadline = time.monotonic() + timeout_s
    if not abort:
        while calls_queue.get_num_unfinalized_calls() and proc.is_alive() and time.monotonic() < deadline:
            poll_queue(calls_queue)
            time.sleep(0.05)
        if proc.is_alive():
            calls_queue.persistent_caller.queue.put("DONE")
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=10)
    _forget_worker(calls_queue)
