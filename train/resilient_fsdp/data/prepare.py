"""``resilient-fsdp data prepare``: documents through a tokenizer into a prepared directory
(:mod:`.token_files`).

Each document becomes ``[bos] ids eos`` (``bos`` when the tokenizer has one), appended to one flat
array of the smallest dtype the vocabulary fits. The tokenizer encodes a batch of documents at a
time on every core (``tokenizers``' own thread pool); the CRC32C is computed as the array is
written. The array is written as ``tokens.bin.partial-<id>``, flushed, renamed to ``tokens.bin``,
and ``tokens.json`` is written last: a cut run leaves a partial file no reader takes for data
(the next run removes it), never a ``tokens.bin`` that looks whole. A directory that already holds
prepared data is refused, never overwritten.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from .. import atomic
from ..config import ConfigError
from . import sources
from .token_files import META, TOKENIZER_DIR, TOKENS, TokenMeta, dtype_for_vocab
from .tokenizer import load as load_tokenizer


def prepare(
    inputs: list[str],
    tokenizer_path: str,
    out: Path,
    text_field: str = "text",
    eos_token: Optional[str] = None,
    client_factory: Optional[Callable[[], Any]] = None,
    batch: int = 1000,
    progress: bool = True,
) -> TokenMeta:
    import crc32c

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    tok = load_tokenizer(tokenizer_path, eos_token)
    if (out / META).exists():
        raise ConfigError(
            f"--out {out} already holds prepared data ({META}); name a new directory (nothing is overwritten)"
        )
    found = sources.find(inputs, client_factory or _no_s3)
    dtype = np.dtype(dtype_for_vocab(tok.vocab_size))
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{TOKENS}.partial-*"):
        stale.unlink()  # a cut run's scratch file: never data (no tokens.json names it)
    partial = out / f"{TOKENS}.partial-{uuid.uuid4().hex[:8]}"
    bar = _bar(sum(s.size for s in found), progress)
    crc, tokens, docs = 0, 0, 0
    head = [tok.bos_id] if tok.bos_id is not None else []
    t0 = time.monotonic()
    try:
        with open(partial, "wb") as f:
            for source in found:
                with _local(source, client_factory) as path:
                    seen = 0
                    for texts in sources.documents(path, source.name, text_field, batch):
                        ids = [head + d + [tok.eos_id] for d in tok.encode(texts)]
                        array = np.fromiter((i for d in ids for i in d), dtype=dtype)
                        data = array.tobytes()
                        f.write(data)
                        crc = crc32c.crc32c(data, crc)
                        tokens, docs = tokens + len(array), docs + len(ids)
                        step = min(sum(len(t.encode()) for t in texts), source.size - seen)
                        seen += step
                        bar.update(step)
                        bar.set_postfix(tokens=f"{tokens:,}", refresh=False)
                    bar.update(source.size - seen)
            atomic.fsync_stream(f)
        if tokens == 0:
            raise ConfigError(f"--input {' '.join(inputs)}: no text found (empty documents are skipped)")
        atomic.rename(partial, out / TOKENS)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    tokenizer_dir = out / TOKENIZER_DIR
    tokenizer_dir.mkdir(exist_ok=True)
    for file in tok.files:
        atomic.write_bytes(tokenizer_dir / file.name, file.read_bytes())
    meta = TokenMeta(
        dtype=dtype.name,
        vocab_size=tok.vocab_size,
        num_tokens=tokens,
        num_documents=docs,
        eos_id=tok.eos_id,
        bos_id=tok.bos_id,
        tokenizer_sha256=tok.sha256,
        crc32c=f"{crc:08x}",
        sources=[s.name for s in found],
    )
    atomic.write_json(out / META, meta.to_json())
    seconds = time.monotonic() - t0
    print(
        f"prepared {docs:,} documents, {tokens:,} tokens ({dtype.name}, vocabulary {tok.vocab_size:,}) in "
        f"{seconds:.1f} s ({tokens / max(seconds, 1e-9):,.0f} tokens/s) -> {out}",
        file=sys.stderr,
    )
    return meta


def _no_s3() -> Any:
    raise ConfigError("an s3:// input needs S3 settings")


class _local:
    """The input as a local file: itself, or an S3 object downloaded to a scratch file."""

    def __init__(self, source: sources.Source, client_factory: Optional[Callable[[], Any]]):
        self.source, self.client_factory, self.scratch = source, client_factory, None

    def __enter__(self) -> Path:
        if self.source.bucket is None:
            return Path(self.source.name)
        self.scratch = Path(tempfile.mkdtemp(prefix="resilient-fsdp-data-"))
        path = self.scratch / Path(self.source.key).name
        self.client_factory().download_file(self.source.bucket, self.source.key, str(path))
        return path

    def __exit__(self, *exc: Any) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _bar(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="tokenize",
        file=sys.stderr,
        disable=None if enabled else True,
    )
