"""A non-finite loss (resilience/non_finite.py): one in-job restart as a suspected hardware fault,
the same step again fails the job with exit 2; the record it keeps, the rule on it, and the
``nan-loss`` faults that inject it. The real jobs: ``nan-loss`` in
test_faults.py::test_every_kind_in_one_pod_is_recovered_by_in_process_restart, ``nan-loss-repeat``
below."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from resilient_fsdp.config import parse_faults
from resilient_fsdp.resilience import exit_codes
from resilient_fsdp.resilience.faults import FaultInjector
from resilient_fsdp.resilience.inprocess import NotRetried
from resilient_fsdp.resilience.ledger import FaultLedger
from resilient_fsdp.resilience.non_finite import (
    NonFiniteLoss,
    RepeatedNonFiniteLoss,
    earlier_at_step,
    non_finite_ranks,
    stop,
)
from tests.resilience.fault_jobs import COMMON
from tests.support import assert_no_leftovers, read_events, run_local


def test_the_first_is_retried_in_job_and_the_repeat_fails_the_job():
    first, repeat = NonFiniteLoss("loss is nan at step 3"), RepeatedNonFiniteLoss("loss is nan at step 3 again")
    assert not exit_codes.is_configuration_failure(first)
    # Not an Exception: in-process restart, which retries every Exception, lets it through to the in-job one.
    assert not isinstance(first, Exception) and not issubclass(NonFiniteLoss, NotRetried)
    assert exit_codes.is_configuration_failure(repeat)
    row = exit_codes.row("non-finite-loss")
    assert row.kind == "infrastructure" and list(row.codes) == [exit_codes.NON_FINITE_LOSS] == [202]
    assert exit_codes.NON_FINITE_LOSS in exit_codes.RETRIED
    assert exit_codes.describe_code(202) == "202: non-finite-loss, retried by the job level"
    assert "a non-finite loss at a step the job already restarted for" in exit_codes.row("configuration").what


def _record(step: int, t: float, outcome: str = "restart") -> dict:
    return {"step": step, "t": t, "outcome": outcome, "ranks": [], "loss": math.nan}


@pytest.mark.parametrize(
    "records,step,repeated",
    [
        ([], 7, False),  # the first: one restart
        ([_record(7, 1)], 7, True),  # the same step after it: fail
        ([_record(5, 1)], 7, False),  # another step gets its own restart
        ([_record(5, 1), _record(7, 2)], 5, True),
        ([_record(7, 1), _record(7, 2, "failed")], 7, False),  # started again after the failure
        ([_record(7, 1), _record(7, 2, "failed"), _record(7, 3)], 7, True),
    ],
)
def test_the_same_step_rule_counts_the_records_since_the_last_failure(records, step, repeated):
    assert bool(earlier_at_step(records, step)) == repeated


def test_the_ranks_named_are_those_whose_own_loss_was_non_finite():
    entries = [
        {"rank": r, "node": r // 2, "host": f"pod-{r // 2}", "loss": loss}
        for r, loss in enumerate([2.5, math.nan, 2.4, math.inf])
    ]
    assert [e["rank"] for e in non_finite_ranks(entries)] == [1, 3]


def test_every_rank_writes_the_one_record_and_the_first_wins(tmp_path):
    ledger = FaultLedger(tmp_path)
    for rank in range(3):
        ledger.record_non_finite({**_record(4, 10.0 + rank), "writer": rank}, seen=0)
    ledger.record_non_finite(_record(9, 5.0), seen=0)
    assert [(r["step"], r.get("writer")) for r in ledger.non_finite()] == [(9, None), (4, 0)]  # oldest first
    assert ledger.fired() == []  # not a fired fault: accounting counts it apart


@pytest.fixture
def world_of_one():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


def test_stop_restarts_once_per_step_then_fails_naming_the_step_the_ranks_and_what_to_check(
    tmp_path, world_of_one, monkeypatch
):
    monkeypatch.setenv("GROUP_RANK", "3")
    for name in ("RESILIENT_FSDP_NODE", "PET_NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    ledger, logged = FaultLedger(tmp_path), []

    def log(event, message):
        logged.append((event, message))

    with pytest.raises(NonFiniteLoss, match="loss is nan at step 5, own loss non-finite on rank 0 \\(node 3"):
        stop(5, math.nan, torch.tensor(math.nan), 0, ledger, log)
    with pytest.raises(NonFiniteLoss):  # another step: its own restart
        stop(8, math.inf, torch.tensor(2.0), 0, ledger, log)
    with pytest.raises(RepeatedNonFiniteLoss) as failed:
        stop(5, math.nan, torch.tensor(math.nan), 0, ledger, log)
    message = str(failed.value)
    assert message.startswith("loss is nan at step 5 again after a restart from the last checkpoint")
    assert message.count("rank 0 (node 3, host ") == 2  # the first time and this one
    for advice in ("kubectl cordon NODE", "optim.lr", "the data"):
        assert advice in message
    assert [(e["step"], e["outcome"]) for e, _ in logged] == [(5, "restart"), (8, "restart"), (5, "failed")]
    assert "the sum across ranks overflowed" in logged[1][1]  # step 8: no rank's own loss was non-finite
    records = sorted(p.name for p in ledger.non_finite_dir.iterdir())
    assert records == ["step00000005-0.json", "step00000005-1.json", "step00000008-0.json"]
    first = json.loads((ledger.non_finite_dir / records[0]).read_text())
    assert [(r["rank"], r["node"], r["local_rank"]) for r in first["ranks"]] == [(0, 3, 0)]


@pytest.mark.parametrize("kind,poisoned", [("nan-loss", [True, False]), ("nan-loss-repeat", [True, True])])
def test_nan_loss_poisons_the_rank_loss_once_per_job_and_the_repeat_each_time(tmp_path, kind, poisoned):
    ledger, seen = FaultLedger(tmp_path), []
    for _attempt in range(2):  # the attempt the fault stops, then the one that restarts from the checkpoint
        injector = FaultInjector(parse_faults([f"{kind}@4:rank=1"]), rank=1, ledger=ledger)
        other_step, loss = torch.tensor(2.0), torch.tensor(2.0)
        injector.local_loss(3, other_step)
        injector.local_loss(4, loss)
        assert other_step.item() == 2.0
        seen.append(math.isnan(loss.item()))
    assert seen == poisoned
    assert [f["fault"] for f in ledger.fired()] == [f"{kind}@4:rank=1"]
    untouched = torch.tensor(2.0)
    FaultInjector(parse_faults([f"{kind}@4:rank=1"]), rank=0, ledger=FaultLedger(tmp_path / "other")).local_loss(
        4, untouched
    )
    assert untouched.item() == 2.0  # another rank's loss


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_nan_at_the_same_step_after_the_restart_fails_the_job_with_exit_2(tmp_path):
    """One pod of 2 ranks: the step's loss is NaN on rank 1 each time it runs; after one in-job
    restart from the last checkpoint the job fails for good, naming the step and the rank."""
    run_dir = tmp_path / "run"
    proc = run_local(
        run_dir,
        nodes=1,
        nproc=2,
        overrides=COMMON[1:] + ["train.steps=6", "checkpoint.interval_steps=2"],
        extra=["--inject=nan-loss-repeat@3:rank=1"],
        timeout=240,
    )
    out = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == exit_codes.CONFIG, out
    assert "exited with code 2: not retried" in proc.stdout, out
    assert "the error that ended it" in proc.stdout and "RepeatedNonFiniteLoss: loss is nan at step 3 again" in out
    assert proc.stdout.count("own loss non-finite on rank 1 (node 0, host ") >= 1  # the first time: restarted
    assert "restarted (in-job)" in proc.stdout
    records = FaultLedger(run_dir).non_finite()
    assert [(r["step"], r["outcome"], [x["rank"] for x in r["ranks"]]) for r in records] == [
        (3, "restart", [1]),
        (3, "failed", [1]),
    ]
    assert [r["step"] for r in read_events(run_dir, "step")] == [1, 2]  # step 3 never completed
    assert_no_leftovers(run_dir)
