"""A new process's read-ahead of its newest memory snapshot (``checkpoint.memory.prefetch``), on a
real tmpfs with a real optimizer: the moments are checked and copied into memory of their own,
which the restore adopts as the optimizer's state, bit for bit; a corrupt moment found by the
read-ahead sets the snapshot aside as the report's own check does; a read-ahead of another
snapshot, or one that failed, is not used, and what it read is freed, before a restore of
another step allocates its own."""

from __future__ import annotations

import gc
import pickle
import weakref
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from resilient_fsdp.checkpoint.memory import prefetch
from resilient_fsdp.checkpoint.memory.prefetch import Prefetch
from resilient_fsdp.checkpoint.run_identity import read_run_identity, run_identity
from resilient_fsdp.checkpoint.memory.slots import MemorySlots, SlotInvalid, job_root, owner_name
from resilient_fsdp.checkpoint.memory.tier import MemoryTier, allocate_optimizer_state
from resilient_fsdp.checkpoint.memory.values import tensor_paths, without_tensors
from resilient_fsdp.checkpoint.staging import local_tensors
from resilient_fsdp.config import load_config
from tests.checkpoint.memory_support import trained

SHM = Path("/dev/shm")
RUN = "test-run"  # the run id (``run_identity``) the slots of these tests are kept under


