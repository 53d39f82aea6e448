"""One rank's memory checkpoints: two alternating slots in the pod's memory, each a file of the
rank's tensor bytes with, once complete, a commit record beside it.

In ``/dev/shm`` because an in-job restart keeps the pod, so a rank's new process finds its slots
there; a lost pod loses them, and a peer's replica serves instead (``peers``). Under the job's
root, ``<owner>/slot-<a|b>.bin`` (each tensor at the offset ``arena.plan`` gives it), ``.extra``
(the state's non-tensor values) and ``.json`` (the :class:`Record`); ``owner`` is ``rank-<r>``
or ``replica-of-<r>``. A slot loads only into a state of the same structure digest and only when
every checksum matches; anything else is a :class:`SlotInvalid`, which the caller turns into a
fallback (a replica, the durable checkpoint), never a silent load. Used by :mod:`.tier`.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Container, Iterable, Optional

import crc32c
import torch

from ... import atomic
from ..arena import Slot as Span
from ..arena import plan
from . import pinning

SLOTS = ("a", "b")
FORMAT = 1
CHUNK = 4 << 20  # bytes checksummed and copied at a time: fits in a core's share of the cache


class SlotInvalid(Exception):
    """A memory checkpoint that must not be loaded: missing, torn, of another state, or corrupt.
    ``reason`` says which, for the log and the fallback's record."""

    def __init__(self, where: Path, reason: str):
        super().__init__(f"memory checkpoint {where}: {reason}")
        self.where, self.reason = where, reason


@dataclasses.dataclass(frozen=True)
class Record:
    """What a complete slot holds (the JSON beside its bytes): the step, the attempt and job that
    wrote it, the world size, the digest of the state's structure (``staging.structure``), each
    tensor's place in the file and CRC32C, and what the caller adds (``meta``)."""

    step: int
    slot: str
    digest: str
    """``structure_digest`` of the state the bytes are of."""
    world_size: int
    rank: int
    """The rank whose state this is (a replica keeps its source's)."""
    job: str
    attempt: int
    nbytes: int
    spans: tuple[tuple[int, str, tuple[int, ...]], ...]
    """Per tensor, in ``staging.local_tensors`` order: byte offset, dtype name, shape."""
    crc32c: tuple[int, ...]
    """Per tensor: the CRC32C of its bytes."""
    extra_crc32c: int
    """The CRC32C of the slot's ``extra`` bytes (the state's non-tensor values, pickled)."""
    meta: dict
    created_unix: float

    def to_json(self) -> dict:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> "Record":
        if data.get("format") != FORMAT:
            raise ValueError(f"record format {data.get('format')!r}, expected {FORMAT}")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["spans"] = tuple((int(o), str(d), tuple(int(n) for n in s)) for o, d, s in values["spans"])
        values["crc32c"] = tuple(int(c) for c in values["crc32c"])
        values["extra_crc32c"] = int(values["extra_crc32c"])
        return cls(**values)


def structure_digest(structure: tuple) -> str:
    """A stable digest of ``staging.structure(state)``: equal for states that lay out alike."""
    return hashlib.sha256(repr(structure).encode()).hexdigest()[:32]


def owner_name(rank: int, replica: bool = False) -> str:
    return f"replica-of-{rank}" if replica else f"rank-{rank}"


