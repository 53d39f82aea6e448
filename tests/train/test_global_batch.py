"""The ``train.elastic_batch`` policy (pure functions, no processes): the global batch a world size
trains with, ties, the refusal of ``exact``, what a resume chooses from a checkpoint's manifest, and
the world sizes of a planned range it cannot serve."""

from __future__ import annotations

import pytest

from resilient_fsdp.config import ConfigError, load_config
from resilient_fsdp.train.global_batch import at_resume, choose, keeping_sizes


@pytest.mark.parametrize(
    "world, accum, batch",
    [(512, 1, 512), (504, 1, 504), (496, 1, 496), (256, 2, 512), (1024, 1, 1024), (300, 2, 600), (100, 5, 500)],
)
def test_nearest_keeps_the_target_when_it_can_else_the_nearest_the_ranks_make(world, accum, batch):
    choice = choose(512, world, 1, "nearest")
    assert (choice.grad_accum_steps, choice.global_batch, choice.target) == (accum, batch, 512)
    assert choice.exact == (batch == 512)


def test_a_tie_goes_to_the_smaller_batch():
    # 12 samples at 8 ranks: 8 (accum 1) and 16 (accum 2) are both 4 away.
    assert (choose(12, 8, 1, "nearest").grad_accum_steps, choose(12, 8, 1, "nearest").global_batch) == (1, 8)
    # 6 samples at 1 rank x 4: 4 and 8 are both 2 away.
    assert choose(6, 1, 4, "nearest").global_batch == 4
    # Not a tie: 9 is nearer to 8 than 6 is.
    assert choose(8, 3, 1, "nearest").global_batch == 9


def test_exact_keeps_the_target_or_refuses_naming_the_key_and_the_sizes_that_work():
    assert choose(512, 256, 1, "exact").grad_accum_steps == 2
    with pytest.raises(ConfigError) as refused:
        choose(512, 496, 1, "exact", where="the checkpoint's")
    message = str(refused.value)
    assert "train.elastic_batch=exact" in message and "train.elastic_batch=nearest" in message
    assert "world size 496" in message and "512 samples per step (the checkpoint's)" in message
    assert "[1, 2, 4, 8, 16, 32, 64, 128, 256, 512]" in message and "(496 at train.grad_accum_steps=1)" in message
    assert "data.micro_batch_size" in message and "train.grad_accum_steps" in message
    with pytest.raises(ConfigError, match="train.elastic_batch='half'"):
        choose(512, 496, 1, "half")


def test_keeping_sizes_are_the_divisors_in_micro_batches():
    assert keeping_sizes(24, 2) == [1, 2, 3, 4, 6, 12]
    assert keeping_sizes(6, 4) == []


def _manifest(world, accum, mb, target=None):
    m = {"world_size": world, "grad_accum_steps": accum, "micro_batch_size": mb}
    return m if target is None else {**m, "global_batch_target": target}


def test_a_resume_goes_back_to_the_runs_target_after_a_nearest_choice():
    batch = {"grad_accum_steps": 1, "micro_batch_size": 1}
    shrunk = at_resume(_manifest(512, 1, 1), 496, batch, "nearest")
    assert (shrunk.global_batch, shrunk.target) == (496, 512)
    # Saved at 496 ranks off the target: the same world keeps the nearest batch, 512 ranks regain it.
    again = at_resume(_manifest(496, 1, 1, target=512), 496, batch, "nearest")
    assert (again.global_batch, again.target) == (496, 512)
    regrown = at_resume(_manifest(496, 1, 1, target=512), 512, batch, "nearest")
    assert (regrown.grad_accum_steps, regrown.global_batch, regrown.exact) == (1, 512, True)
    # At its target, at the same world size: the configuration as it is (accum may be changed).
    assert (
        at_resume(_manifest(512, 1, 1, target=512), 512, {"grad_accum_steps": 2, "micro_batch_size": 1}, "exact")
        is None
    )
    # A checkpoint without batch records (written before they were): nothing to choose.
    assert at_resume({"world_size": 4}, 3, batch, "exact") is None
    with pytest.raises(ConfigError, match="the run's target; the checkpoint was trained at 496"):
        at_resume(_manifest(496, 1, 1, target=512), 504, batch, "exact")


def test_nearest_serves_a_world_above_the_targets_with_one_micro_batch_a_rank():
    assert choose(512, 528, 1, "nearest").global_batch == 528


def test_the_policy_is_a_train_key_defaulting_to_nearest():
    assert load_config(None, []).train.elastic_batch == "nearest"
    assert load_config(None, ["train.elastic_batch=exact"]).train.elastic_batch == "exact"
    with pytest.raises(ConfigError, match="train.elastic_batch"):
        load_config(None, ["train.elastic_batch=half"])
