"""Checkpoints under a low open-files limit (the soft ``nofile`` of 1024 many container runtimes
set): a state of over 3,000 tensors (AdamW's state included) stages into one shared-memory arena
per rank, so a rank and its writer hold a few descriptors for it, not one per tensor; the soft
limit is raised to the hard one at start and said once; a request the writer cannot take fails its
save at once, with the reason; the writer never opens a CUDA context. Real processes (gloo on CPU)
on both NVRx lanes."""

from __future__ import annotations

import pytest

from tests.checkpoint.probes import HERE as PROBES_DIR, run_probe
from tests.support import LANES, assert_no_leftovers, lane_path, read_losses, read_summary, run_local

# Soft and hard limit alike: raising the soft limit cannot help, the staging itself must fit.
LOW = (1024, 1024)
# What one saved item of a small tensor adds to a DCP file besides its bytes (torch.save's
# framing: about 1.6 KB) and to the metadata. A view of the arena written as it is would carry
# the whole arena (all tensors) with every item: thousands of times the state.
ITEM_FRAMING = 4096


@pytest.mark.parametrize("lane", LANES)
def test_a_state_of_thousands_of_tensors_saves_and_resumes_bitwise_under_a_1024_open_files_limit(
    tmp_path, request, lane
):
    report = run_probe("open_files.py", tmp_path, "async", pythonpath=lane_path(request, lane), open_files=LOW)
    assert report["tensors"] > 3000, report
    assert report["open_files_limit"] == {"trainer": list(LOW), "writer": list(LOW)}, report
    assert report["committed"] and report["resumed_step"] == 2, report
    assert report["equal"] == {k: True for k in ("model", "optim", "lr_scheduler", "trainer", "data", "rng")}
    # One descriptor for the arena on each side (and the trainer's for sending it), not thousands.
    for side in ("trainer", "writer"):
        assert report["fds_after"][side] - report["fds_before"][side] <= 4, report
    assert report["bytes"] < report["tensor_bytes"] + ITEM_FRAMING * report["tensors"], report
    assert_no_leftovers(tmp_path)


@pytest.mark.extended
def test_torch_async_saves_thousands_of_tensors_under_a_1024_open_files_limit(tmp_path, nvrx_lane):
    report = run_probe("open_files.py", tmp_path, "torch-async", pythonpath=[nvrx_lane], open_files=LOW)
    assert report["tensors"] > 3000 and report["committed"] and report["resumed_step"] == 2, report
    assert report["equal"] == {k: True for k in ("model", "optim", "lr_scheduler", "trainer", "data", "rng")}
    assert report["bytes"] < report["tensor_bytes"] + ITEM_FRAMING * report["tensors"], report


# The world of one above stands for each rank in CI; this repeats it with two ranks under the
# launcher, every process of the job under the limit.
@pytest.mark.extended
@pytest.mark.parametrize("lane", ["pinned", "image"])
def test_two_ranks_stopped_and_resumed_under_a_1024_open_files_limit_equal_an_uninterrupted_run(
    tmp_path, request, lane
):
    pythonpath = [PROBES_DIR, *lane_path(request, lane)]
    common = ["train.steps=4", "checkpoint.interval_steps=2", "model.factory=many_tensors:build"]
    reference = run_local(tmp_path / "ref", overrides=common, pythonpath=pythonpath, timeout=400)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    for overrides in (common + ["train.stop_at_step=2"], common):
        proc = run_local(tmp_path, overrides=overrides, pythonpath=pythonpath, timeout=400, open_files=LOW)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from step 2" in proc.stdout
    assert read_losses(tmp_path) == read_losses(tmp_path / "ref")
    assert read_summary(tmp_path)["params_sha256"] == read_summary(tmp_path / "ref")["params_sha256"]
    assert_no_leftovers(tmp_path)


@pytest.fixture(scope="module", params=LANES)
def writer_report(request, tmp_path_factory) -> dict:
    """The writer probe on one lane, its soft limit 1024 under a hard limit of 4096."""
    run_dir = tmp_path_factory.mktemp(f"writer-{request.param}")
    report = run_probe(
        "writer_requests.py", run_dir, pythonpath=lane_path(request, request.param), open_files=(1024, 4096)
    )
    assert_no_leftovers(run_dir)
    return report


def test_the_soft_open_files_limit_is_raised_to_the_hard_one_at_start_and_said_once(writer_report):
    assert writer_report["said"] == [
        "[resilient-fsdp] open files (RLIMIT_NOFILE): soft limit 1024, hard limit 4096; soft limit raised to 4096"
    ], writer_report
    assert writer_report["later_call_first"] is False
    assert writer_report["trainer_limit"] == [4096, 4096]
    assert writer_report["writer"]["open_files_limit"] == [4096, 4096]  # inherited from the trainer


def test_the_writer_process_hides_the_gpus_before_any_cuda_call(writer_report):
    """No GPU can exist here (a CPU-only torch build), so no CUDA context can be seen or missed.
    What is checked is what keeps the writer off the GPUs on a GPU machine: inside the writer
    process ``CUDA_VISIBLE_DEVICES`` is empty (the CUDA runtime then finds no device to open a
    context on), torch never initialised CUDA there, and on NVRx 0.7 the queue starts its worker
    in ``cpu_shm_mode`` (without it, the worker selects a device and allocates on it at start)."""
    for facts in (writer_report["writer"], writer_report["writer_after_feeder"]):  # a replaced writer too
        assert facts["CUDA_VISIBLE_DEVICES"] == "" and facts["cuda_initialized"] is False, writer_report
    assert writer_report["cpu_shm_mode"] is (None if writer_report["nvrx_version"].startswith("0.4") else True)


def test_a_save_whose_state_cannot_be_pickled_fails_at_once_naming_the_value(writer_report):
    failed = writer_report["unsendable"]
    assert failed["seconds"] < 5 and failed["files"] == [], failed  # not after checkpoint.write_timeout_s
    assert "the checkpoint writer cannot be sent" in failed["error"], failed
    assert "['data']['sampler'] (a __main__.unpicklable.<locals>.Local) cannot be pickled" in failed["error"], failed
    after = writer_report["after_unsendable"]
    assert after["error"] is None and after["files"] == ["rank00000.pt"], after  # the writer took the next save


def test_a_request_the_queues_feeder_thread_cannot_pickle_is_reported_by_the_next_poll(writer_report):
    """NVRx's queue pickles in a feeder thread, which prints what it cannot pickle and drops it:
    the caller would wait for a completion that never comes."""
    assert writer_report["feeder_seconds"] < 5, writer_report
    assert "could not send the request for main.<locals>.<lambda>" in writer_report["feeder_error"], writer_report
    assert "Can't pickle" in writer_report["feeder_error"]
    assert any("a new checkpoint writer is started" in n for n in writer_report["notes"]), writer_report