class MemorySlots:
    """The two slots of ``owner`` (``owner_name``) under ``root``, for tensors laid out alike at
    every save (a new layout rewrites the slot's file at its new size). A save writes into the slot
    that does not hold the newest complete snapshot, after removing that slot's record (the record
    is written by rename once the bytes and checksums are in), so a complete snapshot exists at
    every moment and a write cut off half-way is never taken for one."""

    def __init__(self, root: Path, owner: str, pin: bool = False):
        self.dir = Path(root) / owner
        self._mapped: dict[str, tuple[int, torch.Tensor]] = {}
        # On CUDA the slots a save copies into are page-locked (:mod:`.pinning`): whether they are,
        # and why not when one could not be.
        self._pin = pin
        self._pinned: set[str] = set()
        self.pin_error: Optional[str] = None
        # Records parsed, by slot, with the identity of the file they were read from: a save asks
        # for the newest at every snapshot, and a record is only ever replaced by a rename.
        self._parsed: dict[str, tuple[tuple[int, int, int], Record]] = {}

    # -- what is there -----------------------------------------------------------------------

    def records(self) -> list[Record]:
        """The complete slots' records, newest step first; an unreadable record is skipped here
        (``load`` names it when asked for that slot)."""
        found = []
        for slot in SLOTS:
            try:
                found.append(self._record(slot))
            except SlotInvalid:
                continue
        return sorted(found, key=lambda r: r.step, reverse=True)

    def newest(self) -> Optional[Record]:
        records = self.records()
        return records[0] if records else None

    def _record(self, slot: str) -> Record:
        path = self.dir / f"slot-{slot}.json"
        try:
            st = path.stat()
            identity = (st.st_ino, st.st_mtime_ns, st.st_size)
            parsed = self._parsed.get(slot)
            if parsed is not None and parsed[0] == identity:
                record = parsed[1]
            else:
                record = Record.from_json(json.loads(path.read_text()))
                self._parsed[slot] = (identity, record)
        except FileNotFoundError:
            raise SlotInvalid(path, "no complete snapshot") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SlotInvalid(path, f"unreadable record ({exc})") from None
        size = self._bin(slot).stat().st_size if self._bin(slot).exists() else -1
        if size < record.nbytes:
            raise SlotInvalid(path, f"its bytes are {max(size, 0)} of the {record.nbytes} recorded")
        return record

    def _bin(self, slot: str) -> Path:
        return self.dir / f"slot-{slot}.bin"

    def _extra(self, slot: str) -> Path:
        return self.dir / f"slot-{slot}.extra"

    # -- writing -----------------------------------------------------------------------------

    def mapped(self) -> bool:
        """Whether a slot is held mapped already (this process has saved or read one)."""
        return bool(self._mapped)

    def next_slot(self) -> str:
        """The slot a save writes into: the one not holding the newest complete snapshot."""
        newest = self.newest()
        return "b" if newest is not None and newest.slot == "a" else "a"

    def open(self, slot: str, tensors: Iterable[torch.Tensor]) -> tuple[list[Span], list[torch.Tensor]]:
        """Start a save into ``slot``: its record is removed first (from here on the slot is not a
        snapshot), its file sized for ``tensors`` and mapped (kept mapped across saves, so each
        page is touched once); returns the spans and the views to copy ``tensors`` into."""
        spans, nbytes = plan(tensors)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._unrecord(slot)
        buffer = self._map(slot, nbytes)
        views = [buffer[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in spans]
        return spans, views

    def _map(self, slot: str, nbytes: int) -> torch.Tensor:
        held = self._mapped.get(slot)
        if held is not None and held[0] == nbytes:
            return held[1]
        path = self._bin(slot)
        if held is not None or (path.exists() and path.stat().st_size != nbytes):
            self._unmap(slot)
            path.unlink(missing_ok=True)  # a new layout: a file of the new size, not a grown one
        _reserve(path, max(nbytes, 1))
        storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=max(nbytes, 1))
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes]
        buffer.zero_()  # first touch here, not in the first save's copy
        self._mapped[slot] = (nbytes, buffer)
        if self._pin:
            why = pinning.pin(buffer)
            if why is None:
                self._pinned.add(slot)
            else:
                self.pin_error = f"memory slot {path}: {why}"
        return buffer

    def _unmap(self, slot: str) -> None:
        held = self._mapped.pop(slot, None)
        if held is not None and slot in self._pinned:
            self._pinned.discard(slot)
            pinning.unpin(held[1])  # a failure leaves the pages locked until the process ends

    @property
    def pinned(self) -> Optional[bool]:
        """Whether every mapped slot is page-locked (None: not asked to pin, or none mapped yet)."""
        if not self._pin or not self._mapped:
            return None
        return set(self._mapped) <= self._pinned

    def commit(
        self,
        slot: str,
        spans: list[Span],
        step: int,
        digest: str,
        *,
        world_size: int,
        rank: int,
        job: str,
        attempt: int,
        meta: Optional[dict] = None,
        extra: bytes = b"",
    ) -> Record:
        """Checksum the slot's bytes (the copy into them must be complete), write ``extra`` beside
        them, then the record by rename: from here on the slot is a snapshot of ``step``."""
        buffer = self._mapped[slot][1]
        crcs = tuple(crc32c.crc32c(_bytes(buffer, s)) for s in spans)
        self._extra(slot).write_bytes(extra)
        record = Record(
            step=step,
            slot=slot,
            digest=digest,
            world_size=world_size,
            rank=rank,
            job=job,
            attempt=attempt,
            nbytes=int(buffer.numel()),
            spans=tuple((s.offset, _dtype_name(s.dtype), tuple(s.shape)) for s in spans),
            crc32c=crcs,
            extra_crc32c=crc32c.crc32c(extra),
            meta=dict(meta or {}),
            created_unix=time.time(),
        )
        atomic.write_json(self.dir / f"slot-{slot}.json", record.to_json())  # on tmpfs its fsyncs cost nothing
        return record

    def open_raw(self, slot: str, nbytes: int) -> torch.Tensor:
        """Start writing ``slot`` as bytes (a replica arriving from its rank): its record removed,
        its file sized and mapped; the buffer to receive into."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._unrecord(slot)
        return self._map(slot, nbytes)

    def _unrecord(self, slot: str) -> None:
        """``slot`` is about to be written: no record of what it held stands, valid or set aside."""
        for suffix in (".json", ".invalid"):
            (self.dir / f"slot-{slot}{suffix}").unlink(missing_ok=True)

    def commit_raw(self, slot: str, record: Record, extra: bytes) -> Record:
        """Complete ``slot`` with another slot's ``record`` (its checksums, unchanged: they are
        checked when the slot is read) and ``extra``."""
        self._extra(slot).write_bytes(extra)
        mine = dataclasses.replace(record, slot=slot)
        atomic.write_json(self.dir / f"slot-{slot}.json", mine.to_json())
        return mine

    # -- reading -----------------------------------------------------------------------------

    def raw(self, record: Record) -> torch.Tensor:
        """``record``'s slot as bytes, unchecked (a replica's receiver checks them when it loads)."""
        return self._map_existing(record)

    def read(
        self,
        record: Record,
        digest: Optional[str] = None,
        moved: Container[int] = (),
        device: Optional[torch.device] = None,
    ) -> list[torch.Tensor]:
        """The tensors of ``record``'s slot, checked: the digest (when given) and every CRC32C.
        Views of the mapped file, no copy, except the tensors whose index is in ``moved``: each is
        copied, a chunk at a time right after the chunk's checksum (so each byte is read from
        memory once), into new memory of its own on ``device``. Raises :class:`SlotInvalid`."""
        where = self._bin(record.slot)
        if digest is not None and record.digest != digest:
            raise SlotInvalid(where, "it holds a state of another structure (model, mesh or world size)")
        try:
            buffer = self._map_existing(record)
        except OSError as exc:
            raise SlotInvalid(where, f"unreadable ({exc.strerror or exc})") from None
        out = []
        for i, ((offset, dtype, shape), crc) in enumerate(zip(record.spans, record.crc32c)):
            span = Span(offset, _dtype(dtype), shape)
            if offset + span.nbytes > buffer.numel():
                raise SlotInvalid(where, f"tensor {i} lies past the end of the file")
            saved = buffer[offset : offset + span.nbytes]
            if i in moved:
                saved, actual = _checked_copy(saved, device or torch.device("cpu"))
            else:
                actual = crc32c.crc32c(memoryview(saved.numpy()))
            if actual != crc:
                raise SlotInvalid(where, f"tensor {i} fails its CRC32C (step {record.step})")
            out.append(saved.view(span.dtype).view(span.shape))
        return out

    def extra(self, record: Record) -> bytes:
        """``record``'s extra bytes, checked against its CRC32C; raises :class:`SlotInvalid`."""
        path = self._extra(record.slot)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise SlotInvalid(path, f"unreadable ({exc.strerror or exc})") from None
        if crc32c.crc32c(data) != record.extra_crc32c:
            raise SlotInvalid(path, f"its non-tensor values fail their CRC32C (step {record.step})")
        return data

    def load_into(self, record: Record, tensors: list[torch.Tensor], digest: Optional[str] = None) -> None:
        """Copy ``record``'s slot into ``tensors`` (the live state's, in the same order), checked
        first as :meth:`read` checks it; nothing is copied from a slot that fails."""
        views = self.read(record, digest)
        if len(views) != len(tensors):
            raise SlotInvalid(self._bin(record.slot), f"{len(views)} tensors, the state has {len(tensors)}")
        for live, saved in zip(tensors, views):
            live.copy_(saved)

    def _map_existing(self, record: Record) -> torch.Tensor:
        held = self._mapped.get(record.slot)
        if held is not None and held[0] == record.nbytes:
            return held[1]
        storage = torch.UntypedStorage.from_file(str(self._bin(record.slot)), shared=True, nbytes=max(record.nbytes, 1))
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)[: record.nbytes]
        self._mapped[record.slot] = (record.nbytes, buffer)
        return buffer

    def discard_newer_than(self, step: int) -> list[int]:
        """Remove the records of snapshots past ``step``: after a restore to ``step`` (from memory,
        the durable checkpoint or a rewind) they belong to a line the job no longer trains on, and
        a later snapshot of the same step number must never meet them. Returns the steps removed."""
        removed = []
        for record in self.records():
            if record.step > step:
                (self.dir / f"slot-{record.slot}.json").unlink(missing_ok=True)
                removed.append(record.step)
        return removed

    def set_aside(self, record: Record) -> Path:
        """Take ``record``'s slot out of the snapshots (one that failed its checks): its record
        moves to ``slot-<x>.invalid``, kept to be looked at, and the slot is the next one written."""
        path = self.dir / f"slot-{record.slot}.json"
        aside = path.with_suffix(".invalid")
        path.replace(aside)
        return aside

    def byte_of(self, record: Record) -> tuple[Path, int]:
        """The file and offset of ``record``'s first tensor byte (where an injected fault flips one)."""
        return self._bin(record.slot), record.spans[0][0] if record.spans else 0

    # -- the end ------------------------------------------------------------------------------

    def remove(self) -> None:
        """Unmap and delete both slots (the job has ended; memory goes back to the pod)."""
        for slot in list(self._mapped):
            self._unmap(slot)
        shutil.rmtree(self.dir, ignore_errors=True)


