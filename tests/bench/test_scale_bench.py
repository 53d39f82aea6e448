"""``bench scale``: the simulated ranks' save plans are DCP's own, every phase is measured and
judged against its target, a larger world is extrapolated from measured ones and says so, and a
case the user got wrong exits 2 naming the flag. Ranks are simulated in one process with torch's
fake process group (nothing else here can stand in for 1,024 ranks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from resilient_fsdp.bench import scale
from tests.support import REPO, _env


@pytest.mark.parametrize("layout", ["fsdp", "hsdp-4"])
def test_every_ranks_built_plan_is_the_one_dcps_planner_makes(layout):
    world = scale.World(8, scale.shard_group(layout, 8))
    try:
        template = scale.local_save_plan(world.state_dict(0, "tiny"))
        for rank in range(8):
            real = scale.local_save_plan(world.state_dict(rank, "tiny"))
            built = scale.plan_for(template, world, rank)
            assert built.items == real.items, (layout, rank)
        # The shards differ by rank: a plan copied from rank 0 would not pass.
        assert scale.plan_for(template, world, 1).items != template.items
    finally:
        world.close()


def test_a_case_is_measured_in_every_phase_and_judged_by_its_targets():
    record = scale.run_case({"ranks": 8, "preset": "tiny", "layout": "hsdp-4"}, say=lambda _m: None)
    assert "extrapolated_from" not in record
    phases = record["phases_s"]
    assert phases and all(v >= 0 for v in phases.values()) and phases["save_rank0_global_plan"] > 0
    # Planned alone: rank 0 digests its structure, reads every rank's vote and plans with the metadata.
    assert record["cold_save_plan_s"] == pytest.approx(
        phases["alone_digest_structure"]
        + phases["alone_vote_unpickle_every_digest"]
        + phases["alone_rank0_plan_and_metadata"]
    )
    assert record["max_rank_blocked_s"] >= record["cold_save_plan_s"]
    assert record["resume_metadata_and_plan_s"] == pytest.approx(
        phases["resume_read_index"]
        + phases["resume_decode_index"]
        + phases["resume_local_load_plan"]
        + phases["resume_index_lookups"]
    )
    assert 0 < record["index_bytes"] and 0 < record["metadata_bytes"]
    # DCP's collective planning, measured beside it: the gather, global plan and scatter on rank 0.
    assert record["collective_cold_save_plan_s"] == pytest.approx(
        phases["save_rank0_unpickle_every_plan"]
        + phases["save_rank0_global_plan"]
        + phases["save_rank0_pickle_every_central_plan"]
    )
    assert record["collective_max_rank_blocked_s"] > record["collective_cold_save_plan_s"]
    # HSDP in groups of 4: each shard is written once, by one of the two replicas.
    assert record["items_written"] < 2 * record["items_per_rank"] * 4
    # The object collectives' tree (rank 0: its four children) and the replica pairs, at any world.
    connections = record["extra_connections_per_rank"]
    assert (connections["rank0"], connections["other_ranks_at_most"]) == (4 + 2, 4 + 1 + 2)
    assert scale.extra_connections(16384) == connections
    for key, judged in record["targets"].items():
        assert judged["met"] == (judged["value"] <= scale.TARGETS[key]), key


def test_a_world_beyond_the_measured_is_extrapolated_from_three_smaller_ones():
    record = scale.run_case({"ranks": 32, "preset": "tiny", "layout": "hsdp-2"}, max_measured=8, say=lambda _m: None)
    assert sorted(record["extrapolated_from"], key=int) == ["2", "4", "8"]
    assert scale._fit([2, 4, 8], [1.0, 2.0, 4.0], 32) == pytest.approx(16.0)
    assert scale._fit([2, 4, 8], [5.2, 5.0, 4.6], 32) == pytest.approx(4.933, abs=1e-3)  # noise around a constant
    assert set(record["extrapolated_from"]["8"]["phases_s"]) == set(record["phases_s"])
    measured = record["extrapolated_from"]["8"]
    assert record["plan_gather_bytes"] > measured["plan_gather_bytes"]  # linear in the world


def test_a_bad_case_exits_2_naming_the_flag():
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "resilient_fsdp.cli", "bench", "scale", "--case", "1000:70b:hsdp-64"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=_env(),
    )
    assert proc.returncode == 2, proc.stderr
    assert "hsdp-64" in proc.stderr and "1000" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "resilient_fsdp.cli", "bench", "scale", "--case", "8:huge:fsdp"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=_env(),
    )
    assert proc.returncode == 2 and "--case" in proc.stderr and "huge" in proc.stderr, proc.stderr


def test_the_recorded_figures_hold_the_thousand_and_sixteen_thousand_rank_cases():
    records = json.loads((REPO / "docs" / "benchmarks" / "scale.json").read_text())
    cases = {(r["ranks"], r["preset"], r["layout"]) for r in records}
    assert {(1024, "70b", "fsdp"), (16384, "70b", "hsdp-64")} <= cases
    for r in records:
        for key in (
            "cold_save_plan_s",
            "max_rank_blocked_s",
            "resume_metadata_and_plan_s",
            "rank0_training_process_python_s",
            "extra_connections_per_rank",
        ):
            assert key in r, (key, r["ranks"])
