"""``bench recovery``'s reading of a job's checkpoint records (the jobs themselves run in the benchmark)."""

from __future__ import annotations

import json

import pytest

from resilient_fsdp.bench.recovery import save_stalls


def test_save_stalls_compare_the_first_save_after_a_restart_with_normal_ones_and_keep_their_parts(tmp_path):
    def event(step, previous, agree, staging, waited_for=0.0):
        parts = {"previous_s": previous, "state_s": 0.01, "agree_s": agree, "start_s": 0.02}
        call = sum(parts.values())
        return {
            "event": "checkpoint",
            "step": step,
            "save_call_s": call,
            "staging_wait_s": staging,
            "stall_s": call + staging + waited_for,
            "save_call_parts_s": parts,
        }

    # The job's first save (10) allocates: left out. The write of step 30 (a restarted writer's) was
    # waited for 1.2 s before step 40's save (charged to 30: counted); the final save (40) waited
    # 2 s for its own commit (not counted) and 0.5 s inside its call for nothing (counted).
    events = [
        event(10, 0.0, 0.0, 0.9),
        event(20, 0.0, 0.01, 0.06),
        event(30, 0.0, 0.3, 0.07, waited_for=1.2),
        event(40, 0.5, 0.0, 0.0, waited_for=2.0),
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(e) + "\n" for e in events + [{"event": "step", "step": 21}]))
    out = save_stalls(metrics, fault_step=22, final_step=40)
    assert out["normal_save_stall_s"] == pytest.approx(0.1)
    assert out["save_after_restart_stall_s"] == pytest.approx([1.6, 0.53])
    assert out["save_after_restart_over_normal"] == pytest.approx(16.0)
    first, final = out["save_after_restart_parts_s"]
    assert first["agree_s"] == 0.3 and first["staging_wait_s"] == 0.07 and final["previous_s"] == 0.5
    assert [p["agree_s"] for p in out["normal_save_parts_s"]] == [0.01]


def test_the_memory_save_stall_is_the_median_of_the_saves_after_the_first(tmp_path):
    from resilient_fsdp.bench.recovery import memory_stall

    records = [
        {"event": "memory_checkpoint", "step": s, "stall_s": t, "error": e}
        for s, t, e in ((1, 0.5, None), (2, 0.01, None), (3, 0.03, None), (4, 9.0, "OSError: full"), (5, 0.02, None))
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert memory_stall(metrics) == pytest.approx(0.02)  # the first (mapping the slot) and the failed one left out
    metrics.write_text(json.dumps({"event": "step", "step": 1}) + "\n")
    assert memory_stall(metrics) is None


def test_the_replicas_time_is_the_median_of_rank_0s_sends_after_the_first(tmp_path):
    from resilient_fsdp.bench.recovery import replica_time

    records = [
        {"event": "memory_replica", "step": s, "send_s": t, "bytes": 10, "error": None}
        for s, t in ((1, 0.9), (2, 0.04), (3, 0.06), (4, 0.05))
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "".join(json.dumps(r) + "\n" for r in records)
        + json.dumps({"event": "memory_checkpoint", "step": 5, "stall_s": 3.0})
        + "\n"
    )
    assert replica_time(metrics) == pytest.approx(0.05)
    metrics.write_text(json.dumps({"event": "memory_replica", "step": 1, "send_s": 0.9}) + "\n")
    assert replica_time(metrics) is None
