"""The checkpoint directory layout: atomic commit, discovery, retention."""

from __future__ import annotations

from resilient_fsdp.checkpoint import store


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
