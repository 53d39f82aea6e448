"""A rank's footprint names the threads and descriptors it holds beyond its previous start's."""

from __future__ import annotations

import threading

from resilient_fsdp.train import footprint


def test_a_thread_and_a_file_left_open_are_named_at_the_next_start(monkeypatch, tmp_path):
    monkeypatch.setattr(footprint, "_previous", None)
    assert not footprint.grown()  # the first start is the baseline
    release = threading.Event()
    left = threading.Thread(target=release.wait, name="left-by-an-attempt", daemon=True)
    left.start()
    kept = open(tmp_path / "kept-open", "w")
    try:
        assert footprint.grown() == {"thread left-by-an-attempt": 1, f"fd {tmp_path / 'kept-open'}": 1}
        assert not footprint.grown()  # the same as at the previous start
        assert footprint.measure()["threads"] == sum(footprint.thread_names().values())
    finally:
        release.set()
        left.join()
        kept.close()
    assert not footprint.grown()
