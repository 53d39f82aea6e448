"""Which endings a node joins again after, for how long, and when its next launcher starts."""

from __future__ import annotations

import socket
import threading
import time

from resilient_fsdp.resilience import exit_codes
from resilient_fsdp.resilience.rejoin import (
    GONE_LIMIT_S,
    PROBE_INTERVAL_S,
    UP_LIMIT_S,
    Rejoin,
    await_first_store,
    await_store,
    store_listens,
)


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
    assert rejoin.count == 2 and rejoin.remaining_s() == 0


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


class FakeStore:
    """Answers a probe from a script of states, one per probe; the clock moves with each sleep."""

    def __init__(self, states: list[bool], clock: Clock):
        self.states, self.clock, self.probes = list(states), clock, 0

    def probe(self, host: str, port: int) -> bool:
        assert (host, port) == ("pod-0.job", 29400)
        self.probes += 1
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def sleep(self, seconds: float) -> None:
        self.clock.now += seconds


def test_the_next_launcher_waits_for_the_old_store_to_close_and_the_new_one_to_listen():
    clock = Clock()
    store = FakeStore([True, True, True, False, False, False, True], clock)
    said = await_store(("pod-0.job", 29400), probe=store.probe, clock=clock, sleep=store.sleep)
    assert store.probes == 7  # three while the old store lingers, three while none listens, one that finds it
    assert "the old store at pod-0.job:29400 closed after" in said and "a store listened after" in said
    assert clock.now - 1000.0 < 6 * PROBE_INTERVAL_S * 1.5 + 1e-9  # no fixed pause on top of the probes


def test_a_store_that_never_closes_or_never_returns_bounds_the_wait():
    clock = Clock()
    lingering = FakeStore([True], clock)
    said = await_store(("pod-0.job", 29400), probe=lingering.probe, clock=clock, sleep=lingering.sleep)
    assert f"still answered after {GONE_LIMIT_S:g} s" in said  # then it is taken as the new one
    assert GONE_LIMIT_S <= clock.now - 1000.0 < GONE_LIMIT_S + 1
    clock = Clock()
    gone = FakeStore([False], clock)
    said = await_store(("pod-0.job", 29400), probe=gone.probe, clock=clock, sleep=gone.sleep)
    assert f"none listened within {UP_LIMIT_S:g} s; starting anyway" in said
    assert UP_LIMIT_S <= clock.now - 1000.0 < UP_LIMIT_S + 1
    clock = Clock()  # what is left of the rejoin window bounds it too
    said = await_store(
        ("pod-0.job", 29400), window_s=3, probe=gone.probe, clock=clock, sleep=FakeStore([False], clock).sleep
    )
    assert "none listened within 3 s" in said and 3 <= clock.now - 1000.0 < 4


def test_a_signal_ends_the_wait_and_no_endpoint_waits_the_fixed_time():
    clock = Clock()
    gone = FakeStore([False], clock)
    said = await_store(
        ("pod-0.job", 29400), stopped=lambda: clock.now > 1002, probe=gone.probe, clock=clock, sleep=gone.sleep
    )
    assert said.startswith("stopped while waiting") and clock.now < 1003
    clock = Clock()
    said = await_store(None, clock=clock, sleep=FakeStore([False], clock).sleep)
    assert said.startswith("no --rdzv-endpoint") and GONE_LIMIT_S <= clock.now - 1000.0 < GONE_LIMIT_S + 1


def test_a_real_store_port_closing_and_reopening_releases_the_wait():
    """A real listening socket on loopback: the wait ends only once the port listens again."""
    old = socket.create_server(("127.0.0.1", 0))
    port = old.getsockname()[1]
    events: list[str] = []
    waiter = threading.Thread(target=lambda: events.append(await_store(("127.0.0.1", port))))
    waiter.start()
    time.sleep(0.5)
    assert not events  # the old store still listens
    old.close()
    time.sleep(0.5)
    assert not events  # closed, nothing listens yet
    events.append("reopened")
    new = socket.create_server(("127.0.0.1", port))
    waiter.join(timeout=10)
    new.close()
    assert events[0] == "reopened" and "closed after" in events[1] and "a store listened after" in events[1]
    assert not store_listens("127.0.0.1", port)


def test_a_first_launcher_waits_for_a_store_that_listens_late_and_gives_up_at_the_connect_wait():
    """A node that is not the store host starts before pod 0: its first launcher waits for a real
    socket to listen (so that read_timeout can stay an operation's timeout), bounded."""
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    said: list = []
    waiter = threading.Thread(target=lambda: said.append(await_first_store(("127.0.0.1", port), 30)))
    waiter.start()
    time.sleep(1.5)
    assert not said  # nothing listens yet
    store = socket.create_server(("127.0.0.1", port))
    waiter.join(timeout=10)
    store.close()
    assert said and said[0].startswith(f"the store at 127.0.0.1:{port} listens (waited ")
    t0 = time.monotonic()
    assert "within 1 s; starting the launcher anyway" in await_first_store(("127.0.0.1", port), 1)
    assert 1 <= time.monotonic() - t0 < 5
    assert await_first_store(None, 30) is None and await_first_store(("127.0.0.1", port), 0) is None


def test_the_store_watch_gives_up_a_store_that_accepts_nothing_for_its_limit_and_not_one_that_answers():
    """Real sockets on loopback: a store that listens is never given up; once it stops accepting
    connections, the watch says so after its limit, and only then."""
    from resilient_fsdp.resilience.store_watch import StoreWatch

    store = socket.create_server(("127.0.0.1", 0))
    port = store.getsockname()[1]
    watch = StoreWatch(("127.0.0.1", port), limit_s=1.0, interval_s=0.1)
    said: list[str] = []
    watch.on_lost = said.append
    watch.start()
    time.sleep(2.0)
    assert watch.lost is None and not said  # it answers: more than the limit passed, nothing given up
    store.close()
    t0 = time.monotonic()
    watch.join(timeout=10)
    assert 0.9 <= time.monotonic() - t0 < 5
    assert said == [watch.lost] and f"store at 127.0.0.1:{port} accepted no connection for 1 s" in watch.lost
    quiet = StoreWatch(("127.0.0.1", port), limit_s=0.5, interval_s=0.1)
    quiet.start()
    quiet.stop()  # stopped (the launcher ended first): never reports
    quiet.join(timeout=5)
    assert quiet.lost is None
