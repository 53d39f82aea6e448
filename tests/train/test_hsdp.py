"""HSDP (``dist.shard_group_size``): a job sharded within pods and replicated across them trains,
resumes after a killed rank bitwise equal to the run without one, and its checkpoints hold each
shard once; a group that does not divide the world, or a one-file-per-rank checkpoint cut by
another group, is refused naming the key."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from resilient_fsdp.checkpoint import store
from resilient_fsdp.checkpoint.resume import check_compatible
from resilient_fsdp.config import ConfigError
from resilient_fsdp.train.distributed import shard_group_size
from tests.support import read_losses, read_summary, run_local

HSDP = ["train.steps=12", "checkpoint.interval_steps=4", "dist.shard_group_size=2"]


def test_an_hsdp_job_resumes_bitwise_after_a_killed_rank_and_writes_each_shard_once(tmp_path):
    """2 pods x 2 ranks, each pod one shard group: rank 3 killed after step 6 resumes from step 4."""
    clean, faulted = tmp_path / "clean", tmp_path / "faulted"
    ref = run_local(clean, nodes=2, nproc=2, overrides=HSDP)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = run_local(faulted, nodes=2, nproc=2, overrides=HSDP, extra=["--inject", "sigkill@7:rank=3"])
    assert run.returncode == 0, run.stderr[-3000:]
    summary = read_summary(faulted)
    assert summary["restarts"]["in_job"] == 1, summary["restarts"]
    assert summary["params_sha256"] == read_summary(clean)["params_sha256"]
    assert read_losses(faulted)[-12:] == read_losses(clean)[-12:]
    newest = max((clean / "checkpoints").glob("step_*"))
    assert json.loads((newest / store.MARKER).read_text())["shard_group_size"] == 2
    metadata = pickle.loads((newest / ".metadata").read_bytes())
    chunks = {fqn: len(md.chunks) for fqn, md in metadata.state_dict_metadata.items() if hasattr(md, "chunks")}
    # Every tensor in at most 2 chunks (its shard group's), not 4 (the world's); each written once.
    assert chunks and max(chunks.values()) == 2, chunks
    assert len({(i.fqn, tuple(i.offset)) for i in metadata.storage_data if i.offset is not None}) == sum(
        chunks.values()
    )


def test_a_shard_group_that_does_not_divide_the_world_is_refused_naming_the_key():
    assert shard_group_size(8, 0) == shard_group_size(8, 8) == 8
    assert shard_group_size(8, 4) == 4
    with pytest.raises(ConfigError, match=r"dist.shard_group_size=3 does not divide the world size of 8 ranks"):
        shard_group_size(8, 3)


def test_a_torch_async_checkpoint_cut_by_another_shard_group_is_refused(tmp_path):
    identity = {"model": "tiny", "num_params": 1, "shape_digest": "d"}
    ckpt = store.CheckpointInfo(
        4, tmp_path, {**identity, "world_size": 4, "mode": "torch-async", "shard_group_size": 2}
    )
    check_compatible(ckpt, {**identity, "shard_group_size": 2}, 4)
    with pytest.raises(
        ConfigError,
        match=r"sharded over 2 ranks; this run shards them over 4.*"
        r"dist.shard_group_size=2",
    ):
        check_compatible(ckpt, {**identity, "shard_group_size": 4}, 4)
    resharding = store.CheckpointInfo(4, tmp_path, {**ckpt.manifest, "mode": "async"})
    check_compatible(resharding, {**identity, "shard_group_size": 4}, 4)  # DCP reshards
