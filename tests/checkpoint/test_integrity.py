"""Checksums computed while writing, the split of verification across ranks, and staging."""

from __future__ import annotations

import io
import os
import pickle
import random
import time

import numpy as np
import pytest
import torch

from resilient_fsdp.checkpoint import integrity
from resilient_fsdp.checkpoint.writer.report import SaveReport


def test_a_hashing_stream_checksums_exactly_what_reaches_the_file(tmp_path):
    recorder = integrity.Recorder()
    path = tmp_path / "f.bin"
    payload = os.urandom(3 * 1024 * 1024 + 17)
    with integrity.HashingStream(open(path, "wb"), path.name, recorder) as stream:
        stream.write(payload[:10])
        stream.write(memoryview(payload)[10:1000])  # writers hand over memoryviews too
        stream.write(io.BytesIO(payload[1000:]).getbuffer())
        torch.save({"t": torch.arange(1000)}, stream)  # torch.save into a stream, as DCP does
    entry = recorder.take()["f.bin"]
    assert entry == {"crc32c": integrity.file_crc32c(path), "bytes": path.stat().st_size}
    # And through the save's report, which a writer in another process records into.
    report = SaveReport.new("t0", 0)
    with pickle.loads(pickle.dumps(report)).open_hashed(tmp_path / "g.bin", "wb") as f:  # as the writer has it
        f.write(payload)
    sums, error = report.read()
    assert error is None and sums["g.bin"]["crc32c"] == integrity.file_crc32c(tmp_path / "g.bin")
    try:
        raise OSError("the disk is full")
    except OSError:
        report.record_error("the checkpoint writer failed")
    assert report.read()[1].startswith("OSError: the disk is full\nthe checkpoint writer failed: Traceback")
    report.discard()
    assert not os.path.exists(report.path)


def test_verification_is_split_across_ranks_and_names_a_same_size_corruption(tmp_path):
    files = {f"f{i}": {"bytes": b} for i, b in enumerate([50, 10, 40, 30, 20, 5, 5])}
    shares = [integrity.share(files, 3, r) for r in range(3)]
    assert sorted(n for s in shares for n in s) == sorted(files)  # every file once
    loads = [sum(files[n]["bytes"] for n in s) for s in shares]
    assert max(loads) - min(loads) <= 10
    assert shares == [integrity.share(files, 3, r) for r in range(3)]  # the same on every rank
    recorder = integrity.Recorder()
    for name in ("a", "b"):
        with integrity.HashingStream(open(tmp_path / name, "wb"), name, recorder) as s:
            s.write(os.urandom(1000))
    sums = recorder.take()
    assert integrity.verify(tmp_path, sums, ["a", "b"]) == []
    data = bytearray((tmp_path / "b").read_bytes())
    data[500] ^= 0x01
    (tmp_path / "b").write_bytes(bytes(data))
    (problem,) = integrity.verify(tmp_path, sums, ["a", "b"])
    assert problem.startswith("b: crc32c") and "same size" in problem


def test_staged_dtensors_wrap_the_host_buffers_themselves():
    """Item 2: staging must keep each DTensor a wrapper around its host buffer (DTensor.from_local
    moves a local tensor to the mesh's device, which on a GPU copied every shard back). On CPU the
    move cannot show; what is checked is that the staged DTensor's local tensor *is* the shared,
    reused staging buffer, so no device copy can exist. The GPU check asserts device memory."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from resilient_fsdp.checkpoint.staging import StateStager

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    live = {
        "w": distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]),
        "step": torch.tensor(3.0),
        "meta": {"lr": 0.1, "rng": (random.getstate(), np.random.get_state())},
    }
    stager = StateStager()
    first = stager.stage(live)
    buffer = stager.buffers["w"]
    assert isinstance(first["w"], DTensor) and first["w"].placements == live["w"].placements
    local = first["w"].to_local()
    assert local.untyped_storage().data_ptr() == buffer.to_local().untyped_storage().data_ptr()
    assert local.is_shared() and local.device.type == "cpu"
    assert torch.equal(local, live["w"].to_local())
    live["w"].to_local().add_(1.0)  # training goes on
    second = stager.stage(live)  # the same buffers, refilled
    assert second["w"].to_local().untyped_storage().data_ptr() == buffer.to_local().untyped_storage().data_ptr()
    assert torch.equal(second["w"].to_local(), live["w"].to_local())
    assert second["meta"]["rng"][0] == live["meta"]["rng"][0]
    live["w"] = distribute_tensor(torch.randn(10, 4), mesh, [Shard(0)])  # a shape change: new buffers
    third = stager.stage(live)
    assert third["w"].to_local().shape == (10, 4)
    stager.close()


def test_buffers_allocated_in_the_background_are_the_ones_the_first_save_fills():
    """A process's first save must not allocate (``Checkpointer.prepare`` starts the allocation
    after the first step): the save reuses the buffers allocated on the helper thread while the
    state changed, and stages the values of the save's own moment."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard

    from resilient_fsdp.checkpoint.staging import StateStager

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    live = {
        "w": distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)]),
        "b": torch.randn(32),
        "step": torch.tensor(1.0),
    }
    stager = StateStager()
    stager.allocate_in_background(live)
    live["w"].to_local().mul_(2.0)  # training goes on while the buffers are allocated
    live["b"].add_(1.0)
    stager.allocating.join()
    assert stager.generation == 1 and stager.buffers is not None, "nothing was allocated in the background"
    allocated = stager.buffers["w"].to_local().untyped_storage().data_ptr()
    staged = stager.stage(live)
    assert stager.generation == 1, "the save allocated its own buffers instead of using the background ones"
    assert staged["w"].to_local().untyped_storage().data_ptr() == allocated
    assert torch.equal(staged["w"].to_local(), live["w"].to_local()) and torch.equal(staged["b"], live["b"])
    stager.allocate_in_background(live)  # buffers exist: nothing to do
    assert stager.allocating is None and stager.generation == 1
    stager.close()


def test_a_staging_job_reports_its_threads_cpu_time_for_the_copy_and_the_hand_off_apart():
    """``bench checkpoint`` splits what training pays for on its core by these two figures."""
    from resilient_fsdp.checkpoint.staging import StateStager

    live = {"w": torch.randn(2048, 1024), "names": ["w"], "lr": 0.1}
    stager = StateStager()
    staged = stager.prepare(live)
    spent = []

    def hand_off():  # stands in for planning and the request to the writer: CPU-bound for a while
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.05:
            pass
        spent.append(time.thread_time() - t0)

    job = stager.start_copy(live, hand_off)
    job.wait()
    job.join()
    assert job.error is None and torch.equal(staged["w"], live["w"])
    assert staged["names"] == ["w"] and staged["names"] is not live["names"] and staged["lr"] == 0.1
    assert 0 < job.copy_cpu_s < 5
    assert job.handoff_cpu_s >= spent[0] >= 0.05  # the hand-off's own CPU, not the copy's
    stager.close()
