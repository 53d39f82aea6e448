"""The tokenizer ``data prepare`` runs: a ``tokenizer.json`` (Hugging Face ``tokenizers``), or a
local Hugging Face tokenizer directory (its ``tokenizer.json``; a directory without one, e.g. a
SentencePiece ``tokenizer.model``, is converted by ``transformers``' ``AutoTokenizer``).

What the data records of it: the SHA-256 of its ``tokenizer.json`` (the same tokenizer gives the
same hash wherever it is), the vocabulary size (highest id + 1), and the separator appended after
every document (the end-of-sequence token: ``--eos-token``, else the directory's
``tokenizer_config.json``, else a well-known name the vocabulary has), with the
beginning-of-sequence token put before each document when the tokenizer has one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..config import ConfigError

KEY = "--tokenizer"
# Files of a Hugging Face tokenizer directory that travel with the data (and an exported model).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")


@dataclass
class Tokenizer:
    backend: Any  # tokenizers.Tokenizer
    sha256: str
    files: list[Path]
    vocab_size: int
    eos_id: int
    bos_id: Optional[int]

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, special tokens left out (the separator is the caller's)."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]


def load(path: str, eos_token: Optional[str] = None) -> Tokenizer:
    try:
        from tokenizers import Tokenizer as Backend
    except ImportError as exc:
        raise ConfigError("data prepare needs the tokenizers package: pip install 'resilient-fsdp[data]'") from exc
    p = Path(path)
    config: dict = {}
    if p.is_file():
        backend, files, text = _from_file(Backend, p), [p], p.read_text()
    elif p.is_dir():
        files = [p / n for n in TOKENIZER_FILES if (p / n).is_file()]
        if (p / "tokenizer_config.json").is_file():
            config = _json(p / "tokenizer_config.json")
        if (p / "tokenizer.json").is_file():
            backend, text = _from_file(Backend, p / "tokenizer.json"), (p / "tokenizer.json").read_text()
        else:
            backend = _converted(p)
            text = backend.to_str()
    else:
        raise ConfigError(
            f"{KEY} {path}: no such file or directory; pass a tokenizer.json or a local Hugging Face "
            "tokenizer directory (nothing is downloaded)"
        )
    vocab = backend.get_vocab(with_added_tokens=True)
    eos = _special(vocab, eos_token, config.get("eos_token"), EOS_NAMES)
    if eos is None:
        raise ConfigError(
            f"{KEY} {path}: no end-of-sequence token found (tried {', '.join(EOS_NAMES)}); name the one "
            "that separates documents with --eos-token TOKEN"
        )
    bos = _special(vocab, None, config.get("bos_token"), BOS_NAMES)
    return Tokenizer(backend, hashlib.sha256(text.encode()).hexdigest(), files, max(vocab.values()) + 1, eos, bos)


def _from_file(backend: Any, path: Path) -> Any:
    try:
        return backend.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ConfigError(f"{KEY} {path}: not a tokenizers tokenizer.json ({str(exc).splitlines()[0]})") from exc


def _converted(directory: Path) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ConfigError(
            f"{KEY} {directory} has no tokenizer.json; converting it needs transformers: "
            "pip install 'resilient-fsdp[hf]'"
        ) from exc
    try:
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{KEY} {directory}: transformers cannot load a tokenizer from it ({exc})") from exc
    if not getattr(tok, "is_fast", False):
        raise ConfigError(
            f"{KEY} {directory}: only a slow tokenizer loads from it; save a tokenizer.json with "
            "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) where the conversion works"
        )
    return tok.backend_tokenizer


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{KEY}: {path} is not readable JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


def _special(vocab: dict, named: Optional[str], configured: Any, candidates: tuple) -> Optional[int]:
    if named is not None:
        if named not in vocab:
            raise ConfigError(f"--eos-token {named!r} is not in the tokenizer's vocabulary")
        return vocab[named]
    if isinstance(configured, dict):
        configured = configured.get("content")
    if isinstance(configured, str) and configured in vocab:
        return vocab[configured]
    return next((vocab[c] for c in candidates if c in vocab), None)
