"""``bench checkpoint``'s own accounting, on this machine's real counters (its figures are
exercised end to end by the GPU check's CPU rehearsal, tests/bench/test_gpu_check.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient_fsdp.bench.checkpoint_engines import core_times, page_faults
from tests.support import _env


def test_core_times_are_the_seconds_each_cpu_spent_per_state_since_a_reading():
    """``bench checkpoint`` reads the cores' states around each write (who used the training core)."""
    before = core_times()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.5:  # this process burns 0.5 s of CPU on some core
        pass
    delta = core_times(before)
    assert set(delta) == set(before) and all(name.startswith("cpu") for name in delta)
    busy = sum(f["user"] + f["nice"] + f["system"] for f in delta.values())
    assert busy >= 0.4, delta  # clock ticks: 0.5 s of CPU shows, give or take a few ticks
    assert all(v >= 0 for f in delta.values() for v in f.values()), delta


def test_page_faults_count_the_pages_this_process_touches_first():
    before = page_faults()
    block = bytearray(64 * 2**20)  # 16,384 fresh pages, faulted in as they are written
    for i in range(0, len(block), 4096):
        block[i] = 1
    assert page_faults() - before >= 8000


def test_the_memory_save_is_measured_beside_the_async_one_and_leaves_nothing_in_dev_shm(tmp_path):
    out = tmp_path / "bench.json"
    before = {p.name for p in Path("/dev/shm").iterdir()}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "bench",
            "checkpoint",
            "--preset",
            "tiny",
            "--modes",
            "sync",
            "async",
            "memory",
            "--saves",
            "2",
            "--idle-steps",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    memory = r["memory"]
    # The memory save: a copy into the slot and no commit on the training thread; the state's bytes.
    assert memory["commit_s"] == 0.0 and memory["stall_s"] > 0 and memory["write_s"] > 0
    state_bytes = r["params"] * 4 * 3  # fp32 weights and AdamW's two moments
    assert state_bytes <= memory["bytes"] < 1.1 * state_bytes
    target = r["targets"]["memory_stall_not_above_async"]
    assert target["measured"] == memory["stall_s"] and target["async"] == r["async"]["stall_s"]
    assert target["met"] == (memory["stall_s"] <= r["async"]["stall_s"])
    assert "memory" in proc.stdout
    # The async saves commit in rank 0's commit process: the stall counts the training thread's
    # share of the commit (gather, broadcast), the rest is background beside training.
    saves = r["async"]
    for call, wait, commit, background, stall in zip(
        saves["save_call_s_all"],
        saves["wait_before_step_s_all"],
        saves["commit_s_all"],
        saves["commit_background_s_all"],
        saves["stall_s_all"],
    ):
        assert stall == pytest.approx(call + wait + commit) and background > 0, saves
    # The host copy floor: the state's bytes copied once, at a plausible rate, judged against the target.
    assert r["host_copy_bytes"] == pytest.approx(state_bytes, rel=0.01) and 0 < r["host_copy_s"] < 1.0
    ratio = r["targets"]["async_stall_over_sync"]
    assert ratio["copy_floor_over_sync"] == pytest.approx(r["host_copy_s"] / r["sync"]["stall_s"])
    assert ratio["stall_over_copy_floor"] == pytest.approx(r["async"]["stall_s"] / r["host_copy_s"])
    assert "copy floor: one host copy of the state's" in proc.stdout
    left = {p.name for p in Path("/dev/shm").iterdir()} - before
    assert not left, left  # the tier's job directory went with the benchmark
