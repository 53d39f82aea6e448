"""A rank's memory slots (``checkpoint.memory.slots``) on a real tmpfs: alternation, records by
rename, checksums, a torn write, another structure, a new process finding what an earlier one
left (an in-job restart keeps the pod's ``/dev/shm``), and removal at the job's end."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from resilient_fsdp.checkpoint.memory.slots import (
    MemorySlots,
    SlotInvalid,
    job_root,
    owner_name,
    remove_job,
    slot_bytes,
    structure_digest,
)
from resilient_fsdp.checkpoint.memory.tier import MemoryTier
from resilient_fsdp.checkpoint.staging import structure
from tests.support import REPO

SHM = Path("/dev/shm")
RUN = "test-run"  # the run id (``run_identity``) the slots of these tests are kept under


@pytest.fixture
def root(shm_job):
    """A job's root on this machine's tmpfs, as in a pod's memory-backed /dev/shm."""
    return job_root(SHM, shm_job, RUN)


def state(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(33, 7, generator=g),
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.randint(0, 100, (3, 3), generator=g),
        torch.empty(0),
    ]


def save(slots: MemorySlots, tensors: list[torch.Tensor], step: int, digest: str = "d"):
    slot = slots.next_slot()
    spans, views = slots.open(slot, tensors)
    for view, t in zip(views, tensors):
        view.copy_(t)
    return slots.commit(
        slot,
        spans,
        step,
        digest,
        world_size=4,
        rank=1,
        job="j",
        attempt=0,
        meta={"mesh": [4]},
        extra=f"values of step {step}".encode(),
    )


def test_saves_alternate_and_the_newest_complete_snapshot_loads_bitwise(root):
    slots = MemorySlots(root, owner_name(1))
    assert slots.newest() is None and slots.next_slot() == "a"
    first = save(slots, state(1), step=2)
    second = save(slots, state(2), step=4)
    assert (first.slot, second.slot) == ("a", "b")
    assert [r.step for r in slots.records()] == [4, 2]
    third = save(slots, state(3), step=6)
    assert third.slot == "a" and [r.step for r in slots.records()] == [6, 4]
    live = [torch.zeros_like(t) for t in state(0)]
    slots.load_into(slots.newest(), live, digest="d")
    for got, want in zip(live, state(3)):
        assert torch.equal(got, want) and got.dtype == want.dtype
    assert slots.newest().meta == {"mesh": [4]} and slots.newest().world_size == 4


def test_a_save_cut_off_halfway_leaves_the_other_snapshot_whole(root):
    slots = MemorySlots(root, owner_name(0))
    save(slots, state(1), step=2)
    save(slots, state(2), step=4)
    # The next save goes into slot a (step 2's): its record goes first, then the copy is cut off.
    spans, views = slots.open(slots.next_slot(), state(3))
    views[0].copy_(state(3)[0])
    assert [r.step for r in slots.records()] == [4]
    again = MemorySlots(root, owner_name(0))  # a new process after the kill
    assert again.next_slot() == "a"
    live = [torch.zeros_like(t) for t in state(0)]
    again.load_into(again.newest(), live)
    assert all(torch.equal(a, b) for a, b in zip(live, state(2)))


def test_a_flipped_byte_or_another_structure_is_refused_and_nothing_is_copied(root):
    slots = MemorySlots(root, owner_name(2))
    record = save(slots, state(1), step=8)
    live = [torch.full_like(t, 7) for t in state(0)]
    with pytest.raises(SlotInvalid, match="another structure"):
        slots.load_into(record, live, digest="other")
    path = root / owner_name(2) / "slot-a.bin"
    data = bytearray(path.read_bytes())
    data[record.spans[1][0]] ^= 0x01
    path.write_bytes(bytes(data))
    fresh = MemorySlots(root, owner_name(2))
    with pytest.raises(SlotInvalid, match="tensor 1 fails its CRC32C") as caught:
        fresh.load_into(fresh.newest(), live)
    assert caught.value.where == path
    assert all(bool((t == 7).all()) for t in live)  # checked before any copy


