"""Under in-process restart the attempt's process group rendezvouses on its own connection to the
wrapper's store, never behind the wrapper's monitor thread; a real TCPStore server on loopback."""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from resilient_fsdp.resilience.inprocess import own_connection

WAIT_S = 3.0  # the monitor thread's blocking wait; long enough for a get to finish within it
ENTER_S = 0.5  # time given to the waiter thread to enter its wait


def _blocked_waiter(store: dist.Store) -> threading.Thread:
    """What NVRx's monitor thread does: a blocking wait on a key nobody sets."""

    def wait():
        try:
            store.wait(["never-set"], datetime.timedelta(seconds=WAIT_S))
        except dist.DistStoreError:
            pass  # the wait's timeout; the monitor thread loops on it

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(ENTER_S)
    return thread


def test_the_attempts_store_is_a_second_connection_that_a_monitor_wait_does_not_block():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    server.set("address-of-rank-1", "10.213.0.3:4242")
    own = own_connection(base, timeout_s=30)
    assert own is not base and own.port == base.port
    assert own_connection(base, timeout_s=30) is own  # one connection per process, kept across attempts

    waiter = _blocked_waiter(base)
    t0 = time.monotonic()
    assert own.get("address-of-rank-1") == b"10.213.0.3:4242"
    took = time.monotonic() - t0
    assert waiter.is_alive() and took < WAIT_S - ENTER_S - 1, f"the get queued behind the monitor's wait ({took:.2f} s)"
    waiter.join()

    # The premise: on the shared connection the same get queues behind the monitor's wait.
    waiter = _blocked_waiter(base)
    t0 = time.monotonic()
    assert base.get("address-of-rank-1") == b"10.213.0.3:4242"
    took = time.monotonic() - t0
    waiter.join()
    assert took > WAIT_S - ENTER_S - 1, f"a get on the monitor's connection returned during its wait ({took:.2f} s)"


def test_a_store_without_a_connection_is_used_as_it_is():
    store = dist.HashStore()
    assert own_connection(store, timeout_s=5) is store


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_rank_0(monkeypatch, port: int, host_pid: int) -> None:
    from resilient_fsdp.resilience import nvrx

    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        nvrx.HOSTING_PID_ENV: str(host_pid),
    }.items():
        monkeypatch.setenv(name, value)


def test_rank_0_hosts_the_wrappers_store_once_a_port_held_by_a_previous_rank_is_free(monkeypatch):
    """A previous generation's rank still ending holds the port a moment: rank 0 retries the bind
    and hosts, where NVRx's store would have become a client of a store nobody hosts."""
    import os
    import socket

    from resilient_fsdp.resilience import nvrx

    port = _free_port()
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("0.0.0.0", port))
    held.listen()
    threading.Timer(1.0, held.close).start()
    monkeypatch.delenv(nvrx.HOSTING_PID_ENV, raising=False)  # the factory sets it: undone after the test
    factory = nvrx.hosting_store_factory()
    _as_rank_0(monkeypatch, port, os.getpid())
    t0 = time.monotonic()
    store = factory(port=port, wait_for_workers=False)
    assert 0.9 < time.monotonic() - t0 < nvrx.STORE_HOST_RETRY_S
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"  # this process hosts it


def test_rank_0_that_cannot_host_the_wrappers_store_fails_naming_the_port(monkeypatch):
    import os
    import socket

    import pytest

    from resilient_fsdp.resilience import nvrx

    monkeypatch.setattr(nvrx, "STORE_HOST_RETRY_S", 1.0)
    port = _free_port()
    with socket.socket() as held:  # an outgoing connection's port, or a listener that stays
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("0.0.0.0", port))
        held.listen()
        monkeypatch.delenv(nvrx.HOSTING_PID_ENV, raising=False)  # the factory sets it: undone after the test
        factory = nvrx.hosting_store_factory()
        _as_rank_0(monkeypatch, port, os.getpid())
        with pytest.raises(
            nvrx.StoreHostError,
            match=rf"could not host the in-process restart store on port {port} "
            r"\(MASTER_PORT \+ resilience.in_process.store_port_offset\)",
        ):
            factory(port=port, wait_for_workers=False, timeout=datetime.timedelta(seconds=2))


def test_nvrx_s_monitor_process_stays_a_client_of_the_store_its_rank_hosts(monkeypatch):
    """The monitor process inherits the rank's environment (the hosting pid is its rank's): it
    builds the store as NVRx does, a client once hosting fails, and never raises."""
    import os

    from resilient_fsdp.resilience import nvrx

    port = _free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    host.set("from-the-rank", "1")
    monkeypatch.delenv(nvrx.HOSTING_PID_ENV, raising=False)  # the factory sets it: undone after the test
    factory = nvrx.hosting_store_factory()
    _as_rank_0(monkeypatch, port, os.getpid() + 1)  # another process's pid: not the rank's own
    monitor = factory(port=port, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    assert monitor.get("from-the-rank") == b"1"
