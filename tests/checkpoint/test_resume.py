"""Resume: a corrupted newest checkpoint caught and passed over, a rewind (`resume_from`) applied
at the job's first start, random streams restored exactly, another world size keeping the
global batch or training on at the nearest one (``train.elastic_batch``), and a second job
refused the same directory. Real processes (gloo on CPU)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.support import assert_no_leftovers, read_losses, read_summary, run_local, run_trainer, write_module


def test_a_flipped_byte_in_the_newest_checkpoint_is_caught_and_resume_ends_bitwise_equal(tmp_path):
    common = ["train.steps=12", "checkpoint.interval_steps=4"]
    reference = run_trainer(tmp_path / "ref", common)
    assert reference.returncode == 0, reference.stderr
    first = run_trainer(tmp_path, common + ["train.stop_at_step=8"])
    assert first.returncode == 0, first.stderr
    newest = tmp_path / "checkpoints" / "step_00000008"
    largest = max((p for p in newest.iterdir() if p.name != "COMPLETE"), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x10  # same size, one bit
    largest.write_bytes(bytes(data))
    second = run_trainer(tmp_path, common)
    assert second.returncode == 0, second.stderr
    assert f"integrity check failed: {largest.name}: crc32c" in second.stdout, second.stdout[-3000:]
    assert "resumed from step 4" in second.stdout
    assert read_summary(tmp_path)["params_sha256"] == read_summary(tmp_path / "ref")["params_sha256"]
    assert read_losses(tmp_path) == read_losses(tmp_path / "ref")
    # The corrupted commit was moved aside by the new step 8, not deleted.
    assert list((tmp_path / "checkpoints").glob("step_00000008.superseded-*"))


def test_a_resume_reads_the_commits_index_of_the_metadata_and_each_rank_plans_its_load_alone(tmp_path):
    """The commit writes the metadata's index beside DCP's ``.metadata``, checksummed with every
    file; a resume at 2 real ranks loads through it: with ``.metadata`` moved away it still ends
    bitwise equal to the run without a stop (and with the index moved away, from ``.metadata``)."""
    common = ["train.steps=12", "checkpoint.interval_steps=4", "checkpoint.verify=never"]
    reference = run_local(tmp_path / "ref", nodes=1, nproc=2, overrides=common)
    assert reference.returncode == 0, reference.stderr[-3000:]
    for moved in (".metadata", ".metadata-index"):
        run_dir = tmp_path / moved
        first = run_local(run_dir, nodes=1, nproc=2, overrides=common + ["train.stop_at_step=8"])
        assert first.returncode == 0, first.stderr[-3000:]
        newest = run_dir / "checkpoints" / "step_00000008"
        checksums = json.loads((newest / "COMPLETE").read_text())["checksums"]
        assert {".metadata", ".metadata-index"} <= set(checksums)
        (newest / moved).rename(run_dir / moved)
        second = run_local(run_dir, nodes=1, nproc=2, overrides=common)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        assert "resumed from step 8" in second.stdout
        assert read_losses(run_dir) == read_losses(tmp_path / "ref")
        assert read_summary(run_dir)["params_sha256"] == read_summary(tmp_path / "ref")["params_sha256"]


def test_resume_from_applies_to_the_jobs_first_start_and_survives_retention_deleting_its_target(tmp_path):
    common = ["train.steps=20", "checkpoint.interval_steps=4"]
    first = run_trainer(tmp_path, common + ["checkpoint.job_id=job-a", "checkpoint.keep_last=0"], timeout=300)
    assert first.returncode == 0, first.stderr
    ckpts = tmp_path / "checkpoints"
    target = ckpts / "step_00000008"
    # The documented rewind: a step_N inside the job's own checkpoint.dir, with retention on.
    rewind = common + [
        f"checkpoint.resume_from={target}",
        "checkpoint.job_id=job-b",
        "checkpoint.keep_last=2",
        f"checkpoint.dir={ckpts}",
    ]
    second = run_trainer(tmp_path / "b", rewind + ["train.stop_at_step=16"], timeout=300)
    assert second.returncode == 0, second.stderr
    assert "resumed from step 8" in second.stdout
    aside = sorted(p.name.split(".")[0] for p in ckpts.glob("*.abandoned-*"))
    assert aside == ["step_00000012", "step_00000016", "step_00000020"]
    # Steps 12 and 16 committed: retention deleted the target like any older checkpoint.
    assert sorted(p.name for p in ckpts.glob("step_????????")) == ["step_00000012", "step_00000016"]
    # A restart of job b (the same job id) resumes from its own newest checkpoint, step 16, without
    # reading the deleted target, and never from the abandoned timeline's steps.
    third = run_trainer(tmp_path / "b", rewind, timeout=300)
    assert third.returncode == 0, third.stderr
    assert "applied at this job's first start" in third.stdout and "resumed from step 16" in third.stdout
    assert read_summary(tmp_path / "b")["params_sha256"] == read_summary(tmp_path)["params_sha256"]
    assert len(list(ckpts.glob("*.abandoned-*"))) == 3  # never deleted


RANDOM_DATA = """
import random
import numpy as np
import torch


