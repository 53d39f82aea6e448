"""What one save's writer reports back to its rank: :class:`SaveReport`, a small directory on the
rank's local disk that only this save reads.

The writer runs in another process (NVRx's persistent worker, and the processes or threads it
starts per file), so what it learns reaches the rank through files: the checksum of every file it
wrote (recorded when the file is closed, :meth:`SaveReport.open_hashed`), its write results
(:meth:`SaveReport.put`, standing in for NVRx's results queue) and the first error it hit
(:meth:`SaveReport.record_error`). The rank reads them once (:meth:`SaveReport.read`), then
discards the directory. A report belongs to one save: a result can only be read by the save it
was written for.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..integrity import HashingStream

ERROR_FILE = "error.txt"
RESULTS_FILE = "write-results.pickle"
_SUFFIX = ".crc32c.json"


@dataclass(frozen=True)
class SaveReport:
    """One save's report directory; pickles by value (its path), so it travels to the writer."""

    path: str

    @classmethod
    def new(cls, token: str, rank: int) -> "SaveReport":
        """A fresh report for one save of one rank (local temporary storage)."""
        return cls(tempfile.mkdtemp(prefix=f"resilient-fsdp-save-{token}-r{rank}-"))

    # -- the writer's side ------------------------------------------------------------------------

    def open_hashed(self, path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        """``open`` for the writer: a file opened for writing is hashed, and its checksum is
        recorded here when it is closed."""
        raw = open(path, mode, *args, **kwargs)  # noqa: SIM115 - closed by the stream
        if "w" not in mode and "a" not in mode:
            return raw
        name = os.path.basename(os.fspath(path))
        return HashingStream(raw, name, self._record_checksum)

    def _record_checksum(self, name: str, entry: dict) -> None:
        (Path(self.path) / f"{name}{_SUFFIX}").write_text(json.dumps(entry))

    def record_error(self, where: str) -> None:
        """Record the exception being handled (its traceback) as this save's error; the first wins."""
        path = Path(self.path) / ERROR_FILE
        if not path.exists():
            path.write_text(f"{where}: {traceback.format_exc()}")

    def has_error(self) -> bool:
        return (Path(self.path) / ERROR_FILE).exists()

    def put(self, item: Any, *_args: Any, **_kwargs: Any) -> None:
        """The write results (or the writer's exception), as NVRx's results queue would take them."""
        with open(Path(self.path) / RESULTS_FILE, "wb") as f:
            pickle.dump(item, f)

    # -- the rank's side --------------------------------------------------------------------------

    def read(self) -> tuple[dict[str, dict], Optional[str]]:
        """(checksums by file name, the recorded error summarised, or None). Never raises."""
        sums: dict[str, dict] = {}
        error = None
        try:
            for entry in Path(self.path).iterdir():
                if entry.name.endswith(_SUFFIX):
                    sums[entry.name[: -len(_SUFFIX)]] = json.loads(entry.read_text())
                elif entry.name == ERROR_FILE:
                    error = _summary(entry.read_text())
        except (OSError, ValueError) as exc:
            error = error or f"cannot read the writer's report in {self.path}: {exc}"
        return sums, error

    def results(self) -> Any:
        """What the writer put for this save; raises when it put nothing (it did not finish)."""
        path = Path(self.path) / RESULTS_FILE
        if not path.exists():
            raise RuntimeError("the checkpoint writer reported completion but left no write results")
        with open(path, "rb") as f:
            return pickle.load(f)

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _summary(text: str) -> str:
    """The last line of a recorded traceback first (what failed), then the traceback."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] + "\n" + text) if lines else text
