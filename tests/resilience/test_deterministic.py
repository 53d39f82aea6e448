"""The deterministic-failure rule (resilience/deterministic.py): the same failure at the same place
after a restart that replayed it is retried by no layer; communication and storage failures keep
every retry. The rule's parts on their own, then real jobs: a user's model whose ``forward``
always raises, under in-job restart across two pods and under in-process restart."""

from __future__ import annotations

import errno
import json
import re
import time

import pytest
import torch.distributed as dist

from resilient_fsdp.resilience import deterministic, exit_codes
from resilient_fsdp.resilience.deterministic import (
    FailureRecords,
    RepeatedFailure,
    earlier,
    judge,
    normalised,
    signature,
    transient_reason,
)
from resilient_fsdp.resilience.non_finite import RepeatedNonFiniteLoss
from tests.resilience.node import attempts
from tests.support import assert_no_leftovers, netns_required, run_local, write_module

# ---- the rule's parts ----------------------------------------------------------------------------


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - a traceback to read
        return caught


def test_numbers_and_addresses_are_one_token_so_ranks_and_attempts_read_alike():
    a = normalised("rank 3: got 4096 positions at 0x7f3a2c, loss 1.5e-3, -2 left")
    b = normalised("rank 12: got 64 positions at 0xdeadbeef, loss 7.25, 3 left")
    assert a == b == "rank N: got N positions at N, loss N, N left"


def test_the_frame_is_the_innermost_outside_torch():
    import torch

    def forward():
        return torch.ones(2, 3) @ torch.ones(2, 3)  # raises inside torch

    exc = _raised_from(forward)
    sig = signature(exc)
    assert sig.type == "builtins.RuntimeError"
    assert re.fullmatch(r"tests/resilience/test_deterministic\.py:\d+ in forward", sig.frame), sig.frame
    assert "N" in sig.message and len(sig.digest) == 16


def _raised_from(fn) -> BaseException:
    try:
        fn()
    except BaseException as caught:  # noqa: BLE001
        return caught
    raise AssertionError("did not raise")


