"""Every adaptation this project makes to NVRx's async checkpointing, in one place.

Two kinds live here and nowhere else:

1. **CPU-only torch builds.** NVRx assumes CUDA in its async path: ``torch.cuda.synchronize()``
   after staging (0.4.x, in the worker and in ``TorchAsyncCheckpoint.async_save``), CUDA tensors
   for its cross-rank "done" and "call index" checks, a CUDA tensor when it verifies cached save
   plans, and (0.7.x) ``torch.cuda.set_device`` at worker start. Without a GPU we

   - run staging / write calls under :func:`cpu_shim`, which makes ``torch.cuda.synchronize`` a
     no-op. The shim is installed only when ``torch.cuda.is_available()`` is False, and it is
     installed *inside NVRx's spawned worker* too, by :func:`worker_preload` / :func:`worker_write`,
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

The engines (:mod:`.engines`) reach NVRx only through this module: planning and scheduling an
async DCP save, polling a queue without NVRx's CUDA-tensor collectives, finalizing, closing.
The restart layers' adaptations are in :mod:`resilient_fsdp.resilience.nvrx`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import os
import signal
import tempfile
import threading
import traceback
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

NVRX_VERSION = importlib.metadata.version("nvidia-resiliency-ext")
# What checkpointing imports of NVRx, for reports of what a machine can import.
NVRX_MODULES = ("nvidia_resiliency_ext.checkpointing.async_ckpt.core",)


def cuda_present() -> bool:
    return torch.cuda.is_available()


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Within the block, ``torch.cuda.synchronize`` is a no-op when no GPU exists (else untouched).

    Synchronising is meaningless without a device: every CPU copy has completed when it returns.
    """
    if cuda_present():
        yield
        return
    original = torch.cuda.synchronize
    torch.cuda.synchronize = _noop
    try:
        yield
    finally:
        torch.cuda.synchronize = original


# ---- functions that run inside NVRx's spawned checkpoint worker ------------------------------
# Module-level so they pickle by reference; the worker imports this module, which has no side
# effects at import time.

def worker_preload(preload_fn: Callable[[], Any]) -> Any:
    """Runs NVRx's staging function in the worker, under :func:`cpu_shim`."""
    with cpu_shim():
        return preload_fn()


