"""Closing this process's local runs when it exits or is signalled: at exit, and on SIGINT/SIGTERM.

Every ``PodNetwork`` registers itself here while it is open (``register``/``unregister``); at
exit, and in the handlers ``install_signal_cleanup`` sets, the open ones are closed. A network is
anything with a ``run_id`` and a ``close()``, so this module needs nothing of ``network``.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from typing import Callable, Iterable, Protocol


class Network(Protocol):
    run_id: str

    def close(self) -> None: ...


# Networks this process created and has not closed: for the signal handlers and atexit.
_OPEN: dict[int, Network] = {}
_ATEXIT = False


def register(network: Network) -> None:
    """Close ``network`` at exit and in the signal handlers, until ``unregister``."""
    global _ATEXIT
    _OPEN[id(network)] = network
    if not _ATEXIT:
        atexit.register(_close_open_networks)
        _ATEXIT = True


def unregister(network: Network) -> None:
    _OPEN.pop(id(network), None)


def _close_open_networks() -> None:
    for network in list(_OPEN.values()):
        try:
            network.close()
        except Exception as exc:  # a handler or atexit must go on to the next network
            _report(network, exc)


def _report(network: Network, exc: Exception) -> None:
    print(f"resilient-fsdp: cleaning up local pods of run {network.run_id}: {exc}", file=sys.stderr)


def install_signal_cleanup(
    networks: Iterable[Network] | None = None,
    signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM),
) -> Callable[[], None]:
    """Make SIGINT and SIGTERM close local runs first, then have their usual effect; one this
    process was started with ignored is left ignored.

    The handler ignores further signals while it closes ``networks`` (default: every network
    this process has open), restores the previous handlers and hands the signal on: a Python
    handler is called (SIGINT's default raises KeyboardInterrupt, so ``with`` blocks and
    ``finally`` still run), a default disposition is re-raised so the process dies of the signal
    (exit status -SIGTERM). Call from the main thread. Returns a function that restores the
    previous handlers.
    """
    chosen = None if networks is None else list(networks)
    # A signal this process was started with ignored (a background job of a shell ignores SIGINT)
    # stays ignored: closing the pods on it would leave the process running without them.
    previous = {sig: signal.getsignal(sig) for sig in signals if signal.getsignal(sig) != signal.SIG_IGN}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def handler(signum: int, frame) -> None:
        # Ignore a second signal while cleaning up (an impatient second Ctrl-C would otherwise
        # interrupt the cleanup it asked for), then hand this one on with the old handlers back.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        if chosen is None:
            _close_open_networks()
        else:
            for network in chosen:
                try:
                    network.close()
                except Exception as exc:
                    _report(network, exc)
        restore()
        before = previous[signum]
        if callable(before):
            before(signum, frame)
        elif before in (signal.SIG_DFL, None):
            os.kill(os.getpid(), signum)

    for sig in previous:
        signal.signal(sig, handler)
    return restore