def test_the_non_tensor_values_beside_the_tensors_are_checked_too(root):
    slots = MemorySlots(root, owner_name(0))
    record = save(slots, state(1), step=6)
    assert slots.extra(record) == b"values of step 6"
    (root / owner_name(0) / "slot-a.extra").write_bytes(b"values of step 7")
    with pytest.raises(SlotInvalid, match="non-tensor values fail their CRC32C"):
        MemorySlots(root, owner_name(0)).extra(record)


def test_a_newest_snapshot_failing_its_checksum_is_set_aside_when_reported_and_its_slot_written_next(root):
    """What a start's report does with a flipped byte in the newest own snapshot: not reported
    (the decision then takes its replica or an older step), set aside as ``.invalid`` beside the
    bytes, said once, and the slot is where the next save goes, which removes the set-aside record."""
    said: list[str] = []
    tier = MemoryTier(2, root.parents[2], root.parent.name, RUN, rank=1, world_size=4, say=said.append)
    save(tier.slots, state(1), 2)
    newest = save(tier.slots, state(2), 4)
    assert tier.report().own == (2, 4) and not said
    path, offset = tier.slots.byte_of(newest)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    assert tier.report().own == (2,)
    (message,) = said
    assert (
        f"slot-{newest.slot}.bin: tensor 0 fails its CRC32C (step 4)" in message
        and f"set aside as slot-{newest.slot}.invalid" in message
    )
    assert (tier.slots.dir / f"slot-{newest.slot}.invalid").exists()
    assert tier.slots.next_slot() == newest.slot
    save(tier.slots, state(3), 6)
    assert not (tier.slots.dir / f"slot-{newest.slot}.invalid").exists()
    assert tier.report().own == (2, 6) and len(said) == 1


def test_a_record_whose_bytes_are_short_or_unreadable_is_no_snapshot(root):
    slots = MemorySlots(root, owner_name(3))
    save(slots, state(1), step=2)
    save(slots, state(2), step=4)
    (root / owner_name(3) / "slot-b.bin").write_bytes(b"short")
    (root / owner_name(3) / "slot-a.json").write_text("{not json")
    assert MemorySlots(root, owner_name(3)).records() == []


def test_a_new_layout_resizes_the_slot_and_the_digest_follows_the_structure(root):
    slots = MemorySlots(root, owner_name(0))
    small = [torch.ones(4)]
    save(slots, small, step=1)
    big = [torch.ones(1000), torch.ones(10, dtype=torch.float64)]
    record = save(slots, big, step=2)
    assert record.nbytes == slot_bytes(big) and (root / owner_name(0) / "slot-b.bin").stat().st_size == slot_bytes(big)
    assert structure_digest(structure({"w": torch.ones(3)})) == structure_digest(structure({"w": torch.zeros(3)}))
    assert structure_digest(structure({"w": torch.ones(3)})) != structure_digest(structure({"w": torch.ones(4)}))


def test_snapshots_past_a_restored_step_are_discarded(root):
    slots = MemorySlots(root, owner_name(0))
    save(slots, state(1), step=10)
    save(slots, state(2), step=12)
    assert slots.discard_newer_than(10) == [12]
    assert [r.step for r in slots.records()] == [10] and slots.next_slot() == "b"


