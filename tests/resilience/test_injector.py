"""Fault injection without a job: which rank fires a fault, node faults the cluster carries
out, and writer faults handed to the checkpoint writer."""

from __future__ import annotations

import json

import pytest

from resilient_fsdp.config import ConfigError, parse_fault, parse_faults
from resilient_fsdp.resilience.accounting import record_recoveries, summarize
from resilient_fsdp.resilience.faults import NODE_INDEX_ENV, REQUESTS_ENV, FaultInjector
from resilient_fsdp.resilience.ledger import FaultLedger


def test_node_targets_fire_on_the_nodes_local_rank_zero(tmp_path, monkeypatch):
    specs = parse_faults(["sigterm@3:node=1", "sigkill@4:rank=0", "exception@5:node=0"])
    monkeypatch.setenv(NODE_INDEX_ENV, "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert [s.kind for s in FaultInjector(specs, rank=2, ledger=FaultLedger(tmp_path)).mine] == ["sigterm"]
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert FaultInjector(specs, rank=3, ledger=FaultLedger(tmp_path)).mine == []
    monkeypatch.setenv(NODE_INDEX_ENV, "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert [s.kind for s in FaultInjector(specs, rank=0, ledger=FaultLedger(tmp_path)).mine] == ["sigkill", "exception"]


def test_a_partition_is_refused_where_nothing_can_execute_it(tmp_path, monkeypatch):
    monkeypatch.delenv(REQUESTS_ENV, raising=False)
    with pytest.raises(
        ConfigError,
        match=r"'partition@9:node=0:for=5': a partition takes a pod's network link "
        r"down.*RESILIENT_FSDP_FAULT_REQUESTS",
    ):
        FaultInjector(parse_faults(["partition@9:node=0:for=5"]), rank=0, ledger=FaultLedger(tmp_path))
    monkeypatch.setenv(REQUESTS_ENV, str(tmp_path / "requests"))
    FaultInjector(parse_faults(["partition@9:node=0:for=5"]), rank=0, ledger=FaultLedger(tmp_path))


def test_a_partition_request_is_written_atomically_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv(REQUESTS_ENV, str(tmp_path / "requests"))
    monkeypatch.setenv(NODE_INDEX_ENV, "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    ledger = FaultLedger(tmp_path)
    injector = FaultInjector(parse_faults(["partition@9:node=1:for=5"]), rank=2, ledger=ledger)
    injector.at_step_start(9, 8)  # returns: the cluster cuts the link, the rank does not stop
    request = json.loads((tmp_path / "requests" / "partition-step9-node1.json").read_text())
    assert request.pop("time") > 0
    assert request == {"kind": "partition", "node": 1, "step": 9, "for_s": 5.0, "rank": 2}
    assert [p.name for p in (tmp_path / "requests").iterdir()] == ["partition-step9-node1.json"]
    (fired,) = ledger.fired()
    assert fired["fault"] == "partition@9:node=1:for=5" and fired["request"].endswith("partition-step9-node1.json")
    injector.at_step_start(9, 8)  # once per job
    assert len(ledger.fired()) == 1
    # Still training after its 5 s: it healed (or nothing cut the link), so the next restart
    # is not its recovery, and the summary lists it as unrecovered.
    injector.partitions = [(spec, t - 10) for spec, t in injector.partitions]
    injector.at_step_start(12, 11)
    assert ledger.went_on()["partition@9-node1"]["step"] == 11
    assert record_recoveries(ledger, "in_job", resumed_step=8, now=fired["t_fault"] + 30) == []
    (unrecovered,) = summarize(tmp_path / "metrics.jsonl", ledger)["unrecovered"]
    assert unrecovered["fault"] == "partition@9:node=1:for=5" and "training went on (step 11" in unrecovered["why"]


def test_a_writer_fault_is_claimed_once_and_handed_to_the_checkpoint_writer(tmp_path):
    ledger = FaultLedger(tmp_path)
    injector = FaultInjector(
        parse_faults(["writer-slow@4:rank=1:for=2.5", "writer-hang@8:rank=1", "writer-exit@8"]), rank=1, ledger=ledger
    )
    assert injector.writer_fault(3) is None
    assert injector.writer_fault(4) == "slow=2.5"
    assert injector.writer_fault(4) is None  # once per job: the save after a restart writes normally
    assert injector.writer_fault(8) == "hang"  # writer-exit@8 is rank 0's
    assert [f["fault"] for f in ledger.fired()] == ["writer-slow@4:rank=1:for=2.5", "writer-hang@8:rank=1"]
    with pytest.raises(ConfigError, match="writer-slow needs :for=SECONDS"):
        parse_fault("writer-slow@4")
