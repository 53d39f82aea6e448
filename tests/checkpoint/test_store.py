"""The checkpoint directory layout: atomic commit, discovery, retention."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from resilient_fsdp.checkpoint import store
from tests.support import _env


def _partial(root, step, token="abcd1234"):
    path = root / store.partial_name(step, token)
    path.mkdir(parents=True)
    (path / "data.distcp").write_bytes(b"x" * 10)
    return path


def test_commit_makes_a_checkpoint_visible_only_when_complete(tmp_path):
    partial = _partial(tmp_path, 7)
    assert store.scan(tmp_path) == ([], [partial])  # written but not committed: not a checkpoint
    final = store.commit(partial, {"step": 7, "world_size": 2})
    assert final == tmp_path / "step_00000007" and not partial.exists()
    committed, unusable = store.scan(tmp_path)
    assert [c.step for c in committed] == [7] and committed[0].manifest["world_size"] == 2
    assert unusable == []


def test_unmarked_or_mismatched_directories_are_unusable_and_left_in_place(tmp_path):
    (tmp_path / "step_00000003").mkdir()  # no COMPLETE marker
    store.commit(_partial(tmp_path, 5), {"step": 5})
    wrong = store.commit(_partial(tmp_path, 6), {"step": 6})
    wrong.rename(tmp_path / "step_00000009")  # marker names another step
    (tmp_path / "notes.txt").write_text("operator notes")
    committed, unusable = store.scan(tmp_path)
    assert [c.step for c in committed] == [5]
    assert sorted(p.name for p in unusable) == ["step_00000003", "step_00000009"]
    assert (tmp_path / "step_00000003").exists() and (tmp_path / "notes.txt").exists()


def test_recommitting_a_step_moves_the_old_one_aside(tmp_path):
    store.commit(_partial(tmp_path, 4, "aaaa0000"), {"step": 4, "run": "old"})
    store.commit(_partial(tmp_path, 4, "bbbb1111"), {"step": 4, "run": "new"})
    committed, _ = store.scan(tmp_path)
    assert [c.manifest["run"] for c in committed] == ["new"]
    assert len(list(tmp_path.glob("step_00000004.superseded-*"))) == 1


def test_retention_keeps_the_newest_k(tmp_path):
    for step in (2, 4, 6, 8):
        store.commit(_partial(tmp_path, step), {"step": step})
    committed, _ = store.scan(tmp_path)
    assert [c.step for c in store.retention_victims(committed, 2)] == [2, 4]
    assert store.retention_victims(committed, 0) == []  # 0 keeps everything
    assert store.retention_victims(committed, 10) == []


def test_a_recommit_cut_between_its_two_renames_loses_nothing(tmp_path):
    store.commit(_partial(tmp_path, 4, "aaaa0000"), {"step": 4, "run": "old"})
    # The re-commit wrote its marker and moved the old step_4 aside, then the process died.
    partial = _partial(tmp_path, 4, "bbbb1111")
    (partial / store.MARKER).write_text('{"step": 4, "run": "new"}')
    (tmp_path / "step_00000004").rename(tmp_path / "step_00000004.superseded-1-aaaa0000")
    assert store.scan(tmp_path)[0] == []  # no step_4 visible...
    assert store.recover(tmp_path) == [tmp_path / "step_00000004"]  # ...until the next start completes it
    assert [c.manifest["run"] for c in store.scan(tmp_path)[0]] == ["new"]
    assert store.recover(tmp_path) == []


def test_superseded_copies_never_collide_are_listed_and_follow_retention(tmp_path):
    for token in ("aaaa0000", "bbbb1111", "cccc2222"):  # three commits of step 4 within one second
        store.commit(_partial(tmp_path, 4, token), {"step": 4, "run": token})
    aside = store.aside(tmp_path)["superseded"]
    assert [step for step, _ in aside] == [4, 4] and len({p.name for _, p in aside}) == 2
    for step in (8, 12):
        store.commit(_partial(tmp_path, step), {"step": step})
    store.apply_retention(tmp_path, keep_last=3)  # steps 4, 8, 12 kept: so are step 4's older copies
    assert len(store.aside(tmp_path)["superseded"]) == 2
    store.commit(_partial(tmp_path, 16), {"step": 16})
    deleted = store.apply_retention(tmp_path, keep_last=3)
    assert sorted(p.name for p in deleted)[0] == "step_00000004" and len(deleted) == 3
    assert store.aside(tmp_path) == {"superseded": [], "abandoned": [], "suspect": [], "deleting": []}
    assert [c.step for c in store.scan(tmp_path)[0]] == [8, 12, 16]


def test_retention_killed_mid_delete_never_leaves_a_checkpoint_that_scans_as_good(tmp_path):
    """A real crash: retention runs in another process, killed while it deletes the victim. The
    process stops itself after its 100th file removal (an audit hook sees each ``os.remove``), so
    the kill lands mid-delete however loaded the machine is."""
    for step in (1, 2):
        path = _partial(tmp_path, step)
        for i in range(400):
            (path / f"__{i}_0.distcp").write_bytes(b"x")
        store.commit(path, {"step": step})
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from resilient_fsdp.checkpoint import store\n"
        "removed = [0]\n"
        "def stop_midway(event, args):\n"
        "    if event == 'os.remove':\n"
        "        removed[0] += 1\n"
        "        if removed[0] == 100:\n"
        "            os.kill(os.getpid(), signal.SIGSTOP)\n"
        "sys.addaudithook(stop_midway)\n"
        "store.apply_retention(Path(sys.argv[1]), keep_last=1)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=_env())
    victim_files = lambda: sum(len(list(p.iterdir())) for p in tmp_path.iterdir() if p.name.startswith("step_00000001"))
    deadline = time.monotonic() + 60
    while (
        proc.poll() is None
        and psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    assert 0 < victim_files() < 401, "the kill did not cut the deletion; the test proves nothing"
    assert [c.step for c in store.scan(tmp_path)[0]] == [2]  # step 1 is no checkpoint any more
    assert store.scan(tmp_path)[1] == []
    store.apply_retention(tmp_path, keep_last=1)  # the next pass removes the leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]


def test_retention_that_cannot_delete_is_reported_and_raises_nothing(tmp_path):
    for step in (1, 2):
        store.commit(_partial(tmp_path, step), {"step": step})
    stuck = tmp_path / "step_00000001" / "data.distcp"
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode != 0:
        pytest.skip(
            "chattr +i is not available here (needs CAP_LINUX_IMMUTABLE and ext4/xfs); it makes a "
            "real deletion fail even for root"
        )
    said = []
    try:
        store.apply_retention(tmp_path, keep_last=1, say=said.append)
        assert len(said) == 1 and "could not delete everything" in said[0] and "training goes on" in said[0]
        assert [c.step for c in store.scan(tmp_path)[0]] == [2] and store.scan(tmp_path)[1] == []
    finally:
        for p in tmp_path.glob("step_00000001*/data.distcp"):
            subprocess.run(["chattr", "-i", str(p)])
    store.apply_retention(tmp_path, keep_last=1, say=said.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]


def test_a_lease_names_its_job_refuses_another_and_is_taken_over_after_a_crash(tmp_path):
    from resilient_fsdp.checkpoint.lease import Lease
    from resilient_fsdp.config import ConfigError

    said = []
    first = Lease(tmp_path, "job-a", said.append)
    first.acquire()
    with pytest.raises(ConfigError, match="in use by job 'job-a'.*its process is running on this host"):
        Lease(tmp_path, "job-b", said.append).acquire()
    again = Lease(tmp_path, "job-a", said.append)  # a restart of the same job takes it over
    again.acquire()
    assert "from an earlier run of this job" in said[-1]
    assert first.check() and "taken over" in first.check()
    again.release()
    first.release()  # it no longer holds it: nothing to remove
    assert not (tmp_path / "LEASE").exists()
    # A job that crashed holding the lease: its process is gone, so another job may take it.
    code = (
        "import os, sys; from pathlib import Path; from resilient_fsdp.checkpoint.lease import Lease; "
        "Lease(Path(sys.argv[1]), 'job-crashed', print).acquire(); os._exit(9)"
    )
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=_env()).returncode == 9
    taker = Lease(tmp_path, "job-c", said.append)
    taker.acquire()
    assert "from job 'job-crashed'" in said[-1] and "its process is gone" in said[-1]
    taker.release()


def test_a_new_install_of_the_job_waits_for_the_old_ones_live_lease_and_a_restart_of_either_takes_it_over(
    tmp_path, monkeypatch
):
    """The install is RESILIENT_FSDP_INSTALL_ID (the chart's JobSet UID): an earlier install that
    still lives is waited for, never written beside; a restart of the same install, or a lease
    without an install (a job before the chart passed one), is taken over as before."""
    from resilient_fsdp.checkpoint.lease import INSTALL_ENV, Lease
    from resilient_fsdp.config import ConfigError

    said = []
    monkeypatch.setenv(INSTALL_ENV, "11111111-old")
    old = Lease(tmp_path, "release", said.append)
    old.acquire()
    monkeypatch.setenv(INSTALL_ENV, "22222222-new")
    new = Lease(tmp_path, "release", said.append)
    waiting = new.try_acquire()
    assert (
        waiting.startswith("waiting for the earlier install 11111111 of job 'release' (host ")
        and "its process is running on this host" in waiting
    )
    assert old.check() is None  # nothing was written: the old install still holds it
    with pytest.raises(
        ConfigError,
        match=r"still held by the earlier install 11111111 of job 'release'.* after 7 s "
        r"\(checkpoint.lease_wait_s\).*jobset-uid=11111111-old",
    ):
        raise ConfigError(new.refusal_after_wait(7.0))
    with pytest.raises(ConfigError, match="in use by job 'release'"):
        Lease(tmp_path, "other-job", said.append).try_acquire()  # another job is refused, not waited for
    old.release()  # the old install committed its final checkpoint and exited
    assert new.try_acquire() is None and new.check() is None
    restart = Lease(tmp_path, "release", said.append)  # the new install restarted: takes it over at once
    assert restart.try_acquire() is None and "from an earlier run of this job" in said[-1]
    restart.release()
    new.release()


def test_the_sweep_removes_torn_writes_a_commit_reached_and_at_a_start_all_but_never_user_data(tmp_path):
    for step in (4, 8):
        store.commit(_partial(tmp_path, step), {"step": step})
    torn_4 = _partial(tmp_path, 4, "00000001")  # a failed re-save of step 4
    torn_8 = _partial(tmp_path, 8, "00000002")
    newer = _partial(tmp_path, 12, "00000003")  # a write killed before step 12 was committed
    in_flight = _partial(tmp_path, 8, "00000004")  # a save of step 8 again (after a failed load)
    leftover = tmp_path / "step_00000002.deleting-00000005"
    leftover.mkdir()
    abandoned = tmp_path / "step_00000016.abandoned-1-aa"
    superseded = tmp_path / "step_00000008.superseded-1-bb"
    unreadable = tmp_path / "step_00000010"
    for keep in (abandoned, superseded, unreadable):
        keep.mkdir()
    said, events = [], []
    names = store.torn_names(tmp_path)
    removed = store.sweep_torn(tmp_path, names, in_flight=in_flight, say=said.append, record=events.append)
    assert sorted(p.name for p in removed) == sorted([leftover.name, torn_4.name, torn_8.name])
    assert newer.exists() and in_flight.exists()  # step 12 is not committed: not at or below the newest
    assert all(p.exists() for p in (abandoned, superseded, unreadable))
    assert [c.step for c in store.scan(tmp_path)[0]] == [4, 8]
    assert len(said) == 3 and all(m.startswith("removed torn checkpoint directory") for m in said), said
    assert {e["event"] for e in events} == {"checkpoint_swept"} and sum(e["bytes"] for e in events) == 20
    # At a start nothing of the job is in flight: every incomplete directory is stale.
    stale = frozenset(store.torn_names(tmp_path))
    store.sweep_torn(tmp_path, sorted(stale), stale)
    assert store.torn_names(tmp_path) == [] and all(p.exists() for p in (abandoned, superseded, unreadable))


def test_the_sweep_is_capped_and_the_rest_goes_at_the_next_pass(tmp_path):
    store.commit(_partial(tmp_path, 9), {"step": 9})
    for i in range(store.SWEEP_CAP + 2):
        _partial(tmp_path, 9, f"{i:08x}")
    names = store.torn_names(tmp_path)
    assert len(store.sweep_torn(tmp_path, names)) == store.SWEEP_CAP
    assert len(store.sweep_torn(tmp_path, store.torn_names(tmp_path))) == 2
    assert store.torn_names(tmp_path) == []


def test_three_kills_during_saves_leave_at_most_one_incomplete_directory(tmp_path):
    store.commit(_partial(tmp_path, 4), {"step": 4})
    for kill in range(3):
        stale = frozenset(store.torn_names(tmp_path))  # a start: the sweep runs before the first save
        store.sweep_torn(tmp_path, sorted(stale), stale)
        _partial(tmp_path, 8, f"{kill:08x}")  # then the save of step 8 is killed
        assert len(store.torn_names(tmp_path)) == 1
    # Space: keep_last committed + the torn write, whatever the number of kills.
    assert store.dir_bytes(tmp_path) == 2 * 10 + len((tmp_path / "step_00000004" / store.MARKER).read_bytes())


def test_retention_and_the_sweep_delete_nothing_once_the_lease_is_another_jobs(tmp_path):
    """Rank 0's retention thread asks the lease before each deletion: once another job holds the
    directory (its lease taken over while this one was stopped, say), what this job took for old
    checkpoints or torn writes may be that job's newest ones, so nothing more goes."""
    from functools import partial

    from resilient_fsdp import atomic
    from resilient_fsdp.checkpoint.lease import Lease, taken_over

    lease = Lease(tmp_path, "job-a", lambda _m: None)
    lease.acquire()
    check = partial(taken_over, lease.path, lease.holder)
    try:
        for step in (4, 8, 12):
            store.commit(_partial(tmp_path, step), {"step": step})
        torn = _partial(tmp_path, 12, "00000009")
        assert check() is None
        atomic.write_json(lease.path, {**lease.read(), "job": "job-b", "holder": "job-b-holder"})
        said = []
        assert store.apply_retention(tmp_path, keep_last=1, say=said.append, lease_lost=check) == []
        assert store.sweep_torn(tmp_path, store.torn_names(tmp_path), say=said.append, lease_lost=check) == []
        assert [c.step for c in store.scan(tmp_path)[0]] == [4, 8, 12] and torn.exists()
        assert len(said) == 2 and all("stopped, nothing more deleted" in m and "job-b" in m for m in said), said
    finally:
        lease.release()
