"""A non-finite loss: one restart from the last checkpoint, as a suspected hardware fault; the
same step non-finite again fails the job. This is the deterministic-failure rule
(:mod:`.deterministic`) with the loss as the failure and the step as the place.

The loss is all-reduced, so every rank takes this path together (:func:`stop`): the ranks whose
own loss was non-finite are recorded under ``<run_dir>/faults/non-finite/``; the first time at a
step every rank raises :class:`NonFiniteLoss` (exit :data:`.exit_codes.NON_FINITE_LOSS`, an in-job
restart), a step the job already restarted for raises :class:`RepeatedNonFiniteLoss`
(configuration-type). The trainer calls it after each step's loss.
"""

from __future__ import annotations

import math
import os
import socket
import time
from typing import TYPE_CHECKING, Callable, NoReturn, Optional

from .deterministic import RepeatedFailure, earlier
from .faults import node_index
from .ledger import FaultLedger

if TYPE_CHECKING:  # the node agent imports the resilience package without torch
    import torch


class NonFiniteLoss(BaseException):
    """The job's first non-finite loss at a step: the rank exits with the code the in-job restart
    retries. A ``BaseException``, so that in-process restart, which retries every ``Exception``,
    passes it on."""


class RepeatedNonFiniteLoss(RepeatedFailure, FloatingPointError):
    """A non-finite loss at a step where the job already restarted for one: a repeated failure,
    configuration-type (:func:`.exit_codes.is_configuration_failure`), so that no layer retries it."""


def describe_ranks(ranks: list[dict]) -> str:
    """``rank 1 (node 0, host h)``, for the ranks whose own loss was non-finite."""
    if not ranks:
        return "no rank's own loss (the sum across ranks overflowed)"
    return ", ".join(f"rank {r['rank']} (node {r['node']}, host {r['host']}, loss {r['loss']})" for r in ranks)


def non_finite_ranks(entries: list[dict]) -> list[dict]:
    """The gathered entries of the ranks whose own loss was non-finite."""
    return [e for e in entries if not math.isfinite(e["loss"])]


def earlier_at_step(records: list[dict], step: int) -> list[dict]:
    """The records of ``records`` (oldest first) at ``step`` since the last one that failed the
    job: non-empty means the job already restarted for a non-finite loss at this step."""
    return earlier([{**r, "where": f"step {r['step']}"} for r in records], f"step {step}", None)


def repeated_message(step: int, loss: float, earlier: list[dict], now: list[dict]) -> str:
    times = "; ".join(f"attempt {i + 1}: {describe_ranks(r['ranks'])}" for i, r in enumerate(earlier))
    return (
        f"loss is {loss} at step {step} again after a restart from the last checkpoint ({times}; attempt "
        f"{len(earlier) + 1}: {describe_ranks(now)}). The same step twice is no transient fault. The same rank "
        "or node each time: suspect its GPU: cordon the node (`kubectl get pod POD -o wide` names it, then "
        "`kubectl cordon NODE`) and start the job again. Otherwise: lower optim.lr, check the data this step "
        "reads, or set optim.grad_clip"
    )


def gather(local_loss: float, rank: int) -> list[dict]:
    """Collective: every rank's own loss, node (pod) index and host, in rank order."""
    import torch.distributed as dist

    entries: list[Optional[dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(
        entries,
        {
            "rank": rank,
            "node": node_index(),
            "host": socket.gethostname(),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "loss": local_loss,
        },
    )
    return entries


def stop(
    step: int, loss: float, local_loss: torch.Tensor, rank: int, ledger: FaultLedger, log: Callable[[dict, str], None]
) -> NoReturn:
    """Every rank, when step ``step``'s global ``loss`` is non-finite: find the ranks, record and
    log it (rank 0), and raise :class:`NonFiniteLoss` or :class:`RepeatedNonFiniteLoss`.

    A NaN on hundreds of GPUs is as likely a GPU computing wrong values as a learning rate or data
    problem; the restart tells them apart, since the data and schedule replay exactly.
    :class:`NonFiniteLoss` passes through in-process restart (it would keep the same processes, CUDA
    context and memory). Only records since the last failure count: a job started again after one
    gets its one restart at that step again.
    """
    # Read before the collective, which every write follows: every rank decides on the same records.
    records = ledger.non_finite()
    earlier = earlier_at_step(records, step)
    ranks = non_finite_ranks(gather(float(local_loss), rank))
    repeated = bool(earlier)
    record = {
        "step": step,
        "loss": loss,
        "t": time.time(),
        "ranks": ranks,
        "outcome": "failed" if repeated else "restart",
    }
    if repeated:
        message = repeated_message(step, loss, earlier, ranks)
    else:
        message = (
            f"loss is {loss} at step {step}, own loss non-finite on {describe_ranks(ranks)}: suspected "
            "hardware fault; restarting from the last checkpoint (in-job). The same step non-finite again "
            "fails the job"
        )
    path = ledger.record_non_finite(record, sum(1 for r in records if r["step"] == step))
    if rank == 0:
        log({"event": "non_finite_loss", **record, "record": str(path)}, message)
    if repeated:
        raise RepeatedNonFiniteLoss(message)
    raise NonFiniteLoss(message)
