"""Benchmarks delete only their own scratch directories, never a user's."""

from __future__ import annotations

import pytest


def test_benchmarks_only_ever_delete_their_own_scratch_directories(tmp_path):
    from resilient_fsdp.bench.recovery import fresh_dir

    users = tmp_path / "users-data"
    users.mkdir()
    (users / "precious.txt").write_text("keep me")
    with pytest.raises(RuntimeError, match="refusing to delete it.*--run-dir"):
        fresh_dir(users)
    assert (users / "precious.txt").read_text() == "keep me"
    scratch = tmp_path / "scratch"
    fresh_dir(scratch)
    (scratch / "metrics.jsonl").write_text("{}")
    fresh_dir(scratch)  # a benchmark's own directory is emptied again
    assert [p.name for p in scratch.iterdir()] == [".resilient-fsdp-bench-scratch"]