def worker_write(error_path: str, fault_exit: bool, save_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Runs NVRx's write function in the worker; a failure is recorded in ``error_path``.

    NVRx's persistent worker dies on an exception and never reports completion, which would leave
    the trainer waiting forever. Recording the error and returning normally lets the trainer see
    the call complete, read the error, and fail with a clear message at its next poll.
    """
    try:
        with cpu_shim():
            save_fn(*args, **kwargs)
        if fault_exit:
            # Fault injection (tests, drills): the writer dies after writing the data but before
            # the save is finalized, as a worker killed mid-save would.
            os._exit(137)
    except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it
        Path(error_path).write_text(traceback.format_exc())


def new_error_path() -> str:
    fd, path = tempfile.mkstemp(prefix="resilient-fsdp-ckpt-error-", suffix=".txt")
    os.close(fd)
    os.unlink(path)
    return path


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


def warm_up(calls_queue: Any) -> None:
    """Start the persistent worker now, with a no-op request, instead of at the first save.

    Starting a spawned interpreter that imports torch takes seconds; done at the first save it
    would all count as training-loop stall. Its completion is drained by the next poll.
    """
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

    calls_queue.schedule_async_request(AsyncRequest(_noop, (), []))


def start_results_queue() -> threading.Thread:
    """Start, in the background, the multiprocessing Manager through which NVRx's DCP writer
    returns its results (NVRx starts it at the first save, and waits seconds for the new
    interpreter). Join the returned thread before the first save.

    The thread blocks SIGTERM before starting the Manager: the mask is inherited across fork and
    exec, so the Manager ignores the SIGTERM a launcher sends to the rank's process group and
    lives on for a graceful stop's final checkpoint (it is ended by the rank at exit).
    """
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

    start = getattr(filesystem_async, "_get_write_results_queue", None)

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        if start is not None:
            start()

    thread = threading.Thread(target=run, name="nvrx-results-queue", daemon=True)
    thread.start()
    return thread


def schedule_dcp_save(calls_queue: Any, staged: Any, path: Path, thread_count: int, fault_exit: bool
                      ) -> tuple[tuple, str]:
    """Plan an async DCP save of ``staged`` (already staged in host buffers) into ``path`` and hand
    its write to the queue's worker. Returns the plan (for :func:`finalize_save`) and the file
    the worker records an error in (:func:`take_worker_error`).

    A rank with nothing to write schedules nothing; it still takes part in finalize.
    """
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    writer = FileSystemWriterAsync(str(path), thread_count=thread_count)
    with cpu_shim():
        plan = save_state_dict_async_plan(staged, writer, None, 0, planner=DefaultSavePlanner(),
                                          enable_cache=plan_cache_enabled())
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        error_path = new_error_path()
        if save_fn is not None:
            request = AsyncRequest(partial(worker_write, error_path, fault_exit, save_fn), save_args, [],
                                   async_fn_kwargs={},
                                   preload_fn=partial(worker_preload, preload_fn) if preload_fn else None)
            calls_queue.schedule_async_request(request)
    return plan, error_path


def torch_async_save(ckpt: Any, staged: Any, path: Path) -> None:
    """``TorchAsyncCheckpoint.async_save`` of ``staged`` into the file ``path``."""
    with cpu_shim():
        ckpt.async_save(staged, str(path))


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


def take_worker_error(error_path: str) -> Optional[str]:
    """The error :func:`worker_write` recorded (its last line, then the traceback), once; None if none."""
    if not os.path.exists(error_path):
        return None
    text = Path(error_path).read_text()
    os.unlink(error_path)
    return text.strip().splitlines()[-1] + "\n" + text


def finalize_save(plan: tuple) -> None:
    """Finish an async DCP save: gather every rank's write results and write ``.metadata``.

    With a GPU this is NVRx's ``save_state_dict_async_finalize``. Without one, the same steps
    minus the CUDA tensor that 0.7 broadcasts for failure status: the coordinator raises on a
    failure, and the caller's own all-reduce tells the other ranks.
    """
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_finalize

    if cuda_present():
        save_state_dict_async_finalize(*plan)
        return
    with cpu_shim():
        _finalize_on_cpu(plan)


def _finalize_on_cpu(plan: tuple) -> None:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.utils import _get_failure_dict

    storage_writer, global_metadata, dist_wrapper = plan
    write_results = storage_writer.retrieve_write_results()
    all_results = dist_wrapper.gather_object(write_results)
    if dist_wrapper.is_coordinator:
        failures = _get_failure_dict(all_results)
        if failures:
            raise CheckpointException("write", failures)
        storage_writer.finish(global_metadata, all_results)


def plan_cache_enabled() -> bool:
    # NVRx verifies a cached plan with a tensor allocated on "cuda".
    return cuda_present()


def worker_process(calls_queue: Any) -> Optional[Any]:
    """The ``multiprocessing.Process`` of the queue's persistent worker, if started."""
    caller = getattr(calls_queue, "persistent_caller", None)
    return getattr(caller, "process", None) if caller is not None else None


def close_queue(calls_queue: Any, abort: bool = False) -> None:
    """Stop the persistent worker; ``abort`` kills it without waiting for a write in flight.

    0.4.x has no abort, and its worker object joins a dead worker forever when garbage
    collected; forgetting the process after killing it avoids that.
    """
    if _accepts(calls_queue.close, "abort"):
        if not abort:
            calls_queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        calls_queue.close(abort=abort)
        return
    caller = getattr(calls_queue, "persistent_caller", None)
    if abort:
        proc = worker_process(calls_queue)
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
        if caller is not None:
            caller.process = None
        calls_queue.async_calls.clear()
        calls_queue.persistent_caller = None
        return
    # Drain locally first: close() would otherwise poll with NVRx's CUDA-tensor collective.
    calls_queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    calls_queue.close()
