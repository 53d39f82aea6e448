"""Each rank's newest memory snapshot, kept also by a rank on another pod (``checkpoint.memory.replicas: 1``).

Rank ``r`` sends to ``peers.replica_holder(r)`` and keeps the replica of ``peers.replica_source(r)``
(:class:`Replicator`), over a gloo group of its own (CPU, never NCCL, never the training thread).
At a start, :func:`exchange` moves the replicas the restore decision asks for (a replacement
pod's ranks have none of their own) into the ranks' own slots, before every rank loads its own.
Used by :mod:`.tier`.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...resilience import nvrx
from ..group import lazy_gloo_group
from .agreement import Decision
from .slots import MemorySlots, Record, owner_name

# Message tags: the replication stream's, and the start's exchange (its own, so a receiver thread
# already listening to the same peer never takes an exchange's message).
STREAM = (1, 2)
EXCHANGE = (3, 4)
CONNECT = 5  # the start's handshake with the holder and the source


class Replicator:
    """Rank ``rank``'s sender to ``holder`` and receiver from ``source`` (either None with one pod):
    two helper threads. The sender takes the newest committed snapshot each time it is free (one
    overtaken before it left is skipped, and said), so replication never holds up the memory saves
    and never grows a backlog. The receiver writes into the replica slot not holding the newest
    replica (``replica-of-<source>``, two alternating slots) and writes its record by rename once
    every byte is in: a record, then the bytes, each message a length first (zero: the sender closed)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        own: MemorySlots,
        replica: Optional[MemorySlots],
        rank: int,
        holder: Optional[int],
        source: Optional[int],
        say: Callable[[str], None],
    ):
        self.group, self.own, self.replica = group, own, replica
        self.rank, self.holder, self.source, self.say = rank, holder, source, say
        self._newest: Optional[Record] = None
        self._cv = threading.Condition()
        self._closed = False
        self._aborted = False  # closed by a failed attempt: nothing more goes out, not even goodbye
        # Held while a helper thread posts a message, and by the abort while it sets ``_aborted``:
        # every message is posted before the abort shuts the connections down (which wakes its
        # wait) or never. gloo never completes a message posted on a connection already shut down.
        self._posting = threading.Lock()
        self.sent: list[int] = []
        self.skipped: list[int] = []
        self.received: list[int] = []
        self.errors: list[str] = []
        # Per replica sent: its step, bytes and the seconds its send took (the replica's time).
        self.timings: list[dict] = []
        # Called by the sender between a replica's record and its bytes, with its step (fault injection).
        self.before_bytes: Optional[Callable[[int], None]] = None
        self._threads = []
        connect(group, holder, source)
        nvrx.before_abort(self.stop_for_abort)
        if holder is not None:
            self._threads.append(threading.Thread(target=self._send_loop, name="memory-replica-send", daemon=True))
        if source is not None and replica is not None:
            self._threads.append(
                threading.Thread(target=self._receive_loop, name="memory-replica-receive", daemon=True)
            )
        for t in self._threads:
            t.start()

    def committed(self, record: Record) -> None:
        """A memory snapshot of this rank was committed: the next one to send."""
        with self._cv:
            if self._newest is not None and record.step > self._newest.step:
                self.skipped.append(self._newest.step)
                self.say(
                    f"rank {self.rank}: memory checkpoint of step {self._newest.step} not replicated: its "
                    f"replica was still on its way when step {record.step} was taken"
                )
            self._newest = record
            self._cv.notify()

    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while self._newest is None and not self._closed:
                    self._cv.wait()
                record, self._newest = self._newest, None
                if self._aborted:  # the peer's attempt is failing too: a send would wait on it
                    return
                if record is None:  # closed, nothing left
                    break
            try:
                t0 = time.perf_counter()
                _send(self.group, self.holder, record, self.own, between=self.before_bytes, post=self._post)
                self.timings.append({"step": record.step, "bytes": record.nbytes, "send_s": time.perf_counter() - t0})
                self.sent.append(record.step)
            except Exception as exc:  # noqa: BLE001 - a dead peer; the restore falls back without it
                if not self._closed:
                    self._stopped(f"sending step {record.step} to rank {self.holder}: {type(exc).__name__}: {exc}")
                return
        try:
            _send_goodbye(self.group, self.holder, post=self._post)
        except Exception:  # noqa: BLE001 - the receiver may be gone already
            pass

    def _receive_loop(self) -> None:
        while True:
            try:
                if not _receive(self.group, self.source, self.replica, post=self._post):
                    return
            except Exception as exc:  # noqa: BLE001 - the source's pod is gone; its replicas stay
                if not self._closed:
                    self._stopped(f"receiving from rank {self.source}: {type(exc).__name__}: {exc}")
                return
            newest = self.replica.newest()
            if newest is not None:
                self.received.append(newest.step)

    def _post(self, message: Callable[[], dist.Work]) -> dist.Work:
        """Post ``message`` (an ``isend`` or ``irecv``) unless the attempt is being aborted."""
        with self._posting:
            if self._aborted:
                raise Aborted("the attempt is being aborted")
            return message()

    def stop_for_abort(self) -> None:
        """The attempt is being aborted (called by the abort before it shuts the connections
        down): nothing more is posted."""
        locked = self._posting.acquire(timeout=1.0)  # a post never blocks long: pairs are connected
        try:
            with self._cv:
                self._aborted = self._closed = True
                self._cv.notify()
        finally:
            if locked:
                self._posting.release()

    def _stopped(self, error: str) -> None:
        """A helper thread stopped on ``error``: recorded for the training thread, which says it
        at its next step (:meth:`.MemoryTier.poll`: a ``memory_replica`` record with the error)
        and votes it; an attempt that is ending (its peer's failure is this one's) never reaches
        that step, so the restart that follows says nothing of it."""
        self.errors.append(error)

    @property
    def healthy(self) -> bool:
        """Both helper threads are still replicating."""
        return not self.errors

    def wait_sent(self, step: int, timeout_s: float) -> bool:
        """Wait until the snapshot of ``step`` has been sent, skipped or cannot be (a dead peer);
        whether it was sent."""
        deadline = time.monotonic() + timeout_s
        while step not in self.sent and step not in self.skipped and not self.errors and time.monotonic() < deadline:
            time.sleep(0.02)
        return step in self.sent

    def close(self, timeout_s: float = 30.0, wait: bool = True) -> None:
        """Send what is queued, say goodbye, and stop (the receiver when its source says goodbye).

        ``wait=False`` (a failed attempt) sends nothing more, returns at once and leaves the daemon
        threads to the attempt's abort, which joins them once it has shut their connections down
        (:func:`...resilience.nvrx.leave_to_abort`), or to the process's exit: the receiver would
        wait for its source's goodbye, and that source, on another pod, goes on training until
        this rank's exit tells the launchers of the failure, so waiting would hold the restart for
        ``timeout_s``; a goodbye or a queued replica sent then would wait on a peer whose attempt
        is failing too. A replica cut off halfway is never recorded (its record is written once
        every byte is in)."""
        if not wait:
            self.stop_for_abort()
            nvrx.leave_to_abort(self._threads)
            return
        nvrx.forget_before_abort(self.stop_for_abort)
        with self._cv:
            self._closed = True
            self._cv.notify()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


