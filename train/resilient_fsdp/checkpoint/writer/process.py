"""The rank's checkpoint writer process: :class:`WriterProcess`, NVRx's persistent worker behind
its ``AsyncCallsQueue``, and the adaptations to NVRx's async checkpointing (with :mod:`.dcp_plan`,
the DCP save path, and :mod:`.worker`, what runs inside the writer).

NVRx assumes CUDA in its async path. Without a GPU the write calls run under
:func:`.worker.cpu_shim`, the caller polls locally and agrees across ranks with its own
collective, and the plan cache is never seeded from loaded metadata (its check allocates on
``cuda``). The writer never needs a GPU, on GPU machines either: it reads host memory and writes
files. NVRx 0.4.1 (the newest release for glibc < 2.39) and 0.7 are told apart by feature
(constructor parameters), not by version. The worker starts with the rank's process
(:func:`_start_worker`); no call here waits on it without a deadline. The engines reach NVRx only
through this folder; the restart layers' adaptations are in :mod:`resilient_fsdp.resilience.nvrx`.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import signal
import threading
import time
from functools import partial
from typing import Any, Callable, Optional

from . import fork_server, handoff
from .priority import lower_this_thread
from .report import SaveReport
from .worker import take_request, writer_started

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
    if _accepts(AsyncCallsQueue, "cpu_shm_mode"):
        kwargs["cpu_shm_mode"] = True  # 0.7+: skip the worker's CUDA device setup (on GPUs too)
    if _accepts(AsyncCallsQueue, "cpu_priority"):
        kwargs["cpu_priority"] = None  # 0.7+: the worker inherits the writer priority (.priority)
    return AsyncCallsQueue(**kwargs)


def make_torch_async_checkpoint() -> Any:
    """NVRx's ``TorchAsyncCheckpoint``, its private queue replaced by one of :func:`make_calls_queue`
    (its own would start a worker set up for CUDA)."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import TorchAsyncCheckpoint

    ckpt = TorchAsyncCheckpoint()
    ckpt._async_calls_queue.close()  # never started a worker; replace it
    ckpt._async_calls_queue = make_calls_queue()
    return ckpt


class _WritersIn:
    """``torch.multiprocessing`` as NVRx's async checkpointing sees it: ``get_context('spawn')``,
    which NVRx asks for its persistent worker and its queues, is ``context``."""

    def __init__(self, base: Any, context: Any):
        self._base, self._context = base, context

    def get_context(self, method: Optional[str] = None) -> Any:
        return self._context if method == "spawn" else self._base.get_context(method)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def _start_writers_in(context: Optional[Any]) -> None:
    """NVRx's next persistent workers start in ``context`` (None: spawned, as NVRx does). NVRx
    asks its module's name ``mp`` (``torch.multiprocessing``) for ``get_context('spawn')``, for
    its worker and its queues; that name is replaced, in this process only."""
    import torch.multiprocessing
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core

    core.mp = torch.multiprocessing if context is None else _WritersIn(torch.multiprocessing, context)


def _start_worker(calls_queue: Any, rank: int, refused: Callable[[str], None]) -> threading.Thread:
    """Start the queue's persistent worker now, in the background, instead of at the first save.

    A spawned interpreter that imports torch takes seconds; at the first save it would be stall.
    Where the pod has a writer fork server (:mod:`.fork_server`), the worker is forked from it,
    already imported, and its first request hands it what it would have inherited. Otherwise it
    is spawned from a helper thread whose CPU and I/O priority are lowered first (the worker, and
    the threads and processes it starts per write, inherit both) and whose SIGTERM is blocked
    (inherited across exec: NVRx 0.7's SIGTERM handler never runs; the resource tracker is
    started before, since its start unblocks SIGTERM in the calling thread). Its first request
    hides the GPUs from it and makes it exit when this process is gone
    (:func:`.worker.writer_started`); the next poll drains that request's completion. Whatever
    the queue's feeder thread fails to send is passed to ``refused``. Join the thread before using
    the queue; its ``error`` then says what failed, if anything.
    """
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

    def run() -> None:
        from multiprocessing import resource_tracker

        try:
            lower_this_thread()
            resource_tracker.ensure_running()
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            context = fork_server.writer_context()
            _start_writers_in(context)
            caller = calls_queue._get_async_caller()
            caller.rank = rank  # NVRx would ask torch.distributed, which may not be initialised yet
            _report_feeder_errors(caller.queue, refused)
            given = fork_server.inheritance() if context is not None else None
            calls_queue.schedule_async_request(AsyncRequest(writer_started, (os.getpid(), rank, given), []))
        except BaseException as exc:  # noqa: BLE001 - the next save reports it (WriterProcess.usable)
            thread.error = f"the checkpoint writer process could not be started: {type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run, name="checkpoint-writer-start", daemon=True)
    thread.error = None
    thread.start()
    return thread


