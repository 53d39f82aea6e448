"""Checksums of checkpoint files: computed while a writer writes them, recorded in ``COMPLETE``,
verified before a checkpoint is loaded and after an S3 download.

:class:`HashingStream` computes a file's CRC32C from the bytes a writer passes through it, so
nothing is read back to checksum it; a stream in the writer process records its result in the
save's report (:class:`.writer.report.SaveReport`), one in the rank in memory (:class:`Recorder`,
:class:`HashingFileSystem`). :func:`verify` reads files back and compares, each rank its share
(:func:`share`); :class:`VerifiedHere` remembers what this process verified already.
"""

from __future__ import annotations

import heapq
import io
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import crc32c
from torch.distributed.checkpoint.filesystem import FileSystem

ALGORITHM = "crc32c"
CHUNK = 8 * 1024 * 1024


def hex32(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


class HashingStream(io.RawIOBase):
    """Writes through to ``raw`` and keeps the CRC32C and length of what was written.

    ``on_close(name, entry)`` receives ``{"crc32c": hex, "bytes": n}`` (``crc32c`` None when the
    writer sought backwards) once the file is closed.
    """

    def __init__(self, raw: Any, name: str, on_close: Callable[[str, dict], None]):
        super().__init__()
        self._raw, self._name, self._on_close = raw, name, on_close
        self.crc, self.nbytes, self.valid = 0, 0, True

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        n = self._raw.write(view)
        n = len(view) if n is None else n
        self.crc = crc32c.crc32c(view[:n], self.crc)
        self.nbytes += n
        return n

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos = self._raw.seek(offset, whence)
        if pos != self.nbytes:
            self.valid = False  # the checksum of the bytes passed no longer describes the file
        return pos

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._raw.close()
        finally:
            super().close()
        self._on_close(self._name, {"crc32c": hex32(self.crc) if self.valid else None, "bytes": self.nbytes})


# ---- results recorded in this process --------------------------------------------------------


class Recorder:
    """Checksums of files written by threads of this process, by file name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sums: dict[str, dict] = {}

    def __call__(self, name: str, entry: dict) -> None:
        with self._lock:
            self.sums[name] = entry

    def take(self, renames: Optional[dict[str, str]] = None) -> dict[str, dict]:
        with self._lock:
            sums, self.sums = self.sums, {}
        for old, new in (renames or {}).items():
            if old in sums:
                sums[new] = sums.pop(old)
        return sums


class HashingFileSystem(FileSystem):
    """torch DCP's file system with every stream opened for writing hashed into ``recorder``."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = HashingStream(open(path, mode), Path(path).name, self.recorder)  # noqa: SIM115
        try:
            yield stream
        finally:
            stream.close()


# ---- verification ------------------------------------------------------------------------------


def file_crc32c(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            crc = crc32c.crc32c(block, crc)
    return hex32(crc)


def share(files: dict[str, dict], world_size: int, rank: int) -> list[str]:
    """This rank's part of ``files`` (name -> entry with ``bytes``): largest first, each to the
    rank with the fewest bytes so far (the lowest rank among equals), so every rank reads about as
    much. The same on every rank: it depends on the names and sizes only. A heap of (bytes, rank)
    keeps it O(files log world) at 1,000 ranks; the order the ties break in is the heap's key."""
    loads = [(0, r) for r in range(world_size)]  # already a heap: sorted
    mine = []
    for name in sorted(files, key=lambda n: (-int(files[n].get("bytes", 0)), n)):
        load, target = loads[0]
        heapq.heapreplace(loads, (load + int(files[name].get("bytes", 0)), target))
        if target == rank:
            mine.append(name)
    return mine


def verify(root: Path, files: dict[str, dict], names: list[str]) -> list[str]:
    """Check ``names`` under ``root`` against their recorded size and checksum; one line per
    problem (empty when all match)."""
    problems = []
    for name in names:
        entry, path = files[name], root / name
        try:
            size = path.stat().st_size
        except OSError as exc:
            problems.append(f"{name}: cannot be read ({exc.strerror or exc})")
            continue
        if size != entry.get("bytes"):
            problems.append(f"{name}: {size} bytes, the manifest says {entry.get('bytes')}")
            continue
        if entry.get(ALGORITHM) is None:
            continue  # recorded as unverifiable when written
        got = file_crc32c(path)
        if got != entry[ALGORITHM]:
            problems.append(
                f"{name}: {ALGORITHM} {got}, the manifest says {entry[ALGORITHM]} (same size: the "
                "contents changed after they were written)"
            )
    return problems


# ---- what this process has verified ------------------------------------------------------------


class VerifiedHere:
    """Checkpoints whose files this process found matching their checksums, by path and the
    manifest's identity (step, ``created_unix``, ``job``): a checkpoint rewritten at the same path
    is another checkpoint. In memory only, so a fresh process verifies again: files can change
    between runs, and that is what verification catches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: set[tuple] = set()

    @staticmethod
    def key(path: Path, manifest: dict) -> tuple:
        return (str(Path(path).resolve()), manifest.get("step"), manifest.get("created_unix"), manifest.get("job"))

    def remember(self, path: Path, manifest: dict) -> None:
        with self._lock:
            self._keys.add(self.key(path, manifest))

    def __contains__(self, item: tuple[Path, dict]) -> bool:
        with self._lock:
            return self.key(*item) in self._keys


verified_here = VerifiedHere()