def pairs_group() -> dist.ProcessGroup:
    """Collective: the gloo group replicas travel over, connected lazily
    (:func:`..group.lazy_gloo_group`): a rank talks to its holder and its source alone (and, at a
    start, the pairs an exchange moves)."""
    return lazy_gloo_group()


def connect(group: dist.ProcessGroup, holder: Optional[int], source: Optional[int]) -> None:
    """Collective over the ranks with replicas: connect this rank's pairs with its holder and its
    source (one small message each way) before any helper thread sends. A lazily connected pair
    would otherwise connect on the attempt's first replica, in the sender thread; a peer whose
    attempt fails meanwhile never accepts, and that connect waits out the group's timeout, where
    an established connection is shut down by the abort and wakes its thread at once."""
    pending = []
    if holder is not None:
        pending.append(dist.isend(torch.zeros(1, dtype=torch.int64), dst=holder, group=group, tag=CONNECT))
    if source is not None:
        pending.append(dist.irecv(torch.zeros(1, dtype=torch.int64), src=source, group=group, tag=CONNECT))
    for work in pending:
        work.wait()


class Aborted(RuntimeError):
    """A helper thread's message was not posted: its attempt is being aborted."""


def _posted(message: Callable[[], dist.Work]) -> dist.Work:
    return message()


