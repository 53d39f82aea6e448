"""Staging in a real trainer: the buffers allocated after a process's first step and only if it
will save; a wait for the previous write counted once, as the new save's stall."""

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
