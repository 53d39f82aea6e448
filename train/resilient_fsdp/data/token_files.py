"""The prepared data directory ``resilient-fsdp data prepare`` writes, and the trainer reads::

    DIR/tokens.bin      every document's token ids, each followed by the separator, as one flat
                        array of the dtype the vocabulary needs (uint16 up to 65,536 ids)
    DIR/tokens.json     what the array is: dtype, token and document counts, the vocabulary size,
                        the separator id, the tokenizer's SHA-256, the array's CRC32C
    DIR/tokenizer/      the tokenizer's files (exported with a trained model)

``tokens.json`` is written last, so a directory with it is complete. ``data.path`` may name the
directory or its ``tokens.bin``; a ``.bin`` without metadata is read as ``data.token_dtype``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ..config import ConfigError

TOKENS = "tokens.bin"
META = "tokens.json"
TOKENIZER_DIR = "tokenizer"
FORMAT = 1


@dataclass(frozen=True)
class TokenMeta:
    dtype: str
    vocab_size: int
    num_tokens: int
    num_documents: int
    eos_id: int
    tokenizer_sha256: str
    crc32c: str
    bos_id: Optional[int] = None
    sources: list = field(default_factory=list)
    format: int = FORMAT

    def to_json(self) -> dict:
        return asdict(self)


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def meta_path(bin_path: Path) -> Path:
    return bin_path.with_name(META) if bin_path.name == TOKENS else bin_path.with_suffix(".json")


def read_meta(path: Path) -> Optional[TokenMeta]:
    """The metadata at ``path`` (a ``tokens.json``); None when there is none."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable data metadata ({exc}); run `resilient-fsdp data prepare` again") from exc
    return meta_from_json(raw, str(path))


def meta_from_json(raw: object, where: str) -> TokenMeta:
    """``tokens.json``'s fields (fields a newer writer added are ignored); ``where`` names it in the
    error when it is not data prepare's metadata."""
    known = set(TokenMeta.__dataclass_fields__)
    try:
        return TokenMeta(**{k: v for k, v in dict(raw).items() if k in known})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: not data prepare's metadata ({exc})") from exc


def resolve(path: str, key: str = "data.path") -> tuple[Path, Optional[TokenMeta]]:
    """The token file ``path`` names (a prepared directory or a ``.bin``) and its metadata."""
    p = Path(path)
    if p.is_dir():
        bin_path, meta = p / TOKENS, read_meta(p / META)
        if meta is None:
            partial = sorted(x.name for x in p.glob(f"{TOKENS}.partial-*"))
            why = (
                f"holds {partial[0]}: a `data prepare` that did not finish; run it again"
                if partial
                else f"has no {META}: not a directory `resilient-fsdp data prepare` wrote"
            )
            raise ConfigError(f"{key}={path!r} {why}")
    else:
        bin_path, meta = p, read_meta(meta_path(p))
    if not bin_path.is_file():
        raise ConfigError(
            f"{key}={path!r}: no such file; set {key} to a directory `resilient-fsdp data prepare` "
            "wrote, or to a .bin token file"
        )
    if meta is not None:
        itemsize = np.dtype(meta.dtype).itemsize
        size = bin_path.stat().st_size
        if size != meta.num_tokens * itemsize:
            raise ConfigError(
                f"{key}={path!r}: {bin_path} has {size} bytes, its {META} says {meta.num_tokens} tokens "
                f"of {meta.dtype} ({meta.num_tokens * itemsize} bytes): the file was cut or replaced; "
                "prepare or copy it again"
            )
    return bin_path, meta


def check_vocab(meta: TokenMeta, vocab_size: int, model_name: str, key: str = "data.path") -> None:
    """A tokenizer whose ids the model cannot embed is refused before training starts."""
    if meta.vocab_size > vocab_size:
        raise ConfigError(
            f"{key}: the data was tokenized with a vocabulary of {meta.vocab_size} (tokenizer sha256 "
            f"{meta.tokenizer_sha256[:12]}), larger than {model_name}'s {vocab_size}: set model.vocab_size="
            f"{meta.vocab_size} (built-in model), use a model.hf_config whose vocab_size covers it, or prepare the "
            "data with the model's own tokenizer"
        )
