"""``bench recovery``'s reading of a job's checkpoint records (the jobs themselves run in the benchmark)."""

from __future__ import annotations

import json

import pytest

from resilient_fsdp.bench.recovery import save_stalls


def test_save_stalls_compare_the_first_save_after_a_restart_with_normal_ones_and_keep_their_parts(tmp_path):
    def event(step, stall, agree):
        parts = {"previous_s": 0.0, "state_s": 0.01, "agree_s": agree, "start_s": 0.02}
        return {"event": "checkpoint", "step": step, "stall_s": stall, "staging_wait_s": stall - 0.03 - agree,
                "save_call_parts_s": parts}

    # The job's first save (10) allocates and the final one (40) waits for its commit: neither counts.
    events = [event(10, 0.9, 0.0), event(20, 0.1, 0.01), event(30, 0.4, 0.3), event(40, 2.0, 0.0)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(e) + "\n" for e in events + [{"event": "step", "step": 21}]))
    out = save_stalls(metrics, fault_step=22, final_step=40)
    assert out["normal_save_stall_s"] == 0.1 and out["save_after_restart_stall_s"] == [0.4]
    assert out["save_after_restart_over_normal"] == pytest.approx(4.0)
    (after,) = out["save_after_restart_parts_s"]
    assert after["agree_s"] == 0.3 and after["staging_wait_s"] == pytest.approx(0.07)
    assert [p["agree_s"] for p in out["normal_save_parts_s"]] == [0.01]