def _reserve(path: Path, nbytes: int) -> None:
    """Give ``path`` all ``nbytes`` now. A mapped file on a tmpfs that runs out of room kills the
    process that touches the missing page (SIGBUS); reserved here, a full ``/dev/shm`` is an
    ``OSError`` naming what to raise instead."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        path.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            free = shutil.disk_usage(path.parent).free
            raise OSError(
                errno.ENOSPC,
                f"{path.parent} has {free / 2**20:.0f} MiB free, a memory checkpoint slot "
                f"needs {nbytes / 2**20:.0f} MiB (two per rank, and a peer's two with "
                "replicas): raise shm.sizeLimit (resilient-fsdp advise --memory sizes it) "
                "or lower the ranks per pod",
            ) from None
        raise
    os.close(fd)


def _checked_copy(source: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
    """``source`` (bytes) copied into new memory on ``device``, and its CRC32C, taken a chunk at
    a time while the chunk is in the cache. The new memory is uninitialised before the copy (no
    deterministic fill: the copy writes every byte)."""
    copy = torch.empty(0, dtype=torch.uint8, device=device).set_(torch.UntypedStorage(source.numel(), device=device))
    crc = 0
    for start in range(0, source.numel(), CHUNK):
        chunk = source[start : start + CHUNK]
        crc = crc32c.crc32c(memoryview(chunk.numpy()), value=crc)
        copy[start : start + CHUNK].copy_(chunk)
    return copy, crc


def _bytes(buffer: torch.Tensor, span: Span) -> memoryview:
    return memoryview(buffer[span.offset : span.offset + span.nbytes].numpy())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def slot_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The size of one slot for ``tensors``: what ``/dev/shm`` must hold per slot."""
    return plan(tensors)[1]


