"""A small text corpus and a tokenizer trained on it, made here (nothing comes from a hub)."""

from __future__ import annotations

import json
import random
from pathlib import Path

SUBJECTS = ["the cat", "a dog", "the model", "every rank", "the node", "a checkpoint", "the pod", "one shard"]
VERBS = ["saves", "loads", "sees", "restarts", "trains", "reads", "writes", "finds"]
OBJECTS = ["the shard", "a batch", "the volume", "its state", "the loss", "a token", "the store", "a step"]


def documents(count: int = 400, seed: int = 0) -> list[str]:
    """Documents of 3-12 sentences from a small grammar: learnable, and not one repeated string."""
    rng = random.Random(seed)
    return [
        " ".join(
            f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}." for _ in range(rng.randint(3, 12))
        )
        for _ in range(count)
    ]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d, "source": "grammar"}) + "\n" for d in docs))
    return path


def train_tokenizer(path: Path, docs: list[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE ``tokenizer.json`` with ``<unk>``, ``<s>`` and ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        docs,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<unk>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
