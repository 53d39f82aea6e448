"""Staging: a snapshot of the state in reused host buffers, copied while training goes on.

A save takes the state's structure and every non-tensor value at once (they change with the next
micro-batch: the sampler position, the random streams), then copies the tensors into host buffers
in the background. Parameters and optimizer state do not change before ``optimizer.step()``, so
the copy overlaps the next forward and backward; the trainer waits for it just before the step
(:meth:`StagingJob.wait`) and only that wait counts as stall. On CPU the copy runs in a helper
thread; on a GPU it is queued on a side CUDA stream (device-to-host into pinned memory) and the
optimizer's stream waits for it on the device, not the host.
"""

from __future__ import annotations

import copy
import itertools
import os
import queue
import threading
import time
from typing import Any, Callable, Iterator, Optional

import torch
from torch.distributed._state_dict_utils import _copy_state_dict
from torch.distributed.tensor import DTensor

from .arena import Arena, plan

_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def scalars_only(seq: Any) -> bool:
    """Whether ``seq`` (a list or tuple) holds scalars alone, found without a Python loop: the
    walks below step over such a sequence whole (Python's random state is a tuple of 625 ints, in
    every state taken)."""
    return set(map(type, seq)) <= _SCALARS


def structure(sd: Any, key: str = "") -> tuple:
    """What the buffers and a save plan depend on: every value's place, every tensor's kind, (local)
    shape and dtype, the shape of the containers around them; non-tensor leaves by place only
    (their pickled size does not enter a plan)."""
    out: list = []
    _structure(sd, key, out)
    return tuple(out)


def _structure(sd: Any, key: str, out: list) -> None:
    if isinstance(sd, DTensor):
        local = sd._local_tensor
        out.append((key, "dtensor", tuple(local.shape), local.dtype, tuple(sd.shape)))
    elif isinstance(sd, torch.Tensor):
        out.append((key, "tensor", tuple(sd.shape), sd.dtype))
    elif isinstance(sd, dict):
        out.append((key, "dict", len(sd)))
        for k, v in sd.items():
            _structure(v, f"{key}/{k}", out)
    elif isinstance(sd, (list, tuple)):
        out.append((key, type(sd).__name__, len(sd)))
        if scalars_only(sd):
            out.extend((f"{key}/{i}", "object") for i in range(len(sd)))
            return
        for i, v in enumerate(sd):
            _structure(v, f"{key}/{i}", out)
    else:
        out.append((key, "object"))


def local_tensors(sd: Any) -> list[torch.Tensor]:
    """Every tensor of ``sd`` (a DTensor's local shard), in a fixed order."""
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, DTensor):
            out.append(x._local_tensor)
        elif isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)) and not scalars_only(x):
            for v in x:
                walk(v)

    walk(sd)
    return out