def job_root(shm: Path, job: str, run: str) -> Path:
    """Where run ``run`` (``run_identity``) of job ``job`` keeps its slots in the pod's memory: one
    directory per job and run, so slots never outlive the run they belong to or mix with another's,
    an earlier run of the same job name included."""
    return Path(shm) / "resilient-fsdp" / job / run


def kept_plan_file(shm: Path, job: str, run: str, rank: int) -> Optional[Path]:
    """Where the pod keeps ``rank``'s validated save plan for the rank's next process: beside the
    slots, under the job's run. None for a process that is its own job (``standalone-``: no
    restart of it would find the plan)."""
    if job.startswith("standalone-"):
        return None
    return job_root(shm, job, run) / "plans" / f"rank-{rank}.pickle"


def remove_job(shm: Path, job: str) -> None:
    """Every run's slots of ``job``."""
    shutil.rmtree(Path(shm) / "resilient-fsdp" / job, ignore_errors=True)


def remove_empty_job_root(shm: Path, job: str, run: str) -> None:
    """The run's folder and the two above it (the job's, the tool's), each once empty (another
    rank's or another run's files may remain)."""
    root = job_root(shm, job, run)
    for directory in (root, root.parent, root.parent.parent):
        try:
            directory.rmdir()
        except OSError:
            break