def _report_feeder_errors(queue: Any, refused: Callable[[str], None]) -> None:
    """A request ``queue``'s feeder thread fails to pickle or send goes to ``refused`` with the
    reason, instead of only being printed and dropped (the hook ``multiprocessing`` provides; the
    feeder takes it when it starts, at the first put)."""

    def on_error(exc: BaseException, obj: Any) -> None:
        fn = getattr(obj, "async_fn", None)
        name = getattr(getattr(fn, "func", fn), "__qualname__", type(obj).__qualname__)
        refused(f"the checkpoint writer's queue could not send the request for {name}: {type(exc).__name__}: {exc}")

    queue._on_queue_feeder_error = on_error


# ---- polling and closing -----------------------------------------------------------------------


def _poll_queue(calls_queue: Any, finalize: Optional[Callable[..., Any]] = None) -> tuple[bool, Optional[str]]:
    """(this rank's writes finished, an error if its worker died); never blocks.

    Finalizes finished calls locally (``no_dist``: NVRx's own agreement is a CUDA-tensor
    collective; the caller agrees across ranks on the job's backend). ``finalize``: the owner's
    finalize function when it is not the queue's (``TorchAsyncCheckpoint.finalize_async_save``).
    """
    finalize = finalize or calls_queue.maybe_finalize_async_calls
    if calls_queue.get_num_unfinalized_calls():
        finalize(blocking=False, no_dist=True)
    if calls_queue.get_num_unfinalized_calls():
        proc = _worker_process(calls_queue)
        if proc is not None and not proc.is_alive():
            return True, f"the checkpoint writer process exited with code {proc.exitcode} before finishing"
        return False, None
    return True, None


def _worker_process(calls_queue: Any) -> Optional[Any]:
    """The ``multiprocessing.Process`` of the queue's persistent worker, if started."""
    caller = getattr(calls_queue, "persistent_caller", None)
    return getattr(caller, "process", None) if caller is not None else None


def _forget_worker(calls_queue: Any) -> None:
    """Drop every reference NVRx keeps to the worker, so that neither a later call nor garbage
    collection (whose ``close()`` would wait for it) ever waits for it again."""
    caller = getattr(calls_queue, "persistent_caller", None)
    if caller is not None:
        caller.process = None
        # What was put for a worker that never read it must not hold the exit: a queue's feeder
        # thread blocked on a full pipe is otherwise joined at interpreter exit, forever.
        for name in ("queue", "preload_q", "comp_q"):
            q = getattr(caller, name, None)
            if q is not None and hasattr(q, "cancel_join_thread"):
                q.cancel_join_thread()
    calls_queue.async_calls.clear()
    calls_queue.persistent_caller = None


def _close_queue(calls_queue: Any, abort: bool = False, timeout_s: float = 60.0) -> None:
    """Stop the persistent worker; ``abort`` kills it without waiting for a write in flight.

    Never waits without a deadline: a worker that already died is only forgotten (NVRx's
    ``close()`` would wait forever for it to take its stop message); a live one gets ``timeout_s``
    to finish its writes and stop, then is killed.
    """
    proc = _worker_process(calls_queue)
    if proc is None or not proc.is_alive():
        if proc is not None and proc.pid is not None:  # started (a start can fail)
            proc.join(timeout=1)
        _forget_worker(calls_queue)
        return
    deadline = time.monotonic() + timeout_s
    if not abort:
        while calls_queue.get_num_unfinalized_calls() and proc.is_alive() and time.monotonic() < deadline:
            _poll_queue(calls_queue)
            time.sleep(0.05)
        if proc.is_alive():
            calls_queue.persistent_caller.queue.put("DONE")
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=10)
    _forget_worker(calls_queue)