class RandomCrops:
    # Windows at random offsets: each sample draws from Python's random and NumPy's generator.
    def __init__(self, vocab, seq_len):
        self.vocab, self.seq_len = vocab, seq_len

    def __len__(self):
        return 10_000

    def __getitem__(self, index):
        start = random.randrange(self.vocab) + int(np.random.randint(0, 7))
        return (start + index + torch.arange(self.seq_len + 1)) % self.vocab


def build(cfg, vocab_size):
    return RandomCrops(vocab_size, cfg.seq_len)
"""


def test_python_and_numpy_random_streams_resume_exactly(tmp_path, plugin_dir):
    write_module(plugin_dir, "random_data", RANDOM_DATA)
    common = ["train.steps=10", "checkpoint.interval_steps=5", "data.factory=random_data:build"]
    ref = run_trainer(tmp_path / "ref", common, pythonpath=[plugin_dir])
    assert ref.returncode == 0, ref.stderr
    first = run_trainer(tmp_path, common + ["train.stop_at_step=5"], pythonpath=[plugin_dir])
    assert first.returncode == 0, first.stderr
    second = run_trainer(tmp_path, common, pythonpath=[plugin_dir])
    assert second.returncode == 0, second.stderr
    assert read_losses(tmp_path) == read_losses(tmp_path / "ref")
    assert read_summary(tmp_path)["params_sha256"] == read_summary(tmp_path / "ref")["params_sha256"]


@pytest.mark.timeout(360)
def test_a_world_that_cannot_make_the_global_batch_trains_on_at_the_nearest_or_is_refused(tmp_path):
    """3 ranks x 1 sample x accum 3 (9 a step), then 2 ranks, which cannot make 9: ``exact``
    refuses, ``nearest`` trains on at 8 (accum 4; 8 and 10 tie, the smaller wins)."""
    three = run_local(
        tmp_path,
        nodes=1,
        nproc=3,
        overrides=["train.steps=8", "train.stop_at_step=4", "data.micro_batch_size=1", "train.grad_accum_steps=3"],
    )
    assert three.returncode == 0, three.stdout + three.stderr
    refused = run_trainer(
        tmp_path, ["train.steps=8", "data.micro_batch_size=2", "train.grad_accum_steps=3", "train.elastic_batch=exact"]
    )
    assert refused.returncode == 2
    assert (
        "train.elastic_batch=exact: cannot keep the global batch of 9 samples per step" in refused.stderr
        and "train.grad_accum_steps" in refused.stderr
        and "data.micro_batch_size" in refused.stderr
        and "train.elastic_batch=nearest" in refused.stderr
    ), refused.stderr[-2000:]
    two = run_local(
        tmp_path, nodes=1, nproc=2, overrides=["train.steps=8", "data.micro_batch_size=1", "train.grad_accum_steps=3"]
    )
    assert two.returncode == 0, two.stdout + two.stderr
    assert "resharded from world size 3 to 2; RNG streams start fresh" in two.stdout
    assert (
        "train.grad_accum_steps=4 instead of 3: global batch 8 samples per step instead of the run's 9 "
        "(train.elastic_batch=nearest" in two.stdout
    ), two.stdout[-3000:]
    steps = [
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"event": "step"' in line
    ]
    assert [(s["step"], s["global_batch"]) for s in steps] == [(n, 9 if n <= 4 else 8) for n in range(1, 9)]
    assert all(s["tokens"] == s["global_batch"] * 64 for s in steps)
    summary = read_summary(tmp_path)
    assert (summary["global_batch"], summary["global_batch_target"]) == (8, 9)
    assert summary["tokens_seen"] == (4 * 9 + 4 * 8) * 64
    # The run's target travels in the checkpoint, so a later start at 3 (or 1, or 9) ranks regains it.
    manifest = json.loads((tmp_path / "checkpoints" / "step_00000008" / "COMPLETE").read_text())
    assert (manifest["global_batch_target"], manifest["grad_accum_steps"], manifest["world_size"]) == (9, 4, 2)
    assert_no_leftovers(tmp_path)


def test_a_second_job_on_the_same_checkpoint_dir_is_refused_naming_the_first(tmp_path):
    shared = tmp_path / "shared"
    first = run_trainer(tmp_path / "a", ["train.steps=2", f"checkpoint.dir={shared}", "checkpoint.job_id=job-a"])
    assert first.returncode == 0, first.stderr
    # job-a ended cleanly and released the lease; pretend it is still running by holding it here.
    from resilient_fsdp.checkpoint.lease import Lease

    holder = Lease(shared, "job-a", print)
    holder.acquire()
    try:
        second = run_trainer(tmp_path / "b", ["train.steps=2", f"checkpoint.dir={shared}", "checkpoint.job_id=job-b"])
    finally:
        holder.release()
    assert second.returncode == 2
    assert f"checkpoint.dir='{shared}' is in use by job 'job-a'" in second.stderr, second.stderr[-2000:]
    third = run_trainer(tmp_path / "b", ["train.steps=2", f"checkpoint.dir={shared}", "checkpoint.job_id=job-b"])
    assert third.returncode == 0, third.stderr
    shutil.rmtree(shared)
