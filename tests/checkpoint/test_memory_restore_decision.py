"""Which rank keeps which replica (``checkpoint.memory.peers``) and the one restore decision every
rank reaches from every rank's report (``checkpoint.memory.agreement``), without processes."""

from __future__ import annotations

import pytest

from resilient_fsdp.checkpoint.memory.agreement import Report, decide
from resilient_fsdp.checkpoint.memory.peers import replica_holder, replica_source


@pytest.mark.parametrize("world, per_pod", [(8, 2), (6, 2), (63 * 8, 8), (4, 1), (3, 1)])
def test_a_replica_is_never_on_its_ranks_pod_and_each_rank_keeps_exactly_one(world, per_pod):
    holders = [replica_holder(r, world, per_pod) for r in range(world)]
    assert all(h // per_pod != r // per_pod for r, h in enumerate(holders))
    assert sorted(holders) == list(range(world))  # a permutation: one replica kept per rank
    assert all(replica_source(h, world, per_pod) == r for r, h in enumerate(holders))


def test_one_pod_has_no_replica_and_a_world_of_partial_pods_is_refused():
    assert replica_holder(0, 4, 4) is None and replica_source(3, 4, 4) is None
    with pytest.raises(ValueError, match="not whole pods of 4 ranks"):
        replica_holder(0, 6, 4)


def ring(world, per_pod, own_steps, lost_pods=()):
    """Reports of a world whose ranks all saved ``own_steps`` and sent replicas round the ring;
    the ranks of ``lost_pods`` come back empty (new pods)."""
    reports = []
    for r in range(world):
        if r // per_pod in lost_pods:
            reports.append(Report(r))
            continue
        source = replica_source(r, world, per_pod)
        kept = {} if source is None else {source: tuple(own_steps)}
        reports.append(Report(r, tuple(own_steps), kept))
    return reports


def test_every_rank_restores_its_own_newest_snapshot_when_it_is_at_least_the_durable_one():
    decision = decide(ring(8, 2, (10, 12)), 8, durable_step=10)
    assert decision.step == 12 and set(decision.sources.values()) == {None} and not decision.replicas_to_send()
    assert decide(ring(8, 2, (10, 12)), 8, durable_step=12).step == 12  # the same state, from memory


def test_a_lost_pod_restores_from_the_replicas_the_next_pod_keeps():
    decision = decide(ring(8, 2, (10, 12), lost_pods=(1,)), 8, durable_step=8)
    assert decision.step == 12
    assert decision.sources == {0: None, 1: None, 2: 4, 3: 5, 4: None, 5: None, 6: None, 7: None}
    assert decision.replicas_to_send() == [(4, 2), (5, 3)]
    assert "2 rank(s) from the replica a peer keeps" in decision.why


def test_two_neighbouring_lost_pods_or_a_newer_durable_commit_go_to_the_durable_checkpoint():
    both = decide(ring(8, 2, (10, 12), lost_pods=(1, 2)), 8, durable_step=8)
    assert both.step is None and "not for rank(s) 2, 3" in both.why
    newer = decide(ring(8, 2, (10, 12)), 8, durable_step=20)
    assert newer.step is None and "older than the durable checkpoint's (20)" in newer.why
    nothing = decide([Report(r) for r in range(4)], 4, durable_step=None)
    assert nothing.step is None and nothing.why == "no memory checkpoint on any rank"


def test_the_newest_step_every_rank_can_get_wins_over_a_newer_one_some_lack():
    reports = ring(4, 1, (10, 12))
    reports[3] = Report(3, (10,), reports[3].replicas)  # rank 3's save of 12 was cut off
    reports[0] = Report(0, (10, 12), {3: (10,)})  # and rank 0 keeps only its 10
    decision = decide(reports, 4, durable_step=None)
    assert decision.step == 10 and set(decision.sources.values()) == {None}


def test_a_missing_report_means_no_memory_restore():
    decision = decide(ring(4, 1, (10,))[:3], 4, durable_step=None)
    assert decision.step is None and "no memory report from rank(s) 3" in decision.why


def test_the_decision_is_the_same_whatever_order_the_reports_arrive_in():
    reports = ring(8, 2, (10, 12), lost_pods=(3,))
    assert decide(reports, 8, 8) == decide(list(reversed(reports)), 8, 8)
