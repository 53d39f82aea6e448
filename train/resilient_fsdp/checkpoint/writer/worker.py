"""What runs inside the checkpoint writer process (NVRx's spawned worker): the functions the
engines hand it, wrapped so that a failure is recorded in the save's report instead of killing
the writer, files are hashed while written, a CPU-only build does not trip over NVRx's CUDA calls,
and an injected writer fault (``writer-*`` kinds, :mod:`resilient_fsdp.resilience.faults`) is
carried out.

Everything here is module-level so it pickles by reference; the writer imports this module,
which has no side effects at import time. The rank's side of the writer is :mod:`.process`.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional

import torch

from ... import atomic
from .. import open_files
from . import fork_server, handoff
from .report import SaveReport

# Worker threads: the writer serialises and checksums; it needs no intra-op thread pool competing
# with training for the cores.
WORKER_TORCH_THREADS = 1


def cuda_present() -> bool:
    return torch.cuda.is_available()


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


# How often the writer checks that its trainer is still alive, where it cannot be told (no pidfd).
PARENT_CHECK_S = 1.0
# Nobody waits for this code (the trainer is gone); it tells a subreaper's log why the writer ended.
ORPHANED_EXIT_CODE = 75


def writer_started(trainer_pid: int, rank: int, given: Optional[fork_server.Inheritance] = None) -> None:
    """The writer's first call, before anything in it touches CUDA: take what a spawned writer
    would have inherited from its trainer (``given``: the writer was forked by the pod's fork
    server, :mod:`.fork_server`), hide the GPUs, raise the open-files limit
    (:mod:`..open_files`; inherited from the trainer, so this says something
    only when the trainer did not raise it) and exit once the trainer is gone."""
    if given is not None:
        fork_server.take(given)
    hide_gpus()
    limit, first = open_files.raise_soft_limit()
    if first and limit.soft != limit.before:
        print(f"[resilient-fsdp] checkpoint writer of rank {rank}: {limit.describe()}", file=sys.stderr, flush=True)
    exit_when_orphaned(trainer_pid)


# The writer reads host memory and writes files; a CUDA context would cost it about 0.5 GB of the
# GPU's memory for nothing. The CUDA runtime reads this when it initialises, which torch does at
# its first CUDA call: set before any, it hides the GPUs as if set before torch was imported.
HIDDEN_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


def hide_gpus() -> None:
    """No GPU is visible to this process from now on (it must not have initialised CUDA yet)."""
    if torch.cuda.is_initialized():
        print(
            "[resilient-fsdp] warning: the checkpoint writer initialised CUDA before hiding the GPUs; "
            "its CUDA context stays",
            file=sys.stderr,
            flush=True,
        )
    os.environ.update(HIDDEN_GPUS)


def exit_when_orphaned(trainer_pid: int) -> None:
    """From now on this process (the writer) exits as soon as ``trainer_pid`` is gone.

    The writer blocks SIGTERM so that it can finish a graceful stop's final checkpoint, and waits
    on its request queue forever; a trainer killed outright (SIGKILL, OOM) would leave it behind
    outside a pod, holding its staging memory. Nothing it still writes could be committed, since
    only the trainers commit: it exits at once, leaving an incomplete checkpoint that is never
    loaded. The trainer is watched through a pidfd, which becomes readable when it ends: the
    trainer is the writer's parent when spawned, not when forked by the pod's fork server, and
    ``PR_SET_PDEATHSIG`` would follow the thread that started the writer, a helper thread that
    ends long before the trainer does. Where pidfds are refused (a kernel before 5.3, a seccomp
    profile), the trainer's pid is polled.
    """
    try:
        pidfd: Optional[int] = os.pidfd_open(trainer_pid)
    except ProcessLookupError:
        os._exit(ORPHANED_EXIT_CODE)
    except (OSError, AttributeError):
        pidfd = None

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])
        else:
            while _exists(trainer_pid):
                time.sleep(PARENT_CHECK_S)
        os._exit(ORPHANED_EXIT_CODE)

    threading.Thread(target=watch, name="checkpoint-writer-orphan-watch", daemon=True).start()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Within the block, ``torch.cuda.synchronize`` is a no-op when no GPU exists (else untouched).

    Synchronising is meaningless without a device: every CPU copy has completed when it returns.
    Installed here, inside NVRx's spawned worker, by the wrappers of the functions NVRx sends it:
    a patch made in the trainer would not reach a fresh interpreter.
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


@contextlib.contextmanager
def _hashing_open_in_module(report: SaveReport) -> Iterator[None]:
    """NVRx 0.4.1 opens each file with the name ``open`` of its module: make it the hashing one."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

    filesystem_async.open = report.open_hashed
    try:
        yield
    finally:
        del filesystem_async.open


