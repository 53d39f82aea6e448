"""Rank 0's resume decision on synthetic checkpoint directories (no training): a rewind
(``resume_from``) once applied needs its target only while nothing newer was committed, a target
gone with nothing newer is a clear error, and every decision error reaches every rank."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch.multiprocessing as mp

from resilient_fsdp.checkpoint import resume as resume_, store
from resilient_fsdp.config import CheckpointConfig, ConfigError
from resilient_fsdp.checkpoint.store import CheckpointError


def _commit(root, step, token="abcd1234"):
    partial = root / store.partial_name(step, token)
    partial.mkdir(parents=True)
    (partial / "data.distcp").write_bytes(b"x" * 10)
    return store.commit(partial, {"step": step, "world_size": 1})


def _decide(root, target, job="job-b"):
    said = []
    plan = resume_.decide(CheckpointConfig(dir=str(root), resume_from=str(target)), root, job, said.append)
    return plan, said


def test_an_applied_rewind_resumes_from_the_newest_commit_after_retention_deleted_its_target(tmp_path):
    for step in (4, 8, 12):
        _commit(tmp_path, step)
    target = tmp_path / store.committed_name(8)
    first, _ = _decide(tmp_path, target)
    assert first["pinned"] and first["candidate"]["step"] == 8
    assert [p.name.split(".")[0] for _s, p in store.aside(tmp_path)["abandoned"]] == ["step_00000012"]
    record = json.loads((tmp_path / resume_.RESUME_RECORD).read_text())
    assert record["step"] == 8 and record["job"] == "job-b"
    # Nothing newer yet: a restart loads the target itself.
    again, _ = _decide(tmp_path, target)
    assert again["pinned"] and again["candidate"]["path"] == str(target)
    for step in (12, 16, 20):
        _commit(tmp_path, step, token="ef012345")
    assert [p.name for p in store.apply_retention(tmp_path, keep_last=2)] == [
        "step_00000004",
        "step_00000008",
        "step_00000012",
    ]
    assert not target.exists()
    later, said = _decide(tmp_path, target)
    assert later == {"candidate": later["candidate"]} and later["candidate"]["step"] == 20
    assert any("applied at this job's first start" in m and "step 20" in m for m in said), said
    # Another job naming the same (now deleted) target is a first application: refused clearly.
    other, _ = _decide(tmp_path, target, job="job-c")
    assert other["config"] and "is not a complete checkpoint" in other["error"]


def test_an_applied_rewind_whose_target_is_gone_with_nothing_newer_is_a_clear_config_error(tmp_path):
    _commit(tmp_path, 4)
    target = _commit(tmp_path, 8)
    assert _decide(tmp_path, target)[0]["candidate"]["step"] == 8
    store.apply_retention(tmp_path, keep_last=1)  # keeps step 8
    assert target.exists()
    (target / store.MARKER).unlink()  # the operator deleted it, or it was lost
    plan, _ = _decide(tmp_path, target)
    assert plan["config"] is True and "candidate" not in plan
    assert "was applied at this job's first start" in plan["error"]
    assert "unset checkpoint.resume_from" in plan["error"] and "step 8" in plan["error"]


def test_decide_returns_config_errors_instead_of_raising_and_other_errors_as_checkpoint_errors(tmp_path):
    plan, _ = _decide(tmp_path, tmp_path / "nowhere")
    assert plan["config"] is True and "checkpoint.resume_from=" in plan["error"]
    with pytest.raises(ConfigError, match="checkpoint.resume_from="):
        resume_._raise_if_error(plan)
    with pytest.raises(CheckpointError, match="bucket gone"):
        resume_._raise_if_error({"error": "bucket gone", "config": False})
    assert resume_._raise_if_error({"candidate": None}) == {"candidate": None}


def _rank(rank, world, port, root, out):
    import torch
    import torch.distributed as dist
    from resilient_fsdp.checkpoint.group import RankGroup

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
    cfg = CheckpointConfig(dir=root, resume_from=os.path.join(root, "step_00000099"))
    try:
        resume_.resume(
            RankGroup(rank, world, torch.device("cpu")),
            cfg,
            __import__("pathlib").Path(root),
            "job",
            None,
            {},
            {},
            lambda _m: None,
        )
        result = ("returned", "")
    except Exception as exc:  # noqa: BLE001 - the type and message are what is compared
        result = (type(exc).__name__, str(exc))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.extended
def test_a_decision_error_reaches_every_rank_with_its_type_and_message(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(2, port, str(tmp_path), str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1] and results[0][0] == "ConfigError", results
    assert "checkpoint.resume_from=" in results[0][1]
