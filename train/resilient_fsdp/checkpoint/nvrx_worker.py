"""What runs inside NVRx's spawned checkpoint worker: the functions the engines hand it, wrapped
so that a failure is recorded instead of killing the worker, files are hashed while written, and
a CPU-only build does not trip over NVRx's CUDA calls.

Everything here is module-level so it pickles by reference; the worker imports this module,
which has no side effects at import time. The trainer's side is :mod:`.nvrx`.
"""

from __future__ import annotations

import contextlib
import os
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from .. import atomic
from . import integrity


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


_TAG = "resilient-fsdp/save"


class TaggedResults:
    """Stands in for NVRx's results queue in one save's write arguments: what the writer puts is
    tagged with the save's token, so that the trainer can tell it from a stale item."""

    def __init__(self, proxy: Any, token: str):
        self.proxy, self.token = proxy, token

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        self.proxy.put((_TAG, self.token, item), *args, **kwargs)


@contextlib.contextmanager
def _hashing_open_in_module(channel: str) -> Iterator[None]:
    """NVRx 0.4.1 opens each file with the name ``open`` of its module: make it the hashing one."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

    filesystem_async.open = partial(integrity.hashing_open, channel)
    try:
        yield
    finally:
        del filesystem_async.open


def worker_preload(channel: str, preload_fn: Callable[[], Any]) -> Any:
    """Runs NVRx's staging function in the worker, under :func:`cpu_shim`. An exception would
    kill the worker while the trainer waits for the staging hand-shake: it is recorded instead."""
    try:
        with cpu_shim():
            return preload_fn()
    except BaseException:  # noqa: BLE001 - reported to the trainer at its next collect
        integrity.record_error(channel, "staging in the checkpoint writer failed")
        return None


def worker_write(channel: str, fault: Optional[str], save_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Runs NVRx's write function in the worker; a failure is recorded in ``channel``.

    NVRx's persistent worker dies on an exception and never reports completion, which would leave
    the trainer waiting forever. Recording the error and returning normally lets the trainer see
    the call complete and report the error on every rank.
    """
    try:
        if (Path(channel) / integrity.ERROR_FILE).exists():
            return  # staging failed: nothing to write
        _writer_fault(fault, "before")
        with cpu_shim(), _hashing_open_in_module(channel):
            save_fn(*args, **kwargs)
        _writer_fault(fault, "after")
    except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it on every rank
        integrity.record_error(channel, "the checkpoint writer failed")


def worker_torch_save(channel: str, fault: Optional[str], state: Any, path: str) -> None:
    """``torch.save`` of one rank's staged state into ``path`` in the worker, hashed while written
    and fsynced before the call reports completion (``torch-async``)."""
    try:
        _writer_fault(fault, "before")
        with integrity.hashing_open(channel, path, "wb") as f:
            torch.save(state, f)
            atomic.fsync_stream(f)
        _writer_fault(fault, "after")
    except BaseException:  # noqa: BLE001
        integrity.record_error(channel, "the checkpoint writer failed")


def _writer_fault(fault: Optional[str], when: str) -> None:
    """Fault injection (tests, drills): ``exit`` kills the writer after the data is written (as a
    worker killed mid-save); ``raise`` fails the write before it starts; ``hang`` never finishes."""
    if fault == "exit" and when == "after":
        os._exit(137)
    if fault == "raise" and when == "before":
        raise OSError("injected writer failure")
    if fault == "hang" and when == "before":
        while True:
            time.sleep(1)
