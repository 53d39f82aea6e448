"""Documents for ``data prepare``: local files, directories (every supported file under them) and
``s3://bucket/prefix`` (every supported object under it, downloaded one at a time).

Formats, by name: ``.jsonl`` / ``.json`` (one JSON object per line, the text in ``--text-field``),
``.txt`` (the whole file is one document), ``.parquet`` (the ``--text-field`` column, a row group at
a time); ``.jsonl.gz`` and ``.txt.gz`` are read through gzip.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from ..config import ConfigError

SUFFIXES = (".jsonl", ".json", ".txt", ".parquet", ".jsonl.gz", ".json.gz", ".txt.gz")


@dataclass(frozen=True)
class Source:
    name: str  # a local path or an s3:// URI, as the user will recognise it
    size: int
    bucket: Optional[str] = None
    key: Optional[str] = None


def supported(name: str) -> bool:
    return name.endswith(SUFFIXES)


def find(inputs: list[str], client_factory: Any) -> list[Source]:
    """Every input file, in the order given (a directory's and a prefix's sorted by name)."""
    found: list[Source] = []
    for item in inputs:
        if item.startswith("s3://"):
            found += _s3_objects(item, client_factory())
            continue
        p = Path(item)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and supported(f.name))
            if not files:
                raise ConfigError(f"--input {item}: no {', '.join(SUFFIXES)} files under it")
            found += [Source(str(f), f.stat().st_size) for f in files]
        elif p.is_file():
            if not supported(p.name):
                raise ConfigError(f"--input {item}: unknown format; name files {', '.join(SUFFIXES)}")
            found.append(Source(str(p), p.stat().st_size))
        else:
            raise ConfigError(f"--input {item}: no such file or directory")
    return found


def _s3_objects(uri: str, client: Any) -> list[Source]:
    from ..checkpoint.s3.client import parse_s3_uri

    loc = parse_s3_uri(uri, "--input")
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=loc.prefix):
        for obj in page.get("Contents", []):
            if supported(obj["Key"]):
                out.append(Source(f"s3://{loc.bucket}/{obj['Key']}", obj["Size"], loc.bucket, obj["Key"]))
    if not out:
        raise ConfigError(f"--input {uri}: no {', '.join(SUFFIXES)} objects under it")
    return sorted(out, key=lambda s: s.name)


def documents(path: Path, name: str, text_field: str, batch: int = 1000) -> Iterator[list[str]]:
    """Batches of the documents in the file at ``path`` (``name``: what error messages call it)."""
    if name.endswith(".parquet"):
        yield from _parquet(path, name, text_field, batch)
        return
    opener = gzip.open if name.endswith(".gz") else open
    stem = name[:-3] if name.endswith(".gz") else name
    with opener(path, "rt", encoding="utf-8") as f:
        if stem.endswith(".txt"):
            text = f.read()
            if text:
                yield [text]
            return
        texts = []
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{name}:{lineno}: not a JSON line ({exc})") from exc
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(
                    f"{name}:{lineno}: no string field {text_field!r} (it has: {keys}); pass "
                    "--text-field with the field that holds the text"
                )
            if text:
                texts.append(text)
            if len(texts) >= batch:
                yield texts
                texts = []
        if texts:
            yield texts


def _parquet(path: Path, name: str, text_field: str, batch: int) -> Iterator[list[str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError("reading Parquet needs pyarrow: pip install 'resilient-fsdp[data]'") from exc
    f = pq.ParquetFile(path)
    if text_field not in f.schema_arrow.names:
        raise ConfigError(
            f"{name}: no column {text_field!r} (it has: {', '.join(f.schema_arrow.names)}); pass "
            "--text-field with the column that holds the text"
        )
    for record_batch in f.iter_batches(batch_size=batch, columns=[text_field]):
        texts = [t for t in record_batch.column(0).to_pylist() if t]
        if texts:
            yield texts
