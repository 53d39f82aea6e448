"""Staging in a real trainer: the buffers allocated after a process's first step and only if it
will save; a wait for the previous write counted once, as the new save's stall; staging jobs on
helper threads kept between saves, none queued behind a hung hand-off; the walks over a state
stepping over a sequence of scalars whole (Python's random state) with the same result."""

from __future__ import annotations

from tests.checkpoint.probes import run_probe
from tests.support import assert_no_leftovers


def test_waiting_for_the_previous_write_is_the_new_saves_stall_counted_once(tmp_path):
    report = run_probe("engine.py", tmp_path, "back-to-back", "async")
    stall, previous = report["stall_s"], report["previous_s"]
    assert report["waited_s"] > 1.5, report  # the save of step 3 did wait for step 2's slow write
    assert previous["3"] > 1.0 and stall["3"] >= previous["3"], report
    assert stall["2"] < 1.0, report  # step 3's wait is not step 2's as well
    assert previous["1"] < 0.05 and previous["2"] < 0.05, report  # nothing was in flight


def test_a_process_allocates_its_staging_buffers_after_its_first_step_and_only_if_it_will_save(tmp_path):
    report = run_probe("engine.py", tmp_path, "warm", "async")
    assert report["saves_allocating"] and not report["never_allocating"], report
    assert report["committed"] and report["allocations"] == 1, report
    assert_no_leftovers(tmp_path)


def test_a_sequence_of_scalars_is_walked_whole_and_gives_what_a_walk_of_each_would():
    import random

    import torch

    from resilient_fsdp.checkpoint.memory.values import without_tensors
    from resilient_fsdp.checkpoint.staging import local_tensors, replace_tensors, structure

    py_state = random.getstate()  # (3, a tuple of 625 ints, None): in every state a save takes
    t = torch.arange(4.0)
    sd = {"rng": {"python": py_state}, "mixed": [1, t, (2.5, "x")], "model": {"w": t}}
    places = structure(sd)
    assert ("/rng/python/1", "tuple", 625) in places
    assert [p for p in places if p[0].startswith("/rng/python/1/")] == [
        (f"/rng/python/1/{i}", "object") for i in range(625)
    ]
    assert ("/mixed/1", "tensor", (4,), torch.float32) in places and ("/mixed/2/1", "object") in places
    assert [x.data_ptr() for x in local_tensors(sd)] == [t.data_ptr(), t.data_ptr()]
    views = [torch.zeros(4), torch.ones(4)]
    replaced = replace_tensors(sd, iter(views))
    assert replaced["rng"]["python"][1] == (None,) * 625 and replaced["mixed"][2] == (None, None)
    assert replaced["mixed"][1] is views[0] and replaced["model"]["w"] is views[1]
    kept = without_tensors(sd)
    assert kept["rng"]["python"] == py_state and kept["mixed"][0] == 1 and kept["mixed"][2] == (2.5, "x")


def test_a_staging_job_reuses_an_idle_helper_thread_and_never_waits_behind_a_hung_hand_off():
    import threading

    import torch

    from resilient_fsdp.checkpoint.staging import StagingJob

    sd = {"w": torch.arange(8.0), "rest": [torch.ones(3), 5]}

    def buffers() -> dict:
        return {"w": torch.zeros(8), "rest": [torch.zeros(3), None]}

    released = threading.Event()
    first = buffers()
    hung = StagingJob(sd, first, False, lambda: released.wait(30))  # a writer that does not answer
    hung.wait()
    assert torch.equal(first["w"], sd["w"]) and not hung.done()
    second = buffers()
    StagingJob(sd, second, False, None).join()  # a replacement engine's save: not queued behind it
    assert torch.equal(second["rest"][0], sd["rest"][0])
    released.set()
    hung.join()
    ran_on: list[threading.Thread] = []
    for _ in range(5):  # saves one after another run on the idle threads, start none
        StagingJob(sd, buffers(), False, lambda: ran_on.append(threading.current_thread())).join()
    assert len(ran_on) == 5 and len(set(ran_on)) <= 2, ran_on


def test_waiting_for_the_copy_itself_returns_once_the_buffers_hold_the_state():
    """On CPU the copy is over when :meth:`wait` returns; :meth:`wait_for_the_copy` (what the
    checkpoint bench counts on CUDA, where the copy runs on a side stream) means the same here."""
    import threading

    import torch

    from resilient_fsdp.checkpoint.staging import StagingJob

    sd = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    buffers = {"w": torch.zeros(1 << 16)}
    gate = threading.Event()
    job = StagingJob(sd, buffers, cuda=False, then=gate.wait)  # the follow-up waits: only the copy is over
    assert job.wait_for_the_copy() >= 0 and job.copied.is_set() and not job.done()
    assert torch.equal(buffers["w"], sd["w"])
    gate.set()
    job.join()
    assert job.error is None
