"""Which endings a node joins again after, and for how long."""

from __future__ import annotations

from resilient_fsdp.resilience import exit_codes
from resilient_fsdp.resilience.rejoin import Rejoin


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_joins_again_after_failures_another_node_causes_until_the_window_ends():
    clock = Clock()
    rejoin = Rejoin(store_host=False, timeout_s=600, clock=clock)
    assert "joining again" in rejoin.decide(exit_codes.RENDEZVOUS_LOST, completed_rendezvous=True)
    clock.now += 400  # the store host's pod is being replaced; attempts that never completed a round
    assert rejoin.decide(exit_codes.RENDEZVOUS_LOST, completed_rendezvous=False)
    clock.now += 201
    assert rejoin.decide(exit_codes.RENDEZVOUS_LOST, completed_rendezvous=False) is None  # 601 s: exit
    assert rejoin.count == 2


def test_a_completed_rendezvous_begins_a_new_event():
    clock = Clock()
    rejoin = Rejoin(store_host=False, timeout_s=600, clock=clock)
    for _ in range(5):  # five events, each 500 s apart: each is within its own window
        assert rejoin.decide(exit_codes.INFRASTRUCTURE, completed_rendezvous=True)
        clock.now += 500


def test_the_store_host_and_the_nodes_own_endings_exit():
    clock = Clock()
    assert Rejoin(store_host=True, timeout_s=600, clock=clock).decide(exit_codes.RENDEZVOUS_LOST, True) is None
    peer = Rejoin(store_host=False, timeout_s=600, clock=clock)
    for code in (exit_codes.SUCCESS, exit_codes.CONFIG, exit_codes.NVRX_NO_RESTART, 143, 137):
        assert peer.decide(code, True) is None, code
    assert Rejoin(store_host=False, timeout_s=0, clock=clock).decide(exit_codes.INFRASTRUCTURE, True) is None
