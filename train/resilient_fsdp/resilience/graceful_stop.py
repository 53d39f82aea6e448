"""Graceful stop: SIGTERM to a node becomes "finish the step, commit a checkpoint, exit with a
retryable code"."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Any, Optional

# Set by the node wrapper: a file that exists once the node was asked to stop (SIGTERM).
NODE_STOP_ENV = "RESILIENT_FSDP_NODE_STOP_FILE"


class StopRequested(BaseException):
    """The job was asked to stop (SIGTERM) and has committed a checkpoint.

    A BaseException so that in-process restart, which restarts on ``Exception``, lets it through.
    """

    def __init__(self, step: int, exit_code: int):
        super().__init__(f"stopped on request after step {step}, checkpoint committed")
        self.step, self.exit_code = step, exit_code


class GracefulStop:
    """SIGTERM to a node being evicted sets a flag the loop checks after each step.

    The flag is agreed across ranks with the step's loss all-reduce, so every rank stops at the
    same step and takes part in the final checkpoint. Two other SIGTERMs must still end the rank
    at once: the launcher's, when it restarts workers after a fault (their peers are gone, so a
    step could never finish), and a second one. They are told apart by the node wrapper
    (:mod:`resilient_fsdp.resilience.agent`), which marks the node as stopping before it forwards the signal.

    A rank blocked in a collective runs no Python signal handler until the collective returns,
    so the decision is made on a watcher thread woken through ``signal.set_wakeup_fd``.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._reader: Optional[socket.socket] = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._writer = writer
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._previous = signal.signal(signal.SIGTERM, lambda *_: None)  # the watcher acts
        threading.Thread(target=self._watch, name="sigterm-watcher", daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                data = self._reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self._on_sigterm()

    def _on_sigterm(self) -> None:
        rank = os.environ.get("RANK", "0")
        if self.requested or not node_is_stopping():
            # Restarting workers, or asked twice: leave now, as SIGTERM's default would.
            os._exit(128 + signal.SIGTERM)
        self.requested = True
        print(
            f"[resilient-fsdp] rank {rank}: SIGTERM received (node stopping): finishing the step, then "
            "checkpointing and exiting",
            file=sys.stderr,
            flush=True,
        )

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            signal.set_wakeup_fd(-1)
            self._previous = None


def node_is_stopping() -> bool:
    """True when the node wrapper received SIGTERM (or no wrapper runs: then every SIGTERM is
    treated as a request to stop gracefully)."""
    marker = os.environ.get(NODE_STOP_ENV)
    return marker is None or os.path.exists(marker)