@pytest.mark.parametrize(
    "exc,transient",
    [
        (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:1234"), True),
        (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"), True),
        (dist.DistBackendError("NCCL communicator was aborted"), True),
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), True),
        (TimeoutError("timed out"), True),
        (OSError(errno.EIO, "Input/output error"), True),
        (OSError(errno.ESTALE, "Stale file handle"), True),
        (ValueError("sequence of 4096 tokens; this model handles up to 2048"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x64 and 32x64)"), False),
        (OSError(errno.ENOENT, "No such file or directory"), False),
        (KeyError("tok_embeddings.weight"), False),
    ],
)
def test_communication_and_storage_failures_keep_their_retries(exc, transient):
    assert (transient_reason(exc) is not None) == transient


def test_a_failure_caused_by_a_lost_connection_keeps_its_retries():
    botocore = pytest.importorskip("botocore.exceptions")
    try:
        try:
            raise botocore.EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
        except Exception as cause:
            raise RuntimeError("restore from S3 failed") from cause
    except RuntimeError as exc:
        assert transient_reason(exc) is not None


def test_only_another_attempts_record_at_the_same_place_counts_and_a_failed_one_starts_afresh():
    def rec(attempt, where="step 3", digest="d", outcome="restart"):
        return {"attempt": attempt, "where": where, "digest": digest, "outcome": outcome}

    records = [rec("a1"), rec("a1", where="step 4"), rec("a2", digest="other")]
    assert earlier(records, "step 3", "d", "a3") == [records[0]]
    assert earlier(records, "step 3", "d", "a1") == []  # its own ranks' records
    assert earlier(records, "step 5", "d", "a3") == []
    # The job failed on it (attempt a3); a job started again after that begins a new count...
    records.append(rec("a3", outcome="failed"))
    assert earlier(records, "step 3", "d", "a4") == []
    # ...but the other ranks of a3 still see a1's record, not a new count.
    assert earlier(records, "step 3", "d", "a3") == [records[0]]


def test_the_second_attempt_at_the_same_place_raises_a_configuration_failure(tmp_path):
    records = FailureRecords(tmp_path)
    exc = _raised(ValueError("sequence of 4096 tokens; this model handles up to 2048"))
    said = judge(exc, "step 1", "attempt-1", records, {"rank": 2, "node": 1, "layer": "start"})
    assert said and "ended this attempt at step 1" in said and "same failure there again ends the job" in said
    # Another rank of the same attempt: the record is kept once, and nothing more is said.
    assert judge(exc, "step 1", "attempt-1", records, {"rank": 0, "node": 0, "layer": "start"}) is None
    # Another place: its own first time.
    assert judge(exc, "step 2", "attempt-1", records, {"rank": 0, "node": 0, "layer": "start"})
    with pytest.raises(RepeatedFailure) as repeated:
        judge(
            _raised(ValueError("sequence of 4096 tokens; this model handles up to 2048")),
            "step 1",
            "attempt-2",
            records,
            {"rank": 0, "node": 0, "layer": "in_job"},
        )
    message = str(repeated.value)
    assert "the same failure at step 1 after a restart" in message and "ValueError: sequence of 4096" in message
    assert "It first ended attempt attempt-1 on rank 2 (node 1" in message
    assert exit_codes.is_configuration_failure(repeated.value)
    assert isinstance(repeated.value.__cause__, ValueError)
    kept = records.read()
    assert [(r["where"], r["attempt"], r["outcome"]) for r in kept] == [
        ("step 1", "attempt-1", "restart"),
        ("step 2", "attempt-1", "restart"),
        ("step 1", "attempt-2", "failed"),
    ]
    assert "Traceback" in kept[0]["traceback"] and kept[0]["rank"] == 2


def test_a_transient_failure_is_not_recorded_and_stays_retried(tmp_path):
    records = FailureRecords(tmp_path)
    gloo = _raised(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:1234"))
    for attempt in ("a1", "a2", "a3"):
        assert judge(gloo, "step 1", attempt, records, {"rank": 0}) is None
    assert records.read() == []


def test_a_repeated_non_finite_loss_is_a_case_of_the_rule():
    assert issubclass(RepeatedNonFiniteLoss, RepeatedFailure)
    assert exit_codes.is_configuration_failure(RepeatedNonFiniteLoss("loss is nan at step 3 again"))


# ---- real jobs ------------------------------------------------------------------------------------

# A user's model whose forward refuses every batch: a deterministic bug, at step 1 on every rank.
RAISING_MODEL = """
    from resilient_fsdp.train.model import build_model

    def build(cfg):
        model = build_model("tiny")

        def forward(tokens):
            raise ValueError(f"sequence of {tokens.shape[1]} tokens; this model handles up to 16")

        model.forward = forward
        return model
"""


@pytest.mark.timeout(300)
def test_a_forward_that_always_raises_ends_a_two_pod_job_after_one_restart(tmp_path, plugin_dir):
    """2 pods x 2 ranks (network namespaces), every layer with restarts left: the first failure is
    recorded and restarted in-job; the same failure at step 1 again ends the job with exit 2, the
    model's error, the step and the traceback in the log, and no pod recreated."""
    netns_required()
    write_module(plugin_dir, "raising_model", RAISING_MODEL)
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = run_local(
        run_dir,
        nodes=2,
        nproc=2,
        pythonpath=[plugin_dir],
        timeout=240,
        overrides=["model.factory=raising_model:build", "resilience.launcher.max_restarts=3"],
    )
    seconds = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == exit_codes.CONFIG, out[-5000:]
    assert "exited with code 2: not retried" in proc.stdout and "recreating" not in proc.stdout, out[-4000:]
    assert "ValueError: sequence of 64 tokens; this model handles up to 16" in proc.stdout
    assert "the same failure at step 1 after a restart that replayed it" in proc.stdout
    assert "the repeated failure's traceback" in proc.stdout and "raising_model.py" in proc.stdout
    for node in ("node0", "node1"):  # at most one restart on every node
        assert attempts(run_dir / "logs" / node) in (["attempt_0"], ["attempt_0", "attempt_1"]), node
    kept = FailureRecords(run_dir).read()
    assert {r["type"] for r in kept} == {"builtins.ValueError"}, kept  # the peers' gloo errors are not judged
    assert [r["outcome"] for r in kept] == ["restart", "failed"] and len({r["digest"] for r in kept}) == 1
    assert {r["where"] for r in kept} == {"step 1"}
    print(f"a forward that always raises: exit 2 after {seconds:.1f} s")
    assert_no_leftovers(run_dir)


# Extended tier: in CI the rule ends the 2-pod job above, and a configuration-type failure passing
# through in-process restart on 0.7 is test_exit_codes.py's (in-process-nvrx07).
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_under_in_process_restart_the_same_failure_ends_after_one_in_process_restart(tmp_path, nvrx07_lane):
    """One pod of 2 ranks, in-process restart on (NVRx 0.7): ``exception-repeat`` raises on rank 1
    at step 3 each time it runs; the in-process restart replays step 3 from the checkpoint of step
    2, meets it again, and the job ends with exit 2 without an in-job restart."""
    from tests.resilience.test_exit_codes import IN_PROCESS, RUN

    run_dir = tmp_path / "run"
    proc = run_local(
        run_dir,
        nodes=1,
        nproc=2,
        pythonpath=[nvrx07_lane],
        timeout=240,
        overrides=RUN + IN_PROCESS + ["resilience.launcher.max_restarts=3"],
        extra=["--inject=exception-repeat@3:rank=1"],
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == exit_codes.CONFIG, out[-5000:]
    assert "restarted (in-process)" in proc.stdout, out[-4000:]
    assert "the same failure at step 3 after a restart that replayed it" in proc.stdout
    assert attempts(run_dir / "logs" / "node0") == ["attempt_0"], out[-3000:]  # no in-job restart
    kept = FailureRecords(run_dir).read()
    assert [(r["where"], r["rank"], r["outcome"]) for r in kept] == [("step 3", 1, "restart"), ("step 3", 1, "failed")]
    assert [r["layer"] for r in kept] == ["start", "in_process"]
    assert (
        json.loads((run_dir / "faults" / "exception-repeat@3-rank1.json").read_text())["fault"]
        == "exception-repeat@3:rank=1"
    )
    assert_no_leftovers(run_dir)


def test_the_records_live_beside_the_fault_ledger(tmp_path):
    assert FailureRecords(tmp_path).dir == tmp_path / "faults" / deterministic.RECORDS


def test_a_thousand_ranks_failing_alike_keep_one_record_and_a_torn_one_is_passed_over(tmp_path):
    """1,000 ranks of one attempt meet the same bug: one file (the first rank's), said once; a
    record torn by a crash mid-write (a rank killed halfway through writing it) judges nothing."""
    records = FailureRecords(tmp_path)
    records.dir.mkdir(parents=True)
    (records.dir / "0123456789abcdef-step-1-torn-restart.json").write_text('{"where": "step 1", "dig')
    exc = _raised(ValueError("sequence of 4096 tokens; this model handles up to 2048"))
    said = [judge(exc, "step 1", "a1", records, {"rank": r, "node": r // 8}) for r in range(1000)]
    assert sum(1 for s in said if s) == 1
    assert len(list(records.dir.glob("*.json"))) == 2 and len(records.read()) == 1
    with pytest.raises(RepeatedFailure, match="on rank 0 "):
        judge(exc, "step 1", "a2", records, {"rank": 999, "node": 124})