def test_another_process_finds_and_loads_what_an_earlier_one_saved_and_the_job_end_removes_it(root):
    """An in-job restart: the process that saved is gone, the pod's memory is not."""
    slots = MemorySlots(root, owner_name(1))
    save(slots, state(5), step=20)
    code = textwrap.dedent(f"""
        import json, sys, torch
        from pathlib import Path
        from resilient_fsdp.checkpoint.memory.slots import MemorySlots
        slots = MemorySlots(Path({str(root)!r}), "rank-1")
        record = slots.newest()
        live = [torch.zeros(33, 7), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(3, 3, dtype=torch.int64),
                torch.empty(0)]
        slots.load_into(record, live)
        print(json.dumps({{"step": record.step, "sums": [float(t.double().sum()) for t in live]}}))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO / "train"), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"step": 20, "sums": [float(t.double().sum()) for t in state(5)]}
    remove_job(SHM, root.parent.name)
    assert not root.exists()


def test_a_full_dev_shm_is_a_clear_error_not_a_killed_process(tmp_path):
    """A tmpfs of 1 MiB (as a small shm.sizeLimit) and a 2 MiB slot: the space is reserved before
    the file is mapped, so the save fails with ENOSPC naming the fix instead of a SIGBUS."""
    mount = tmp_path / "shm"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.fail(f"mounting a tmpfs needs root: {made.stderr.strip()}")
    try:
        slots = MemorySlots(mount, owner_name(0))
        with pytest.raises(OSError, match="raise shm.sizeLimit") as caught:
            slots.open("a", [torch.zeros(512 * 1024)])  # 2 MiB of float32
        assert caught.value.errno == 28 and not (mount / owner_name(0) / "slot-a.bin").exists()
        slots.open("a", [torch.zeros(1024)])  # a slot that fits still works
        slots.remove()  # unmaps it, so the tmpfs can go
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_dev_shm_too_small_for_the_pods_slots_turns_the_tier_off_once_and_takes_no_room(tmp_path):
    """A 1 MiB tmpfs: two ranks a pod with 200 KiB states need 800 KiB of slots, which fits, also
    for a restarted process whose run's slots fill most of it; not beside another run's 600 KiB
    (free space, named); three ranks need 1.2 MiB, so the first save says so (naming
    shm.sizeLimit and how much) and nothing is reserved, leaving the room to the durable checkpoint."""
    from resilient_fsdp.checkpoint.memory.tier import MemoryTier, shm_needed

    assert shm_needed(100, ranks_per_pod=8, replicas=1, durable_copies=1) == 8 * 100 * 5
    assert shm_needed(100, ranks_per_pod=8, replicas=0, durable_copies=0) == 8 * 100 * 2
    mount = tmp_path / "shm"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.fail(f"mounting a tmpfs needs root: {made.stderr.strip()}")
    sd = {"w": torch.zeros(50 * 1024)}  # 200 KiB of float32
    try:
        fits = MemoryTier(1, mount, "fits", RUN, 0, 2, ranks_per_pod=2, durable_copies=1)
        fits.save(1, sd)
        fits.settle()
        (done,) = fits.poll()
        assert done["error"] is None and fits.off is None  # another tmpfs than /dev/shm: no staging beside it
        # Both ranks of the pod fill their two slots, and rank 0's process is restarted: the free
        # space is down to 0.2 MiB, yet what this run's slots hold is reused, so the tier stays on.
        other_rank = MemoryTier(1, mount, "fits", RUN, 1, 2, ranks_per_pod=2, durable_copies=1)
        for tier in (fits, other_rank):
            for step in (2, 3):
                tier.save(step, sd)
                tier.settle()
            tier.close(remove=False)
        restarted = MemoryTier(1, mount, "fits", RUN, 0, 2, ranks_per_pod=2, durable_copies=1)
        restarted.save(4, sd)
        restarted.settle()
        assert [r["error"] for r in restarted.poll()] == [None] and restarted.off is None
        restarted.close(remove=True)
        other_rank.close(remove=True)
        assert not (mount / "resilient-fsdp").exists()
        # A killed run of another job left 600 KiB: the free space cannot hold the slots, and the
        # message names what holds it; nothing of that run is removed.
        stale = mount / "resilient-fsdp" / "other-job" / "killed-run" / "rank-0"
        stale.mkdir(parents=True)
        (stale / "slot-a.bin").write_bytes(b"\1" * 600 * 1024)
        crowded = MemoryTier(1, mount, "fits", RUN, 0, 2, ranks_per_pod=2, durable_copies=1)
        crowded.save(1, sd)
        (said,) = crowded.poll()
        assert (
            "the memory tier is off for this job" in said["error"] and "need 0.78 MiB for their slots" in said["error"]
        )
        assert f"{stale.parent} holds 0.59 MiB" in said["error"] and "Durable checkpoints go on" in said["error"], said
        assert (stale / "slot-a.bin").stat().st_size == 600 * 1024 and not any(mount.rglob("slot-b*"))
        crowded.close(remove=True)
        shutil.rmtree(mount / "resilient-fsdp")
        short = MemoryTier(1, mount, "short", RUN, 0, 3, ranks_per_pod=3, durable_copies=1)
        short.save(1, sd)
        (said,) = short.poll()
        assert "the memory tier is off for this job" in said["error"] and "3 rank(s) need 1.17 MiB" in said["error"]
        assert "raise shm.sizeLimit to at least 2Mi" in said["error"] and "Durable checkpoints go on" in said["error"]
        assert not any(mount.rglob("slot-*")), list(mount.rglob("*"))
        short.save(2, sd)  # off for the job: no second message, nothing written
        assert short.poll() == [] and not any(mount.rglob("slot-*"))
        short.close(remove=True)
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


class _Registrations:
    """Stands in for CUDA's host registration (``torch.cuda._pin_memory_utils``), which needs a GPU
    this machine does not have: records what is registered and unregistered, by address."""

    def __init__(self, fail: bool = False):
        self.fail, self.registered, self.unregistered = fail, {}, []

    def pin_memory(self, ptr: int, size: int) -> None:
        if self.fail:
            raise RuntimeError("Registering memory failed with cudaError: 1.")
        self.registered[ptr] = size

    def unpin_memory(self, ptr: int) -> None:
        assert ptr in self.registered, "unregistering what was never registered"
        self.unregistered.append(ptr)


def test_on_cuda_each_mapped_slot_is_page_locked_once_and_unregistered_before_it_goes(root, monkeypatch):
    import torch.cuda

    cuda = _Registrations()
    monkeypatch.setattr(torch.cuda, "_pin_memory_utils", cuda, raising=False)
    slots = MemorySlots(root, owner_name(0), pin=True)
    assert slots.pinned is None  # nothing mapped yet
    for step in (2, 4, 6, 8):  # both slots, each mapped once and kept across saves
        save(slots, state(step), step=step)
    assert sorted(cuda.registered.values()) == [slot_bytes(state(1))] * 2 and slots.pinned is True
    a, b = slots._mapped["a"][1].data_ptr(), slots._mapped["b"][1].data_ptr()
    assert set(cuda.registered) == {a, b} and cuda.unregistered == []
    save(slots, [torch.ones(1000)], step=10)  # a new layout: that slot's mapping goes, its pages unlocked
    assert cuda.unregistered == [a] and slots.pinned is True and len(cuda.registered) == 3
    live = [torch.zeros(1000)]
    slots.load_into(slots.newest(), live)
    assert torch.equal(live[0], torch.ones(1000))
    slots.remove()  # the job's end: every registration undone
    assert len(cuda.unregistered) == 3 and set(cuda.unregistered) == set(cuda.registered) and slots.pinned is None


def test_a_slot_cuda_cannot_register_stays_pageable_and_the_save_says_why(root, monkeypatch):
    import torch.cuda

    monkeypatch.setattr(torch.cuda, "_pin_memory_utils", _Registrations(fail=True), raising=False)
    slots = MemorySlots(root, owner_name(0), pin=True)
    record = save(slots, state(1), step=2)
    assert record.step == 2 and slots.pinned is False
    assert "stay pageable: cudaHostRegister failed" in slots.pin_error and "slot-a.bin" in slots.pin_error
    plain = MemorySlots(root, owner_name(1))  # CPU: not asked to pin
    save(plain, state(1), step=2)
    assert plain.pinned is None and plain.pin_error is None