def snapshot(slots: MemorySlots, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int):
    """What the memory tier's save writes: every tensor in the slot, the rest beside it."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    saved = {"model": model_sd, "optim": optim_sd}
    tensors = local_tensors(saved)
    slot = slots.next_slot()
    spans, views = slots.open(slot, tensors)
    for view, t in zip(views, tensors):
        view.copy_(t)
    extra = pickle.dumps(without_tensors(saved), protocol=pickle.HIGHEST_PROTOCOL)
    return slots.commit(slot, spans, step, "d", world_size=1, rank=0, job="j", attempt=0, extra=extra), tensors


def test_the_read_ahead_copies_the_moments_and_the_restore_adopts_them_bitwise(shm_job):
    model, optimizer = trained()
    slots = MemorySlots(job_root(SHM, shm_job, RUN), owner_name(0))
    record, saved = snapshot(slots, model, optimizer, step=4)

    read_ahead = Prefetch(MemorySlots(job_root(SHM, shm_job, RUN), owner_name(0)), 1, torch.device("cpu"))
    ahead = read_ahead.take(record)
    assert ahead is not None and ahead.record == record and ahead.seconds > 0
    values = pickle.loads(slots.extra(record))
    moments = {i for i, path in enumerate(tensor_paths(values)) if path[-1] in ("exp_avg", "exp_avg_sq")}
    assert ahead.moved == moments and len(moments) == 8  # two moments of four parameters; not the steps
    mapped = read_ahead.slots.raw(record)  # the read-ahead's own mapping of the slot
    start, end = mapped.data_ptr(), mapped.data_ptr() + mapped.numel()
    for i, (view, original) in enumerate(zip(ahead.views, saved)):
        assert torch.equal(view, original), i
        inside = start <= view.data_ptr() < end
        assert inside == (i not in moments), i  # a moment is a copy; the rest are views of the slot
        if i in moments:
            assert view.untyped_storage().nbytes() == view.numel() * view.element_size()  # memory of its own

    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    assert allocate_optimizer_state(model, fresh, ahead.values, ahead.views, adopt=ahead.moved)
    adopted = {t.data_ptr() for state in fresh.state.values() for k, t in state.items() if k != "step"}
    assert adopted == {ahead.views[i].data_ptr() for i in moments}
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(fresh.state[p][key], optimizer.state[p][key]), key


def test_a_corrupt_moment_found_by_the_read_ahead_sets_the_snapshot_aside(shm_job):
    model, optimizer = trained()
    slots = MemorySlots(job_root(SHM, shm_job, RUN), owner_name(0))
    older, _ = snapshot(slots, model, optimizer, step=2)
    newest, _ = snapshot(slots, model, optimizer, step=4)
    moment = sorted(
        Prefetch(MemorySlots(job_root(SHM, shm_job, RUN), owner_name(0)), 1, torch.device("cpu")).take(newest).moved
    )[0]
    offset = newest.spans[moment][0]
    data = slots.dir / f"slot-{newest.slot}.bin"
    with open(data, "r+b") as f:
        f.seek(offset + 3)
        byte = f.read(1)
        f.seek(offset + 3)
        f.write(bytes([byte[0] ^ 0x40]))

    with pytest.raises(SlotInvalid, match=f"tensor {moment} fails its CRC32C \\(step 4\\)"):
        Prefetch(MemorySlots(job_root(SHM, shm_job, RUN), owner_name(0)), 1, torch.device("cpu")).take(newest)

    said: list[str] = []
    tier = MemoryTier(
        2,
        SHM,
        shm_job,
        RUN,
        0,
        1,
        say=said.append,
        prefetch=Prefetch(MemorySlots(job_root(SHM, shm_job, RUN), owner_name(0)), 1, torch.device("cpu")),
    )
    report = tier.report()
    assert report.own == (older.step,)
    assert (slots.dir / f"slot-{newest.slot}.invalid").exists()
    assert any(f"tensor {moment} fails its CRC32C (step 4); set aside" in m for m in said), said


def test_a_read_ahead_of_an_older_snapshot_is_not_used_and_release_frees_it(shm_job):
    model, optimizer = trained()
    slots = MemorySlots(job_root(SHM, shm_job, RUN), owner_name(0))
    snapshot(slots, model, optimizer, step=2)
    early = Prefetch(MemorySlots(job_root(SHM, shm_job, RUN), owner_name(0)), 1, torch.device("cpu"))
    early._thread.join()
    copy = weakref.ref(early._ahead.views[sorted(early._ahead.moved)[0]])
    newest, _ = snapshot(slots, model, optimizer, step=4)  # after the read-ahead (not so in a start; guarded)

    tier = MemoryTier(2, SHM, shm_job, RUN, 0, 1, prefetch=early)
    assert tier.report().own == (2, 4) and tier.read_ahead_s is None
    gc.collect()
    assert copy() is None  # the read-ahead of step 2 is gone once the report took another
    assert tier._checked[0] == newest

    kept = Prefetch(MemorySlots(job_root(SHM, shm_job, RUN), owner_name(0)), 1, torch.device("cpu"))
    kept._thread.join()
    copy = weakref.ref(kept._ahead.views[sorted(kept._ahead.moved)[0]])
    tier = MemoryTier(2, SHM, shm_job, RUN, 0, 1, prefetch=kept)
    tier.release()  # the start goes to the durable checkpoint without reporting (resume_from)
    gc.collect()
    assert copy() is None and tier.prefetch is None


def test_a_failed_read_ahead_leaves_the_restore_to_read_the_slot(shm_job):
    model, optimizer = trained()
    slots = MemorySlots(job_root(SHM, shm_job, RUN), owner_name(0))
    newest, saved = snapshot(slots, model, optimizer, step=4)
    # A device this machine lacks stands for a GPU without the memory for the copies.
    failing = Prefetch(MemorySlots(job_root(SHM, shm_job, RUN), owner_name(0)), 1, torch.device("cuda", 7))
    said: list[str] = []
    tier = MemoryTier(2, SHM, shm_job, RUN, 0, 1, say=said.append, prefetch=failing)
    assert tier.report().own == (4,)
    assert failing.error and any("the read-ahead of its memory checkpoint failed" in m for m in said), said
    assert tier._ahead is None and tier._checked[0] == newest
    assert all(torch.equal(v, t) for v, t in zip(tier._checked[1], saved))


def test_a_read_ahead_starts_only_where_a_start_may_restore_from_memory(shm_job, tmp_path):
    """Only with the memory tier and ``resume`` on, and only for a checkpoint directory started
    before (one with no run id has nothing of its run in memory); it reads the slots of that run."""

    def cfg(*overrides):
        sets = [f"checkpoint.memory.dir={SHM}", f"checkpoint.job_id={shm_job}", *overrides]
        return load_config(None, sets).checkpoint

    checkpoints = tmp_path / "checkpoints"
    on = cfg("checkpoint.memory.interval_steps=2")
    assert prefetch.start(on, checkpoints, 0, 1, torch.device("cpu")) is None  # never started: no run id
    run = run_identity(checkpoints)
    assert run_identity(checkpoints) == read_run_identity(checkpoints) == run
    assert prefetch.start(cfg("checkpoint.memory.interval_steps=0"), checkpoints, 0, 1, torch.device("cpu")) is None
    assert (
        prefetch.start(
            cfg("checkpoint.memory.interval_steps=2", "checkpoint.resume=false"), checkpoints, 0, 1, torch.device("cpu")
        )
        is None
    )
    started = prefetch.start(on, checkpoints, 0, 1, torch.device("cpu"))
    assert isinstance(started, Prefetch) and started.slots.dir == job_root(SHM, shm_job, run) / owner_name(0)
    started.drop()
    assert started.error is None


def test_a_restore_of_another_step_frees_the_read_ahead_before_it_allocates(shm_job):
    """The decision may take an older step than the one read ahead (a peer lacks the newest):
    the read-ahead's copies of the newest are freed before that restore allocates moments of
    its own, so the two never take memory at once."""
    model, optimizer = trained()
    slots = MemorySlots(job_root(SHM, shm_job, RUN), owner_name(0))
    snapshot(slots, model, optimizer, step=2)
    snapshot(slots, model, optimizer, step=4)
    read_ahead = Prefetch(MemorySlots(job_root(SHM, shm_job, RUN), owner_name(0)), 1, torch.device("cpu"))
    tier = MemoryTier(2, SHM, shm_job, RUN, 0, 1, prefetch=read_ahead)
    assert tier.report().own == (2, 4) and tier._ahead is not None
    copy = weakref.ref(tier._ahead.views[sorted(tier._ahead.moved)[0]])
    alive_after_allocation = []

    class State:  # a CheckpointState's surface; the restore calls state_dict() right after allocating
        def __init__(self):
            self.model, self.optimizer = model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

        def state_dict(self):
            gc.collect()
            alive_after_allocation.append(copy() is not None)
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            return {"model": model_sd, "optim": optim_sd}

        def load_state_dict(self, sd):
            raise AssertionError("a state of another structure must not be loaded")

    assert tier.restore(State(), 2) is not None  # the fake state's structure differs: not loaded
    assert alive_after_allocation == [False]
