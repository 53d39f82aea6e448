"""``bench checkpoint``'s own accounting, on this machine's real counters (its figures are
exercised end to end by the GPU check's CPU rehearsal, tests/bench/test_gpu_check.py)."""

from __future__ import annotations

import time

from resilient_fsdp.bench.checkpoint_engines import core_times, page_faults


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