def _send_lengths(group: dist.ProcessGroup, dst: int, header: int, extra: int, tags=STREAM, post=_posted) -> None:
    lengths = torch.tensor([header, extra], dtype=torch.int64)
    post(lambda: dist.isend(lengths, dst=dst, group=group, tag=tags[0])).wait()


def _send_goodbye(group: dist.ProcessGroup, dst: int, post=_posted) -> None:
    _send_lengths(group, dst, 0, 0, post=post)


def _send(
    group: dist.ProcessGroup,
    dst: int,
    record: Record,
    slots: MemorySlots,
    tags=STREAM,
    between: Optional[Callable[[int], None]] = None,
    post=_posted,
) -> None:
    """``record``'s slot to rank ``dst``: the lengths, the record and its extra bytes, the tensor
    bytes; ``between(step)`` is called before the tensor bytes. ``post`` posts each message."""
    extra = slots.extra(record)
    header = json.dumps(record.to_json()).encode()
    _send_lengths(group, dst, len(header), len(extra), tags, post)
    payload = torch.frombuffer(bytearray(header + extra), dtype=torch.uint8)
    post(lambda: dist.isend(payload, dst=dst, group=group, tag=tags[0])).wait()
    if between is not None:
        between(record.step)
    raw = slots.raw(record)
    post(lambda: dist.isend(raw, dst=dst, group=group, tag=tags[1])).wait()


def _receive(group: dist.ProcessGroup, src: int, into: MemorySlots, tags=STREAM, post=_posted) -> bool:
    """The next slot rank ``src`` sends, into ``into``'s next slot; False when it said goodbye.
    ``post`` posts each message."""
    lengths = torch.zeros(2, dtype=torch.int64)
    post(lambda: dist.irecv(lengths, src=src, group=group, tag=tags[0])).wait()
    header_len, extra_len = (int(n) for n in lengths.tolist())
    if header_len == 0:
        return False
    payload = torch.empty(header_len + extra_len, dtype=torch.uint8)
    post(lambda: dist.irecv(payload, src=src, group=group, tag=tags[0])).wait()
    raw = payload.numpy().tobytes()
    record = Record.from_json(json.loads(raw[:header_len]))
    slot = into.next_slot()
    into_raw = into.open_raw(slot, record.nbytes)
    post(lambda: dist.irecv(into_raw, src=src, group=group, tag=tags[1])).wait()
    into.commit_raw(slot, record, raw[header_len:])
    return True


def exchange(
    group: dist.ProcessGroup, decision: Decision, rank: int, own: MemorySlots, replicas: Callable[[int], MemorySlots]
) -> Optional[str]:
    """Collective over ``group``: every (holder, rank) pair of ``decision`` moves the holder's
    replica of ``rank`` at the decided step into ``rank``'s own next slot; this rank's error, or None.
    ``replicas(source)``: this rank's replica slots of ``source``."""
    error = None
    for holder, target in decision.replicas_to_send():
        try:
            if rank == holder:
                kept = replicas(target)
                record = next(r for r in kept.records() if r.step == decision.step)
                _send(group, target, record, kept, EXCHANGE)
            elif rank == target:
                _receive(group, holder, own, EXCHANGE)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it in the load's agreement
            error = f"moving the replica of rank {target} from rank {holder}: {type(exc).__name__}: {exc}"
    return error


def replica_slots(root, source: int) -> MemorySlots:
    return MemorySlots(root, owner_name(source, replica=True))