# ---- the writer process, as the engines use it -------------------------------------------------


class WriterProcess:
    """One rank's checkpoint writer: NVRx's persistent worker, started in the background as soon
    as this object is made (``torch_save``: the worker of a ``TorchAsyncCheckpoint``, whose
    finalize the polls use). Replaced, never waited for, when it dies or hangs.

    Requests carry no staging function, so scheduling one never waits for the worker to take it;
    they are pickled before they are queued (:mod:`.handoff`: NVRx's queue would drop one that
    cannot be, silently). Write results and errors come back through each save's own report,
    never through NVRx's process-wide results queue, whose Manager process (seconds to start
    after every restart) is therefore never started."""

    def __init__(self, rank: int, torch_save: bool = False):
        self.rank = rank
        self.torch_checkpoint = make_torch_async_checkpoint() if torch_save else None
        self.queue = self.torch_checkpoint._async_calls_queue if torch_save else make_calls_queue()
        # Set by the queue's feeder thread: a request it could not send (NVRx's bookkeeping then
        # waits for a completion that never comes, so the writer is replaced before the next save).
        self.refused: Optional[str] = None
        self.starting = _start_worker(self.queue, rank, self._refuse)
        self.notes: list[str] = []  # said by the checkpointer at the next save

    def _refuse(self, reason: str) -> None:
        self.refused = self.refused or reason

    @property
    def process(self) -> Optional[Any]:
        """The worker's ``multiprocessing.Process``, once started."""
        return _worker_process(self.queue)

    @property
    def pid(self) -> Optional[int]:
        proc = self.process
        return proc.pid if proc is not None else None

    def restart(self) -> None:
        """Kill this worker (whatever it is writing) and start a new one in the background."""
        self.starting.join()
        _close_queue(self.queue, abort=True)
        self.queue = make_calls_queue()
        if self.torch_checkpoint is not None:
            self.torch_checkpoint._async_calls_queue = self.queue
        self.refused = None
        self.starting = _start_worker(self.queue, self.rank, self._refuse)

    def usable(self) -> Optional[str]:
        """Wait for the worker's start; None when it can take a write, else why not. A worker that
        could not start is replaced for the next save; one that died since is replaced now."""
        self.starting.join()
        if self.starting.error:
            error = self.starting.error
            self.restart()
            return error
        proc = _worker_process(self.queue)
        if proc is not None and not proc.is_alive():
            self.notes.append(
                f"rank {self.rank}: the checkpoint writer process had exited (code {proc.exitcode}) "
                "since the last save; a new one is started"
            )
            self.restart()
            self.starting.join()
        elif self.refused:
            self.notes.append(f"rank {self.rank}: a new checkpoint writer is started ({self.refused})")
            self.restart()
            self.starting.join()
        return None

    def send(
        self, report: SaveReport, buffers: Optional[handoff.Buffers], fn: Callable[..., None], args: tuple
    ) -> None:
        """Hand ``fn(*args)`` to the worker, with ``buffers`` (the arena) first unless it holds them;
        never waits for it to be taken. Pickled here (:func:`.handoff.encode_request`), so that a
        request that cannot be raises :class:`.handoff.NotSendable`, naming what cannot, before
        anything is sent; failures in the worker are recorded in ``report``."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

        request = handoff.encode_request(fn, args)  # first: nothing of the arena is shared on failure
        shared = handoff.encode(buffers) if buffers is not None else None
        self.queue.schedule_async_request(
            AsyncRequest(partial(take_request, report), (shared, request), [], async_fn_kwargs={})
        )

    def poll(self) -> tuple[bool, Optional[str]]:
        """(every scheduled write finished, an error if the worker died or a request could not be
        sent to it); never blocks."""
        if self.refused:
            return True, self.refused
        finalize = self.torch_checkpoint.finalize_async_save if self.torch_checkpoint is not None else None
        return _poll_queue(self.queue, finalize)

    def close(self, abort: bool = False) -> None:
        """Stop the worker: let it finish its writes (``abort``: kill it at once)."""
        self.starting.join()
        _close_queue(self.queue, abort=abort)