def worker_write(
    report: SaveReport, fault: Optional[str], save_fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> None:
    """Runs NVRx's write function in the worker; a failure is recorded in ``report``.

    NVRx's persistent worker dies on an exception and never reports completion, which would leave
    the trainer waiting forever. Recording the error and returning normally lets the trainer see
    the call complete and report the error on every rank.
    """
    try:
        if report.has_error():
            return  # staging failed: nothing to write
        _writer_fault(fault, "before")
        with cpu_shim(), _hashing_open_in_module(report):
            save_fn(*args, **kwargs)
        _writer_fault(fault, "after")
    except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it on every rank
        report.record_error("the checkpoint writer failed")


def _worker_setup() -> None:
    if torch.get_num_threads() != WORKER_TORCH_THREADS:
        torch.set_num_threads(WORKER_TORCH_THREADS)


def take_request(report: SaveReport, buffers: Optional[bytes], request: bytes) -> None:
    """What the writer runs for every save: keep the arena if it was sent (the first save of a
    generation, or a new worker), rebuild the request's function and arguments
    (:func:`.handoff.encode_request`) and run it. What fails is recorded in ``report`` (receiving
    the arena's descriptor can fail, e.g. at the ``nofile`` limit); the writer goes on."""
    try:
        _worker_setup()
        if buffers is not None:
            handoff.register(handoff.decode(buffers))
        fn, args = handoff.decode(request)
    except BaseException:  # noqa: BLE001
        report.record_error("the checkpoint writer could not take the request")
        return
    fn(*args)


_NOT_TAKEN = object()


def _take_staged(report: SaveReport, key: str, packed: Any) -> Any:
    """What ``packed`` references in the arena registered as ``key``; on failure record the error
    for the trainer and return ``_NOT_TAKEN``."""
    try:
        return handoff.unpack(packed, key)
    except BaseException:  # noqa: BLE001
        report.record_error("the checkpoint writer could not take the staged state")
        return _NOT_TAKEN


def worker_write_staged(
    report: SaveReport,
    fault: Optional[str],
    key: str,
    save_fn: Callable[..., Any],
    rank: int,
    packed_buckets: Any,
    results: Any,
) -> None:
    """A DCP write of staged buffers: the write buckets rebuilt from their references, then
    :func:`worker_write`."""
    buckets = _take_staged(report, key, packed_buckets)
    if buckets is not _NOT_TAKEN:
        worker_write(report, fault, save_fn, rank, buckets, results)


def worker_torch_save_staged(report: SaveReport, fault: Optional[str], key: str, packed_state: Any, path: str) -> None:
    """``torch-async``: :func:`worker_torch_save` of the staged state, from its references."""
    state = _take_staged(report, key, packed_state)
    if state is not _NOT_TAKEN:
        worker_torch_save(report, fault, state, path)


def worker_torch_save(report: SaveReport, fault: Optional[str], state: Any, path: str) -> None:
    """``torch.save`` of one rank's staged state into ``path`` in the worker, hashed while written
    and fsynced before the call reports completion (``torch-async``)."""
    try:
        _writer_fault(fault, "before")
        with report.open_hashed(path, "wb") as f:
            torch.save(state, f)
            atomic.fsync_stream(f)
        _writer_fault(fault, "after")
    except BaseException:  # noqa: BLE001
        report.record_error("the checkpoint writer failed")


def _writer_fault(fault: Optional[str], when: str) -> None:
    """An injected writer fault (``writer-exit``, ``-raise``, ``-hang``, ``-slow``): ``exit`` kills
    the writer after the data is written (as a worker killed mid-save); ``raise`` fails the write
    before it starts; ``hang`` never finishes; ``slow=SECONDS`` finishes that much later."""
    if fault and fault.startswith("slow=") and when == "after":
        time.sleep(float(fault.split("=", 1)[1]))
    if fault == "exit" and when == "after":
        os._exit(137)
    if fault == "raise" and when == "before":
        raise OSError("injected writer failure")
    if fault == "hang" and when == "before":
        while True:
            time.sleep(1)
