"""A restore from memory into a new process's optimizer: its moments are allocated empty in the
snapshot's shapes (no initialising step on zero gradients), filled by the copy, and end equal to
the saved optimizer bit for bit; a snapshot naming a parameter the model lacks changes nothing."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from resilient_fsdp.checkpoint.memory.tier import allocate_optimizer_state
from resilient_fsdp.checkpoint.memory.values import TensorPlace, without_tensors
from resilient_fsdp.checkpoint.staging import local_tensors
from tests.checkpoint.memory_support import trained


def test_the_moments_are_allocated_in_the_snapshots_shapes_and_the_copy_makes_them_equal():
    model, optimizer = trained()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    saved = {"model": model_sd, "optim": optim_sd}
    values, views = without_tensors(saved), [t.clone() for t in local_tensors(saved)]
    assert isinstance(values["optim"]["state"]["0.weight"]["exp_avg"], TensorPlace)

    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    assert allocate_optimizer_state(model, fresh, values, views)

    def no_step(*_args, **_kwargs):
        raise AssertionError("get_state_dict initialised the optimizer with a step")

    fresh.step = no_step  # what get_state_dict calls on an optimizer without state
    live_model, live_optim = get_state_dict(model, fresh)
    live = local_tensors({"model": live_model, "optim": live_optim})
    assert [(t.shape, t.dtype) for t in live] == [(t.shape, t.dtype) for t in views]
    for dst, src in zip(live, views):
        dst.copy_(src)
    set_state_dict(model, fresh, model_state_dict=live_model, optim_state_dict=live_optim)
    for p in model.parameters():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(fresh.state[p][key], optimizer.state[p][key]), key


def test_a_snapshot_of_another_model_allocates_nothing():
    model, optimizer = trained()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    saved = {"model": model_sd, "optim": {**optim_sd, "state": {"other.weight": optim_sd["state"]["0.weight"]}}}
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert not allocate_optimizer_state(model, fresh, without_tensors(saved), local_tensors(saved))
    assert not fresh.state
