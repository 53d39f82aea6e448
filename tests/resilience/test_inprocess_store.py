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
