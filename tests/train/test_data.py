"""Datasets and the resumable sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from resilient_fsdp.config import ConfigError, DataConfig
from resilient_fsdp.train.data import (
    BatchLoader,
    Permutation,
    ResumableSampler,
    SyntheticTokens,
    TokenFile,
    build_dataset,
)
from resilient_fsdp.train.global_batch import choose


def test_synthetic_is_deterministic_and_in_range():
    a, b = SyntheticTokens(256, 32, seed=1), SyntheticTokens(256, 32, seed=1)
    assert torch.equal(a[5], b[5]) and a[5].shape == (33,)
    assert not torch.equal(a[5], SyntheticTokens(256, 32, seed=2)[5])
    assert int(a[123].max()) < 256 and int(a[123].min()) >= 0


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows(tmp_path, dtype):
    ids = np.arange(1, 42, dtype=dtype) * (3 if dtype == "uint32" else 1)
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    ds = TokenFile(path, dtype, seq_len=8)
    assert len(ds) == (41 - 1) // 8
    assert ds[1].tolist() == ids[8:17].astype(np.int64).tolist()
    assert ds[1].dtype == torch.int64


def test_token_file_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="data.path"):
        TokenFile(tmp_path / "missing.bin", "uint16", 8)
    short = tmp_path / "short.bin"
    np.arange(4, dtype=np.uint16).tofile(short)
    with pytest.raises(ConfigError, match="shorter than one sequence"):
        TokenFile(short, "uint16", 8)
    with pytest.raises(ConfigError, match="data.source=tokens needs data.path"):
        build_dataset(DataConfig(source="tokens"), 256, 0)


def test_sampler_partitions_each_global_batch_across_ranks():
    world, mb = 4, 3
    samplers = [ResumableSampler(1000, seed=0, shuffle=True) for _ in range(world)]
    seen = []
    for _ in range(5):
        for rank, s in enumerate(samplers):
            seen += s.next_indices(rank, world, mb)
    assert len(seen) == len(set(seen)) == 5 * world * mb
    assert all(s.consumed == 5 * world * mb for s in samplers)


def test_sampler_resume_continues_exactly_even_at_another_world_size():
    full = ResumableSampler(50, seed=3, shuffle=True)
    stream = [i for _ in range(30) for i in full.next_indices(0, 1, 2)]  # crosses an epoch boundary
    first = ResumableSampler(50, seed=3, shuffle=True)
    head = [i for _ in range(10) for i in first.next_indices(0, 1, 2)]
    resumed = [ResumableSampler(50, seed=3, shuffle=True) for _ in range(2)]
    for r in resumed:
        r.load_state_dict(first.state_dict())
    tail = []
    for _ in range(20):
        step = [resumed[rank].next_indices(rank, 2, 1) for rank in range(2)]
        tail += step[0] + step[1]
    assert head + tail == stream
    assert sorted(stream[:50]) == list(range(50))  # an epoch is a permutation


def test_loader_rejects_out_of_vocab_tokens(tmp_path):
    path = tmp_path / "tokens.bin"
    np.full(100, 300, dtype=np.uint16).tofile(path)
    cfg = DataConfig(source="tokens", path=str(path), seq_len=8, micro_batch_size=2)
    loader = BatchLoader(build_dataset(cfg, 256, 0), cfg, vocab_size=256, seed=0, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="token id 300 outside"):
        loader.next_batch(torch.device("cpu"))


def test_the_sampler_shuffles_any_dataset_in_constant_memory():
    """A full randperm per epoch would need 8 bytes a sample on every rank (here 8 TiB)."""
    huge = ResumableSampler(2**40, seed=1, shuffle=True)
    first = huge.next_indices(0, 4, 8)
    assert len(set(first)) == 8 and all(0 <= i < 2**40 for i in first)
    for n in (1, 2, 3, 97, 1000):  # a permutation of range(n), different per epoch and seed
        perm = Permutation(n, 7)
        assert sorted(perm(i) for i in range(n)) == list(range(n))
    assert [Permutation(50, 1)(i) for i in range(50)] != [Permutation(50, 2)(i) for i in range(50)]


@pytest.mark.parametrize("before, after", [(1, 4), (4, 3), (2, 5)])
def test_the_global_sample_order_is_the_same_at_every_world_size(before, after):
    mb = 3

    def stream(world, start, steps):
        samplers = [ResumableSampler(101, seed=5, shuffle=True) for _ in range(world)]
        for s in samplers:
            s.load_state_dict({"consumed": start})
        out = []
        for _ in range(steps):
            for rank, s in enumerate(samplers):
                out += s.next_indices(rank, world, mb)
        return out, samplers[0].state_dict()

    reference, _ = stream(1, 0, 60 * before * after)
    head, state = stream(before, 0, 20 * after)
    tail, _ = stream(after, state["consumed"], 20 * before)
    assert head + tail == reference[: len(head) + len(tail)]


def test_a_resume_whose_global_batch_changes_neither_repeats_nor_skips_samples():
    """The sampler's state is samples consumed, not steps: 4 ranks x accum 2 (8 a step), then 3
    ranks at the batch train.elastic_batch=nearest chooses for them (accum 3, 9 a step)."""
    mb, steps = 1, 7

    def train(world, accum, start, n):
        samplers = [ResumableSampler(61, seed=2, shuffle=True) for _ in range(world)]
        for s in samplers:
            s.load_state_dict({"consumed": start})
        out = []
        for _ in range(n):
            for _ in range(accum):  # each micro-batch: every rank takes its slice
                for rank, s in enumerate(samplers):
                    out += s.next_indices(rank, world, mb)
        assert len({s.consumed for s in samplers}) == 1  # the ranks agree on the position
        return out, samplers[0].state_dict()

    choice = choose(8, 3, mb, "nearest")
    assert (choice.grad_accum_steps, choice.global_batch) == (3, 9)
    head, state = train(4, 2, 0, steps)
    tail, end = train(3, choice.grad_accum_steps, state["consumed"], steps)
    reference, _ = train(1, 1, 0, 8 * steps + 9 * steps)
    assert head + tail == reference
    assert end["consumed"] == 8 * steps + 9 * steps
