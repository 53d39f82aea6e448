"""Failed saves as pure pieces: the streak that ends a job at checkpoint.max_consecutive_failures,
which errors are a full volume, and what a full volume says (no processes; the saves themselves
fail in real processes in test_checkpoint_failures.py)."""

from __future__ import annotations

import errno
import shutil

import pytest

from resilient_fsdp.checkpoint import failures
from resilient_fsdp.checkpoint.failures import FailureStreak, SaveFailed
from resilient_fsdp.config import ConfigError, load_config


def failed(step: int, cause: str = failures.WRITER, fatal: bool = False) -> SaveFailed:
    return SaveFailed(f"checkpoint of step {step} failed (rank 1: OSError: boom)", cause, step, fatal)


def test_the_streak_ends_the_job_at_the_limit_and_a_commit_starts_it_again():
    streak = FailureStreak(limit=3)
    assert [streak.failed(failed(4)), streak.failed(failed(8))] == [1, 2]
    streak.committed()
    assert [streak.failed(failed(16)), streak.failed(failed(20))] == [1, 2]
    with pytest.raises(SaveFailed) as end:
        streak.failed(failed(24, failures.VOLUME_FULL))
    assert "3 checkpoint save(s) in a row failed (checkpoint.max_consecutive_failures=3)" in str(end.value)
    assert "checkpoint of step 24 failed" in str(end.value)  # the last cause, named
    assert (end.value.cause, end.value.step, end.value.fatal) == (failures.VOLUME_FULL, 24, True)
    assert streak.total == 5


def test_a_lost_lease_ends_the_job_at_the_first_failure_and_a_limit_of_one_fails_every_save():
    with pytest.raises(SaveFailed) as lease:
        FailureStreak(limit=3).failed(failed(4, failures.LEASE, fatal=True))
    assert lease.value.cause == failures.LEASE and "in a row" not in str(lease.value)
    with pytest.raises(SaveFailed, match=r"max_consecutive_failures=1"):
        FailureStreak(limit=1).failed(failed(4))


def test_the_limit_must_be_at_least_one_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.max_consecutive_failures"):
        load_config(None, ["checkpoint.max_consecutive_failures=0"])


def test_enospc_is_a_full_volume_as_an_oserror_and_in_a_writers_error_text():
    assert failures.is_volume_full(OSError(errno.ENOSPC, "No space left on device"))
    assert failures.is_volume_full("OSError: [Errno 28] No space left on device: '/ckpt/__0_0.distcp'")
    assert not failures.is_volume_full(OSError(errno.EFBIG, "File too large"))
    assert not failures.is_volume_full("OSError: injected writer failure")


def test_a_full_volume_names_free_and_needed_space_the_fix_and_that_nothing_committed_is_deleted(tmp_path):
    message = failures.volume_full_message(tmp_path, needed_bytes=1_800_000, keep_last=3)
    free_mb = shutil.disk_usage(tmp_path).free / 1e6
    assert "the checkpoint volume is full" in message and f"checkpoint.dir='{tmp_path}'" in message
    assert "a checkpoint needs about 1.8 MB" in message
    reported = float(message.split(": ", 1)[1].split(" MB free")[0])
    assert reported == pytest.approx(free_mb, rel=0.05, abs=50)  # the volume's own free space
    assert "lower checkpoint.keep_last (now 3" in message and "*.incomplete-*" in message
    assert "Committed checkpoints are never deleted to make room" in message
    unknown = failures.volume_full_message(tmp_path, needed_bytes=None, keep_last=3)
    assert "no checkpoint was committed yet" in unknown


def test_less_free_space_than_a_checkpoint_needs_counts_as_full_and_unknown_needs_do_not(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    assert failures.short_of_space(tmp_path, free * 2)
    assert not failures.short_of_space(tmp_path, 1024)
    assert not failures.short_of_space(tmp_path, None)
    assert not failures.short_of_space(tmp_path / "missing", 1024)
