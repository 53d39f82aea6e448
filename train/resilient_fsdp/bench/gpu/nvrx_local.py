"""NVRx's node-local checkpoints (``checkpointing.local``: ``LocalCheckpointManager`` and
``BasicTensorAwareStateDict``, saved asynchronously through ``AsyncCallsQueue``), driven as NVRx's
documentation drives them, on this rank's shards of the same FSDP2 state the memory tier saves:
one side of the GPU check's comparison (:mod:`.local_checkpoints`). :class:`LocalManagerSaver`
implements the measuring loop's saver interface (:class:`~..checkpoint_engines.Saver`), so both
are timed by one loop. On CPU (the rehearsal) two stand-ins are used, named in the section's
results (:data:`CPU_STAND_INS`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
    BasicTensorAwareStateDict,
    dict_list_map_inplace,
    nested_values,
)
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

from ...checkpoint.staging import local_tensors
from ...checkpoint.writer.worker import cpu_shim
from ..checkpoint_engines import Saver

CPU_STAND_INS = (
    "BasicTensorAwareStateDict asserts CUDA tensors: on CPU the shards are wrapped in a subclass "
    "whose host copy is a clone and whose restore leaves them on the host",
    "NVRx's forked writer synchronises the device first: a no-op without one",
)


class HostStateDict(BasicTensorAwareStateDict):
    """The CPU rehearsal's stand-in for ``BasicTensorAwareStateDict`` (:data:`CPU_STAND_INS`); at module
    level, since ``torch.save`` pickles it by name and ``torch.load`` finds it again."""

    def __init__(self, state_dict: dict):
        assert all(not t.is_cuda for t in nested_values(state_dict) if isinstance(t, torch.Tensor))
        self.state_dict = state_dict
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        dict_list_map_inplace(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, self.state_dict)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        pass


class LocalManagerSaver(Saver):
    """``LocalCheckpointManager`` under ``root``, its saves asynchronous (a forked writer per save,
    NVRx's ``persistent=False`` caller), one rank's shards of ``trainer``'s state.

    What NVRx does, and so what is measured: the save call replicates (given a strategy), copies
    every tensor to the host without pinning and synchronises the device; a forked process
    ``torch.save``\\ s the copy; finalizing (an all-gather) renames it complete and removes older
    ones. The load reads the newest complete one and moves it back to the device.
    """

    def __init__(self, trainer: Any, root: Path):
        self.state = trainer.checkpointer.state
        self.cuda = torch.cuda.is_available() and any(t.is_cuda for t in self.shards().values())
        self.cls = BasicTensorAwareStateDict if self.cuda else HostStateDict
        self.manager = LocalCheckpointManager(root, session_id="bench")
        self.queue = AsyncCallsQueue(persistent=False)
        self.t0, self.call_s, self.step = 0.0, 0.0, None

    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's shards of the state, by position: what a save takes."""
        return {str(i): t for i, t in enumerate(local_tensors(self.state.state_dict(with_rng=False)))}

    def start(self, step: int) -> None:
        self.t0 = time.perf_counter()
        with cpu_shim():
            request = self.manager.save(self.cls(self.shards()), step, is_async=True)
            self.queue.schedule_async_request(request)
        self.call_s, self.step = time.perf_counter() - self.t0, step

    def before_optimizer_step(self) -> float:
        return 0.0  # the save call returned after the device-to-host copy

    def poll(self) -> Optional[dict]:
        with cpu_shim():
            self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
        if self.queue.get_num_unfinalized_calls():
            return None
        path = self.manager._local_ckpt_path_from_id(self.manager._ckpt_id(self.step))
        return {
            "write_s": time.perf_counter() - self.t0,
            "bytes": path.stat().st_size,
            "wait_s": 0.0,
            "call_s": self.call_s,
            "commit_s": 0.0,
        }

    def load(self, saved: dict[str, torch.Tensor]) -> tuple[float, bool]:
        """(seconds to find and load the newest checkpoint back onto the device, whether it equals
        ``saved``, the shards as they were saved, bitwise)."""
        t0 = time.perf_counter()
        self.manager.find_latest()
        loaded, _ = self.manager.load()
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        got = loaded.state_dict
        return seconds, got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)

    def close(self) -> None:
        with cpu_shim():
            self.queue.close()