class StateStager:
    """Host buffers allocated once and reused, so the file holds exactly the state of the step it is
    named for while the loop goes on changing the live tensors.

    The buffers are views into one :class:`.arena.Arena` per structure: one block of shared memory
    (one file descriptor however many tensors; the writer receives it once and keeps it,
    :mod:`.writer.handoff`), pinned on GPUs, DTensors kept as DTensor wrappers around their host
    buffer, so nothing is copied back to the device. Reuse is what keeps the save cheap: a fresh
    buffer costs a page fault per page, about as long as a whole synchronous save on a CPU-only
    machine. A change of structure (a key, a shape, a dtype) replaces the arena under a new
    ``generation``.
    """

    def __init__(self) -> None:
        self.pin = torch.cuda.is_available()
        self.arena: Optional[Arena] = None
        self.buffers: Any = None
        self.key: tuple = ()
        self.generation = 0
        self.job: Optional[StagingJob] = None
        self.allocating: Optional[threading.Thread] = None

    def allocate_in_background(self, sd: Any) -> None:
        """Allocate the buffers for ``sd``'s structure on a helper thread, while training goes on,
        so that the first save of a process does not: it cost 0.48 of the 0.58 s that a first save of
        the ``tiny`` state took in the save call, and more the larger the state (a page fault per
        page; pinning on GPUs). The next :meth:`prepare` waits for it and reuses the buffers if the
        structure is still the same. The live values may change meanwhile: each save's copy overwrites
        whatever the buffers hold."""
        self.wait()
        if self.buffers is not None:
            return
        key = structure(sd)
        # A new thread starts on device 0: pinning from there would open a CUDA context on GPU 0
        # for every rank of the node.
        device = torch.cuda.current_device() if self.pin else None

        def run() -> None:
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                self._allocate(sd, key)
            except BaseException:  # noqa: BLE001 - the next prepare allocates them again, raising what fails there
                self.arena, self.buffers, self.key = None, None, ()

        self.allocating = threading.Thread(target=run, name="checkpoint-staging-allocate", daemon=True)
        self.allocating.start()

    def _allocate(self, sd: Any, key: tuple) -> None:
        slots, nbytes = plan(local_tensors(sd))
        arena = Arena(nbytes, pin=self.pin)
        views = iter([arena.view(slot) for slot in slots])
        self.buffers = replace_tensors(sd, views)
        self.arena = arena
        self.key = key
        self.generation += 1

    def prepare(self, sd: Any, key: Optional[tuple] = None) -> Any:
        """``sd``'s structure over this stager's buffers (DTensors stay DTensors) with copies of every
        non-tensor value; the buffers are filled by :meth:`start_copy`. ``key``: ``structure(sd)``."""
        self.wait()  # a copy still running belongs to the previous save's buffers
        key = structure(sd) if key is None else key
        if self.buffers is None or key != self.key:
            self.close()
            self._allocate(sd, key)
        return _snapshot(sd, self.buffers)

    def start_copy(self, sd: Any, then: Optional[Callable[[], None]] = None) -> "StagingJob":
        """Copy ``sd``'s tensors into the buffers in the background; ``then`` runs after the copy,
        off the training thread (the hand-off to the writer)."""
        self.job = StagingJob(sd, self.buffers, self.pin, then)
        return self.job

    def failed(self, error: str) -> "StagingJob":
        """A job that copies nothing and fails with ``error`` (what :meth:`prepare` raised)."""
        self.job = StagingJob(None, None, False, None, error=f"staging the state into host buffers failed: {error}")
        return self.job

    def stage(self, sd: Any) -> Any:
        """Prepare and copy, waiting for the copy (tests, and callers with nothing to overlap)."""
        staged = self.prepare(sd)
        self.start_copy(sd).wait()
        self.job.join()
        return staged

    def wait(self) -> None:
        """Until a copy in flight has finished (and its follow-up too), and an allocation."""
        if self.allocating is not None:
            self.allocating.join()
            self.allocating = None
        if self.job is not None:
            self.job.join()

    def close(self) -> None:
        """Release the buffers (and the arena's pinned registration)."""
        self.wait()
        if self.arena is not None:
            self.arena.close()
        self.arena, self.buffers, self.key = None, None, ()


class _Helpers:
    """Daemon threads that run staging jobs, kept between saves: a save's copy starts without a new
    thread's start-up (``Thread.start`` waits for the thread to take the GIL: about a millisecond
    on an idle core, several on a busy one, at every save). A job never waits behind another (one
    still running, a hand-off to a hung writer among them): with no idle thread, a new one starts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[queue.SimpleQueue] = []

    def submit(self, job: Callable[[], None]) -> None:
        with self.lock:
            inbox = self.idle.pop() if self.idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._loop, args=(inbox,), name="checkpoint-staging", daemon=True).start()
        inbox.put(job)

    def _loop(self, inbox: queue.SimpleQueue) -> None:
        while True:
            inbox.get()()
            with self.lock:
                self.idle.append(inbox)


_helpers = _Helpers()


def _forget_helpers() -> None:
    """A forked child has none of its parent's threads (and maybe a lock held by one of them)."""
    global _helpers
    _helpers = _Helpers()


os.register_at_fork(after_in_child=_forget_helpers)


