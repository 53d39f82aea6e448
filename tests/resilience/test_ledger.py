"""The fault ledger: each fault fires once per job."""

from __future__ import annotations

from resilient_fsdp.config import FaultSpec
from resilient_fsdp.resilience.ledger import FaultLedger


def test_a_fault_is_claimed_once_per_job(tmp_path):
    ledger = FaultLedger(tmp_path)
    spec = FaultSpec("sigkill", 7, 1)
    assert ledger.claim(spec, {"fault": str(spec), "key": spec.key, "t_fault": 1.0, "completed_step": 6})
    assert not ledger.claim(spec, {"fault": str(spec), "key": spec.key, "t_fault": 2.0, "completed_step": 6})
    assert [f["t_fault"] for f in ledger.fired()] == [1.0]
