"""Token datasets and the resumable distributed sampler.

A dataset is map-style: ``len(ds)`` samples, ``ds[i]`` a 1-D integer tensor of ``seq_len + 1``
token ids (inputs are ``[:-1]``, targets ``[1:]``). The sampler's only state is the number of
samples the whole job has consumed, so a resumed run (at any world size) continues with exactly
the samples that come next.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Protocol

import numpy as np
import torch

from ..config import ConfigError, DataConfig
from ..data import token_files
from .factories import call_factory


class TokenDataset(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> torch.Tensor: ...


class SyntheticTokens:
    """A deterministic, learnable stream: each sample is an arithmetic progression modulo the
    vocabulary, with a start and stride drawn from ``(seed, index)``. Loss falls quickly once the
    model infers the stride, which makes it a useful smoke signal without any data files."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, length: int = 2**40):
        self.vocab_size, self.seq_len, self.seed, self.length = vocab_size, seq_len, seed, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.vocab_size, (1,), generator=g))
        stride = int(torch.randint(1, 8, (1,), generator=g))
        return (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size


class TokenFile:
    """Non-overlapping windows of ``seq_len + 1`` tokens from a flat, memory-mapped token file: a
    directory ``data prepare`` wrote (its metadata gives the dtype and the vocabulary, checked
    against the model's) or a bare ``.bin`` of ``dtype``."""

    def __init__(
        self,
        path: str | Path,
        dtype: str,
        seq_len: int,
        vocab_size: Optional[int] = None,
        model_name: str = "the model",
    ):
        bin_path, self.meta = token_files.resolve(str(path))
        self.directory = bin_path.parent  # what data prepare wrote: the metadata and tokenizer/ beside the tokens
        if self.meta is not None:
            dtype = self.meta.dtype
            if vocab_size is not None:
                token_files.check_vocab(self.meta, vocab_size, model_name)
        self.tokens = np.memmap(bin_path, dtype=np.dtype(dtype), mode="r")
        self.seq_len = seq_len
        # Windows share their boundary token: window i's last target is window i+1's first input.
        self.length = (len(self.tokens) - 1) // seq_len
        if self.length < 1:
            raise ConfigError(
                f"data.path={str(path)!r}: {len(self.tokens)} tokens of {dtype} is shorter than one sequence "
                f"(data.seq_len={seq_len} + 1); check data.token_dtype or use a larger file"
            )

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(window)


def build_dataset(
    cfg: DataConfig, vocab_size: int, seed: int, local_path: Optional[str] = None, model_name: str = "the model"
) -> TokenDataset:
    """The dataset for ``cfg``: a custom factory, the token file (at ``local_path`` when
    ``data.path`` is remote and was copied), or the synthetic stream."""
    if cfg.factory:
        ds = call_factory(cfg.factory, "data.factory", object, cfg, vocab_size)
        missing = [m for m in ("__len__", "__getitem__") if not hasattr(ds, m)]
        if missing:
            raise ConfigError(
                f"data.factory={cfg.factory!r} returned {type(ds).__qualname__} without "
                f"{', '.join(missing)}; return a map-style dataset of token tensors"
            )
        return ds
    if cfg.source == "tokens":
        if not cfg.path:
            raise ConfigError("data.source=tokens needs data.path: set data.path to a .bin token file")
        return TokenFile(local_path or cfg.path, cfg.token_dtype, cfg.seq_len, vocab_size, model_name)
    return SyntheticTokens(vocab_size, cfg.seq_len, seed)


_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijective scramble of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Permutation:
    """A pseudo-random permutation of ``range(n)`` in O(1) memory: a balanced Feistel network
    over the smallest even-bit power of two that covers ``n`` (at most 4n), keyed by ``key``,
    with cycle walking back into range (fewer than 4 rounds of the network per index on average).
    ``perm(i)`` is computed on demand, so the cost does not grow with the dataset."""

    ROUNDS = 6

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.n, self.half, self.mask = n, bits // 2, (1 << (bits // 2)) - 1
        self.keys = [_mix64((key & _M64) * self.ROUNDS + r) for r in range(self.ROUNDS)]

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        x = i
        while True:
            left, right = x >> self.half, x & self.mask
            for k in self.keys:
                left, right = right, left ^ (_mix64(right ^ k) & self.mask)
            x = (left << self.half) | right
            if x < self.n:
                return x


class ResumableSampler:
    """Hands each rank its slice of every global batch; shuffles finite datasets per epoch.

    Global sample position ``p`` maps to dataset index ``perm(epoch)(p % len)`` with
    ``epoch = p // len``; rank ``r`` takes positions ``consumed + r*mb .. consumed + (r+1)*mb``.
    The permutation (:class:`Permutation`) is a function of the seed and the epoch alone: the
    global sample order is the same at every world size, and no rank holds an array the size of
    the dataset.
    """

    def __init__(self, dataset_len: int, seed: int, shuffle: bool):
        self.dataset_len, self.seed, self.shuffle = dataset_len, seed, shuffle
        self.consumed = 0
        self._perm_epoch, self._perm = -1, None

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, self.dataset_len)
        if not self.shuffle:
            return offset
        if epoch != self._perm_epoch:
            self._perm, self._perm_epoch = Permutation(self.dataset_len, self.seed * 1_000_003 + 7919 * epoch), epoch
        return self._perm(offset)

    def next_indices(self, rank: int, world_size: int, micro_batch: int) -> list[int]:
        base = self.consumed + rank * micro_batch
        self.consumed += world_size * micro_batch
        return [self._index(base + i) for i in range(micro_batch)]

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


class BatchLoader:
    """Rank-local micro-batches ``(inputs, targets)`` drawn through a :class:`ResumableSampler`."""

    def __init__(self, dataset: TokenDataset, cfg: DataConfig, vocab_size: int, seed: int, rank: int, world_size: int):
        self.dataset, self.cfg, self.vocab_size = dataset, cfg, vocab_size
        self.rank, self.world_size = rank, world_size
        self.sampler = ResumableSampler(len(dataset), seed, shuffle=not isinstance(dataset, SyntheticTokens))

    def next_batch(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        indices = self.sampler.next_indices(self.rank, self.world_size, self.cfg.micro_batch_size)
        samples = [self.dataset[i] for i in indices]
        for i, s in zip(indices, samples):
            self._check_sample(i, s)
        batch = torch.stack(samples).to(device=device, dtype=torch.long, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]

    def _check_sample(self, index: int, sample: torch.Tensor) -> None:
        # Checked on every sample: an out-of-range id would otherwise surface as an opaque
        # index error inside the embedding, or silently on GPU.
        expected = self.cfg.seq_len + 1
        if not isinstance(sample, torch.Tensor) or sample.dim() != 1 or sample.numel() != expected:
            shape = tuple(sample.shape) if isinstance(sample, torch.Tensor) else type(sample).__name__
            raise ConfigError(
                f"dataset sample {index} is {shape}; expected a 1-D tensor of data.seq_len + 1 = {expected} token ids"
            )
        if sample.is_floating_point():
            raise ConfigError(f"dataset sample {index} has dtype {sample.dtype}; token ids must be integers")
        top = int(sample.max())
        if top >= self.vocab_size or int(sample.min()) < 0:
            raise ConfigError(
                f"dataset sample {index} holds token id {top} outside [0, {self.vocab_size}); "
                "set model.vocab_size to cover the data, or check data.token_dtype"
            )

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