class StagingJob:
    """One background copy into the staging buffers, then an optional follow-up, on a helper thread.

    :meth:`wait` returns once the state may change (the copy has finished, or on a GPU is ordered
    before the current stream's next work); :meth:`join` once the follow-up is done as well.
    ``error`` holds what failed (as text); nothing is raised across threads.
    """

    def __init__(
        self, sd: Any, buffers: Any, cuda: bool, then: Optional[Callable[[], None]], error: Optional[str] = None
    ):
        self.cuda = cuda
        self.error: Optional[str] = error  # given: the job never copies (the buffers could not be made)
        self.copied = threading.Event()  # the copy is done (CPU) or queued on the side stream (GPU)
        self.copy_s = 0.0
        # CPU seconds of this job's thread: the copy, and the hand-off that follows it (planning
        # from a cached plan, the request to the writer). Training pays for both on a shared core.
        self.copy_cpu_s = 0.0
        self.handoff_cpu_s = 0.0
        self._done_event = None
        self._ready_event = None
        self._device = None
        if cuda and error is None:  # the side stream must start after what the training stream queued so far
            self._device = torch.cuda.current_device()  # a new thread starts on device 0
            self._ready_event = torch.cuda.Event()
            self._ready_event.record()
        self.finished = threading.Event()  # the copy and the follow-up are over
        _helpers.submit(lambda: self._run(sd, buffers, then))

    def _run(self, sd: Any, buffers: Any, then: Optional[Callable[[], None]]) -> None:
        try:
            self._copy_then(sd, buffers, then)
        finally:
            self.finished.set()

    def _copy_then(self, sd: Any, buffers: Any, then: Optional[Callable[[], None]]) -> None:
        if self.error is not None:
            self.copied.set()
            return
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            if self.cuda:
                torch.cuda.set_device(self._device)
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    stream.wait_event(self._ready_event)
                    _copy_state_dict(sd, buffers, non_blocking=True, type_check=False)
                    self._done_event = torch.cuda.Event()
                    self._done_event.record(stream)
                self.copied.set()
                self._done_event.synchronize()  # the host buffers are complete from here on
            else:
                # One call for every tensor: the copy runs with the GIL released throughout, so
                # the training thread never waits on it (a tiny state: 0.8 ms instead of 3.4).
                pairs = _tensor_pairs(sd, buffers, [])
                if pairs:
                    torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        except BaseException as exc:  # noqa: BLE001 - reported with the save, never lost in a thread
            self.error = f"staging the state into host buffers failed: {type(exc).__name__}: {exc}"
        finally:
            self.copy_s = time.perf_counter() - t0
            self.copy_cpu_s = time.thread_time() - cpu0
            self.copied.set()
        if then is not None and self.error is None:
            cpu0 = time.thread_time()
            try:
                then()
            except BaseException as exc:  # noqa: BLE001
                self.error = f"handing the checkpoint to its writer failed: {type(exc).__name__}: {exc}"
            finally:
                self.handoff_cpu_s = time.thread_time() - cpu0

    def wait(self) -> float:
        """Block until the live state may change; returns the seconds waited."""
        t0 = time.perf_counter()
        self.copied.wait()
        if self.cuda and self._done_event is not None:
            torch.cuda.current_stream().wait_event(self._done_event)  # ordered on the device
        return time.perf_counter() - t0

    def wait_for_the_copy(self) -> float:
        """Block the host until the copy itself is over; returns the seconds waited. On a GPU
        :meth:`wait` returns once the copy is ordered before the training stream's next work; this
        waits for the side stream's device-to-host copy too, for measurements that count the copy
        as a stall the way torch DCP's staging does. On CPU it is :meth:`wait`."""
        t0 = time.perf_counter()
        self.copied.wait()
        if self.cuda and self._done_event is not None:
            self._done_event.synchronize()
        return time.perf_counter() - t0

    def join(self) -> None:
        self.finished.wait()

    def done(self) -> bool:
        return self.finished.is_set()


def replace_tensors(sd: Any, views: Iterator[torch.Tensor]) -> Any:
    """``sd``'s structure with its tensors replaced, in :func:`local_tensors`' order, by ``views``
    (a DTensor by a DTensor of the same layout around its view); ``None`` for every other value."""
    if isinstance(sd, DTensor):
        return DTensor(next(views), sd._spec, requires_grad=False)
    if isinstance(sd, torch.Tensor):
        return next(views)
    if isinstance(sd, dict):
        return {k: replace_tensors(v, views) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        if scalars_only(sd):
            return type(sd)(itertools.repeat(None, len(sd)))
        return type(sd)(replace_tensors(v, views) for v in sd)
    return None


def _tensor_pairs(live: Any, buf: Any, out: list) -> list:
    """(buffer, live) local tensors of ``live`` and its buffers, walked together (the buffers have
    ``live``'s structure)."""
    if isinstance(live, torch.Tensor):
        if isinstance(live, DTensor):
            out.append((buf._local_tensor, live._local_tensor))
        else:
            out.append((buf, live))
    elif isinstance(live, dict):
        for k, v in live.items():
            _tensor_pairs(v, buf[k], out)
    elif isinstance(live, (list, tuple)):
        for v, b in zip(live, buf):
            _tensor_pairs(v, b, out)
    return out


def _snapshot(live: Any, buf: Any) -> Any:
    """``live``'s structure with the staged tensors from ``buf`` and copies of everything else."""
    if isinstance(live, torch.Tensor):
        return buf
    if isinstance(live, dict):
        return {k: _snapshot(v, buf[k]) for k, v in live.items()}
    if isinstance(live, (list, tuple)):
        return type(live)(_snapshot(v, b) for v, b in zip(live, buf))
    if isinstance(live, _IMMUTABLE):  # most leaves (parameter names, hyper-parameters): no copy needed
        return live
    return copy.deepcopy(live)


_IMMUTABLE = (str, int, float, bool, bytes, type(None))
