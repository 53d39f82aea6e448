"""The global batch (samples per optimizer step) at a world size: ``train.elastic_batch``.

A run's target global batch is set at its first start (world size x ``data.micro_batch_size`` x
``train.grad_accum_steps``) and carried in every checkpoint's manifest; a resume at another world
size chooses ``grad_accum_steps`` by the policy (:func:`choose`, :func:`at_resume`). The trainer
hands :func:`at_resume` to the checkpointer, which calls it for the checkpoint it resumes from.
Pure functions, no torch, so ``resilient-fsdp`` commands and tests use them without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import ConfigError

POLICIES = ("nearest", "exact")
KEY = "train.elastic_batch"


@dataclass(frozen=True)
class Choice:
    """What a world size trains with."""

    grad_accum_steps: int
    global_batch: int
    target: int

    @property
    def exact(self) -> bool:
        return self.global_batch == self.target


def choose(target: int, world_size: int, micro_batch: int, policy: str, where: str = "") -> Choice:
    """``grad_accum_steps`` for ``world_size`` under ``policy``, or the ConfigError of ``exact``.
    ``where``: how the caller names the target's origin in that error (e.g. the checkpoint's shape).

    ``exact``: the target exactly, or the start is refused (naming the key and the world sizes that
    keep it); ``nearest``: the target exactly when the ranks can make it, otherwise the nearest
    global batch they can (accum >= 1)."""
    if policy not in POLICIES:
        raise ConfigError(f"{KEY}={policy!r}: choose one of {', '.join(POLICIES)}")
    if min(target, world_size, micro_batch) < 1:
        raise ValueError(f"global batch {target}, world size {world_size}, micro-batch {micro_batch}")
    per_accum = world_size * micro_batch
    below = target // per_accum
    if below * per_accum == target:
        return Choice(below, target, target)
    if policy == "exact":
        raise ConfigError(exact_refusal(target, world_size, micro_batch, where))
    if below == 0:  # more ranks x micro-batch than the target: one micro-batch each is the least
        return Choice(1, per_accum, target)
    # Ties go below: the smaller accum keeps a step no longer than at the target's world size, so
    # the step timeouts hang detection learned there stay valid.
    accum = below if target - below * per_accum <= (below + 1) * per_accum - target else below + 1
    return Choice(accum, accum * per_accum, target)


def keeping_sizes(target: int, micro_batch: int, limit: int = 12) -> list[int]:
    """World sizes whose ranks x ``micro_batch`` divide ``target`` (the first ``limit``)."""
    if target % micro_batch:
        return []
    samples = target // micro_batch
    return [w for w in range(1, samples + 1) if samples % w == 0][:limit]


def exact_refusal(target: int, world_size: int, micro_batch: int, where: str = "") -> str:
    fits = keeping_sizes(target, micro_batch)
    nearest = choose(target, world_size, micro_batch, "nearest")
    origin = f" ({where})" if where else ""
    sizes = (
        f"Resume at a world size in {fits}"
        if fits
        else f"No world size keeps it with data.micro_batch_size={micro_batch}"
    )
    return (
        f"{KEY}=exact: cannot keep the global batch of {target} samples per step{origin} at world size "
        f"{world_size}: {world_size} ranks x data.micro_batch_size={micro_batch} does not divide {target}, "
        f"so no train.grad_accum_steps does. {sizes}, set data.micro_batch_size so that world size x "
        f"data.micro_batch_size divides {target}, or set {KEY}=nearest to train on with the nearest global "
        f"batch the ranks can make ({nearest.global_batch} at train.grad_accum_steps="
        f"{nearest.grad_accum_steps})"
    )


def at_resume(manifest: dict, world_size: int, batch: dict, policy: str) -> Optional[Choice]:
    """The batch a resume from a checkpoint with ``manifest`` trains with at ``world_size``;
    ``batch``: this run's ``grad_accum_steps`` and ``micro_batch_size``. None: the configuration
    as it is (the checkpoint was at its target at this world size, so ``train.grad_accum_steps``
    can change between runs, or it has no batch records). One trained off its target (after a
    ``nearest`` choice) goes back towards it, e.g. when the lost nodes return."""
    w0, a0, mb0 = manifest.get("world_size"), manifest.get("grad_accum_steps"), manifest.get("micro_batch_size")
    mb = batch.get("micro_batch_size")
    if None in (w0, a0, mb0, mb, batch.get("grad_accum_steps")):
        return None
    trained = w0 * a0 * mb0
    target = int(manifest.get("global_batch_target") or trained)
    if w0 == world_size and trained == target:
        return None
    where = (
        f"the checkpoint's: world size {w0} x train.grad_accum_steps={a0} x data.micro_batch_size={mb0}"
        if trained == target
        else f"the run's target; the checkpoint was trained at {trained}"
    )
    return choose(target, world_size, micro_batch=mb, policy=policy, where=where)
