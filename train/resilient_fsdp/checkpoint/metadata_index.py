"""A DCP checkpoint's metadata in a form a resume reads in seconds at a thousand ranks.

DCP's ``.metadata`` is one pickle of every written item's place (a ``MetadataIndex`` and a
``_StorageInfo`` per shard of every tensor: 2.2 M of each, 328 MB, for 70b at 1,024 ranks) and
every rank of a resume unpickles all of it, 26 s, although it reads only its own shards. The commit writes this index beside it (:data:`INDEX_FILE`, in the manifest's
checksums like every file): the metadata without its places (small when the plan was made alone:
one chunk list per layout, :mod:`.writer.decentralized_plan`) and the places as numpy columns.
A resume unpickles the columns at memory speed and looks up only the items its load plan reads
(:class:`IndexedStorage`). ``.metadata`` stays DCP's own, for every other reader; a checkpoint
without an index (or with one that does not load) is resumed from ``.metadata``.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import numpy as np
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from .store import INDEX_FILE

FORMAT = 1


def encode(metadata: Metadata, storage: dict) -> Optional[bytes]:
    """The index of ``metadata`` with the items' places ``storage`` (as DCP's writer collects them
    from every rank's write results); None where an item's storage is not a plain byte range
    (a transform, another storage layer's info), which the index does not hold."""
    fqns: dict[str, int] = {}
    files: dict[str, int] = {}
    n = len(storage)
    ndim = max((len(k.offset) for k in storage if k.offset is not None), default=0)
    fqn_id = np.empty(n, np.int32)
    dims = np.empty(n, np.int8)  # -1: an item without offsets (a byte item)
    offsets = np.zeros((n, ndim), np.int64)
    file_id = np.empty(n, np.int32)
    file_offset = np.empty(n, np.int64)
    length = np.empty(n, np.int64)
    for i, (key, info) in enumerate(storage.items()):
        if type(info) is not _StorageInfo or info.transform_descriptors:
            return None
        fqn_id[i] = fqns.setdefault(key.fqn, len(fqns))
        if key.offset is None:
            dims[i] = -1
        else:
            dims[i] = len(key.offset)
            offsets[i, : len(key.offset)] = key.offset
        file_id[i] = files.setdefault(info.relative_path, len(files))
        file_offset[i], length[i] = info.offset, info.length
    without_places = dataclasses.replace(metadata, storage_data=None)
    return pickle.dumps(
        {
            "format": FORMAT,
            "metadata": without_places,
            "fqns": list(fqns),
            "files": list(files),
            "columns": (fqn_id, dims, offsets, file_id, file_offset, length),
        },
        protocol=pickle.HIGHEST_PROTOCOL,
    )


def decode(data: bytes) -> Metadata:
    """The metadata of an index, its places looked up on demand (:class:`IndexedStorage`).
    Raises ValueError on an index of another format."""
    record = pickle.loads(data)
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{INDEX_FILE} is not of format {FORMAT}")
    metadata = record["metadata"]
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{INDEX_FILE} holds a {type(metadata).__name__}, not DCP's Metadata")
    metadata.storage_data = IndexedStorage(record["fqns"], record["files"], *record["columns"])
    return metadata


class IndexedStorage(Mapping):
    """DCP's ``storage_data`` (``MetadataIndex`` -> ``_StorageInfo``) over the index's columns: an
    item is found among its tensor's rows when DCP's reader asks for it."""

    def __init__(
        self,
        fqns: list[str],
        files: list[str],
        fqn_id: np.ndarray,
        dims: np.ndarray,
        offsets: np.ndarray,
        file_id: np.ndarray,
        file_offset: np.ndarray,
        length: np.ndarray,
    ):
        self.fqns, self.files = fqns, files
        self.dims, self.offsets = dims, offsets
        self.file_id, self.file_offset, self.length = file_id, file_offset, length
        self.fqn_id = fqn_id
        self.order = np.argsort(fqn_id, kind="stable")
        bounds = np.searchsorted(fqn_id[self.order], np.arange(len(fqns) + 1))
        self.rows = {name: (int(bounds[i]), int(bounds[i + 1])) for i, name in enumerate(fqns)}

    def __getitem__(self, key: MetadataIndex) -> _StorageInfo:
        span = self.rows.get(key.fqn)
        if span is None:
            raise KeyError(key)
        rows = self.order[span[0] : span[1]]
        if key.offset is None:
            match = rows[self.dims[rows] == -1]
        else:
            d = len(key.offset)
            same = (self.dims[rows] == d) & (self.offsets[rows, :d] == np.asarray(key.offset, np.int64)).all(axis=1)
            match = rows[same]
        if not len(match):
            raise KeyError(key)
        row = int(match[0])
        return _StorageInfo(self.files[self.file_id[row]], int(self.file_offset[row]), int(self.length[row]))

    def _key(self, row: int) -> MetadataIndex:
        d = int(self.dims[row])
        return MetadataIndex(
            self.fqns[self.fqn_id[row]], None if d < 0 else tuple(int(x) for x in self.offsets[row, :d])
        )

    def __iter__(self) -> Iterator[MetadataIndex]:
        return (self._key(row) for row in range(len(self.fqn_id)))

    def __len__(self) -> int:
        return len(self.fqn_id)


def storage_of(all_results: list[list[Any]]) -> dict:
    """Every written item's place, from every rank's write results (as DCP's writer gathers them)."""
    storage: dict = {}
    for results in all_results:
        storage.update({r.index: r.storage_data for r in results})
    return storage
