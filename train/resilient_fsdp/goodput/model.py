"""The closed-form goodput model behind ``advise``, the values profiles and ``simulate``.

A job trains ``T`` seconds, stalls ``delta`` while the state is staged, and commits after a
background write of ``W``; failures are Poisson with the job's MTBF ``M`` (a node's over the node
count). A failure costs the work since the newest committed checkpoint (half an interval plus
``W``) and the restart ``R``, so to first order ``goodput = T / (T + delta) * (1 - (R + W +
(T + delta) / 2) / M)``. Intervals: Young's ``sqrt(2 delta M)`` and Daly's refinement, never
below ``W`` (a save waits for the previous write). Hot spares are busy like an M/G/inf queue's
servers fed by the node losses a spare can take (pod 0's cannot): Poisson with mean
``m = rate x r``, so a loss finds one free with probability ``P(Poisson(m) < S)``, an upper bound
on the share left without one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

HOUR = 3600.0

# Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4): 466 job interruptions in a
# 54-day snapshot of pre-training on 16,384 H100 GPUs (419 of them unexpected).
LLAMA3_INTERRUPTIONS = 466
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
LLAMA3_SOURCE = (
    "Llama 3 (Meta, 2024): 466 interruptions in 54 days on 16,384 H100 GPUs, i.e. one per {gpu_hours:,.0f} GPU-hours"
)


def llama3_gpu_mtbf_hours() -> float:
    """Mean GPU-hours between interruptions in the Llama 3 pre-training run (~45,600 h)."""
    return LLAMA3_DAYS * 24 * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS


def node_mtbf_hours(gpus_per_node: int) -> float:
    """A node's MTBF from the Llama 3 rate, scaled by the GPUs it holds (at least one)."""
    return llama3_gpu_mtbf_hours() / max(gpus_per_node, 1)


# Meta's research clusters (Kokolis et al., "Revisiting Reliability in Large-Scale Machine
# Learning Research Clusters", HPCA 2025): RSC-1, 16,384 A100 GPUs at 8 a node, 6.50 failures per
# 1,000 node-days over 11 months of every job's failures. About 1.5x Llama 3's rate per GPU.
RSC_FAILURES_PER_1000_NODE_DAYS = 6.50
RSC_GPUS_PER_NODE = 8
RSC_SOURCE = "Meta RSC-1 (Kokolis et al., HPCA 2025): 6.50 failures per 1,000 node-days of 8 A100 GPUs"


def rsc_gpu_mtbf_hours() -> float:
    """Mean GPU-hours between failures on Meta's RSC-1 (~29,500 h)."""
    return 1000 * 24 * RSC_GPUS_PER_NODE / RSC_FAILURES_PER_1000_NODE_DAYS


def rsc_node_mtbf_hours(gpus_per_node: int) -> float:
    """A node's MTBF from RSC-1's rate, scaled by the GPUs it holds (at least one)."""
    return rsc_gpu_mtbf_hours() / max(gpus_per_node, 1)


def young_interval(delta_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval: sqrt(2 * delta * M)."""
    return math.sqrt(2.0 * delta_s * mtbf_s)


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly's higher-order interval; equals M when the stall is at least 2M."""
    if delta_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = delta_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta_s


@dataclass(frozen=True)
class GoodputBreakdown:
    """Expected fractions of wall time (they add up to 1)."""

    productive: float
    checkpoint_stalls: float
    lost_work: float
    restarts: float

    def as_dict(self) -> dict:
        return {
            "productive": self.productive,
            "checkpoint_stalls": self.checkpoint_stalls,
            "lost_work": self.lost_work,
            "restarts": self.restarts,
        }


def expected_goodput(
    interval_s: float, delta_s: float, write_s: float, restart_s: float, mtbf_s: float
) -> GoodputBreakdown:
    """First-order expected goodput and where the rest goes (valid while T + R << M).

    Per unit of wall time, failures take ``(R + W + (T + delta)/2) / M``; the rest is split
    between training and stalls in the ratio ``T : delta``.
    """
    lost_per_failure = write_s + (interval_s + delta_s) / 2.0
    failure_share = min(1.0, (restart_s + lost_per_failure) / mtbf_s)
    running = 1.0 - failure_share
    cycle = interval_s + delta_s
    return GoodputBreakdown(
        productive=running * interval_s / cycle,
        checkpoint_stalls=running * delta_s / cycle,
        lost_work=failure_share * (lost_per_failure / (restart_s + lost_per_failure)),
        restarts=failure_share * (restart_s / (restart_s + lost_per_failure)),
    )


def poisson_quantile(mean: float, probability: float = 0.99) -> int:
    """The smallest k with P(X <= k) >= probability for X ~ Poisson(mean)."""
    if mean <= 0:
        return 0
    # Terms in log space: exp(-mean) underflows for means past ~745.
    k, log_term = 0, -mean
    total = math.exp(log_term)
    while total < probability:
        k += 1
        log_term += math.log(mean / k)
        total += math.exp(log_term)
    return k


def expected_goodput_with_memory(
    interval_s: float,
    delta_s: float,
    write_s: float,
    restart_s: float,
    mtbf_s: float,
    memory_interval_s: float,
    memory_delta_s: float,
    memory_restart_s: float,
    coverage: float,
) -> GoodputBreakdown:
    """:func:`expected_goodput` with a memory tier: between durable checkpoints, one in the pods'
    memory every ``memory_interval_s`` seconds of training (stall ``memory_delta_s``; its commit
    follows the copy off the training thread, so it adds no write time), restored after the
    share ``coverage`` of failures the pods survive (a crash, a hang, an error the in-job restart
    handles) in ``memory_restart_s``; the other failures go back to the durable checkpoint.

    Per covered failure: ``R_m + (T_m + delta_m) / 2``; per other failure: ``R + W + (T + delta) / 2``.
    A durable interval holds ``T / T_m - 1`` memory saves (the durable save takes the last slot).
    """
    lost_memory = (memory_interval_s + memory_delta_s) / 2.0
    lost_durable = write_s + (interval_s + delta_s) / 2.0
    lost = coverage * lost_memory + (1.0 - coverage) * lost_durable
    restart = coverage * memory_restart_s + (1.0 - coverage) * restart_s
    failure_share = min(1.0, (lost + restart) / mtbf_s)
    running = 1.0 - failure_share
    memory_saves = max(0.0, interval_s / memory_interval_s - 1.0)
    stalls = delta_s + memory_saves * memory_delta_s
    cycle = interval_s + stalls
    return GoodputBreakdown(
        productive=running * interval_s / cycle,
        checkpoint_stalls=running * stalls / cycle,
        lost_work=failure_share * lost / (lost + restart),
        restarts=failure_share * restart / (lost + restart),
    )


SPARE_JOIN_S = 1.0
"""What a standby pod adds to an in-job restart when it takes a lost node's rank: NVRx's
``last_call_timeout``, the rendezvous's wait for more agents once it has enough."""


def busy_spares_mean(nodes: int, node_mtbf_s: float, node_loss_share: float, replacement_s: float) -> float:
    """``m``: the mean number of spares waiting for their replacement, ``rate x r``, the rate being
    that of the node losses a spare can take (``nodes - 1``: pod 0 hosts the rendezvous store, and
    its loss is a job-level restart)."""
    return max(nodes - 1, 0) * node_loss_share / node_mtbf_s * replacement_s


def poisson_tail(k: int, mean: float) -> float:
    """``P(X >= k)`` for ``X ~ Poisson(mean)``."""
    if k <= 0:
        return 1.0
    if mean <= 0:
        return 0.0
    # Sum the k terms below k in log space (exp(-mean) underflows past ~745), then complement.
    log_term, below = -mean, 0.0
    for i in range(k):
        if i:
            log_term += math.log(mean / i)
        below += math.exp(log_term)
    return max(0.0, 1.0 - below)


def p_no_spare(spares: int, busy_mean: float) -> float:
    """The probability a node loss finds every one of ``spares`` busy: ``P(Poisson(m) >= S)``."""
    return poisson_tail(spares, busy_mean)


def spares_needed(busy_mean: float, max_p_no_spare: float = 0.01) -> int:
    """The smallest ``S >= 1`` with ``P(Poisson(m) >= S) <= max_p_no_spare``."""
    return max(1, poisson_quantile(busy_mean, 1.0 - max_p_no_spare) + 1)


def node_loss_recovery_s(
    nodes: int, spares: int, busy_mean: float, in_job_s: float, job_s: float, join_s: float = SPARE_JOIN_S
) -> float:
    """A node loss's mean recovery with ``spares``: the in-job restart plus ``join_s`` when it is
    not pod 0 (``1 - 1/nodes``) and a spare is free (``P(Poisson(m) < S)``), else the job-level
    restart ``job_s``."""
    taken = (1.0 - 1.0 / nodes) * (1.0 - p_no_spare(spares, busy_mean))
    return taken * (in_job_s + join_s) + (1.0 - taken) * job_s


# Slow ranks and silent corruption: failure classes no restart layer sees (nothing crashes).
# Silent data corruption: Llama 3 (section 3.3.4, Table 5) attributes 1.4% of its 466 interruptions to it.
LLAMA3_SDC_SHARE = 0.014
SDC_SOURCE = "Llama 3 (Meta, 2024): 1.4% of its 466 interruptions were silent data corruption"
# Stragglers: Falcon (Wu et al., arXiv 2410.12588, 2024): on a production cluster of over 10,000
# GPUs, fail-slows delayed the average job's completion 1.34x, each lasting from tens of seconds
# to nearly ten hours.
FALCON_JCT_INFLATION = 1.34
STRAGGLER_SOURCE = (
    "Falcon (Wu et al., 2024): fail-slows delayed the average job 1.34x on a 10,000-GPU "
    "production cluster, each lasting from tens of seconds to nearly ten hours"
)
STRAGGLER_EPISODE_H = 1.0
"""Assumed: an episode's mean length (Falcon: tens of seconds to nearly ten hours)."""
STRAGGLER_SLOWDOWN = 2.0
"""Assumed: how many times as long the job's steps take while a straggler lasts."""
STRAGGLER_FIND_S = 150.0
"""resilience.stragglers' defaults: a report about every 60 s, a rank named in the second slow
report in a row, which an episode reaches 1.5-3 reports after it starts."""
SDC_UNNOTICED_H = 24.0
"""Assumed: without replica checks, how long a corruption trains on until a loss spike or an
evaluation gives it away; that training is all redone from a checkpoint before it."""


@dataclass(frozen=True)
class SlowAndSilent:
    """Expected fractions of wall time lost to stragglers and silent corruption, without and with
    this project's detection (``resilience.stragglers`` with a hot spare, ``resilience.sdc``)."""

    stragglers_unmitigated: float
    stragglers_replaced: float
    sdc_unchecked: float
    sdc_checked: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def slow_and_silent(
    job_mtbf_s: float,
    find_s: float,
    replace_s: float,
    check_interval_s: float,
    check_cost: float,
    rollback_s: float,
    job_restart_s: float,
) -> SlowAndSilent:
    """What the two classes cost a job whose crash failures come every ``job_mtbf_s`` seconds.

    Stragglers: episodes arrive so that, unmitigated, they inflate the job's time as Falcon
    measured (``FALCON_JCT_INFLATION``), each lasting ``STRAGGLER_EPISODE_H`` at a slowdown of
    ``STRAGGLER_SLOWDOWN``; replaced, an episode costs its slow steps until it is found
    (``find_s``) and an in-job restart onto a spare (``replace_s``, lost work included).
    Silent corruption: ``LLAMA3_SDC_SHARE`` of the failure rate; unchecked, each costs
    ``SDC_UNNOTICED_H`` of training redone and a job-level restart; checked every
    ``check_interval_s`` seconds, half an interval until found, the rollback (``rollback_s``: the
    work redone and the in-job restart), and the checks themselves (``check_cost`` of every step).
    """
    slow_share = 1.0 - 1.0 / FALCON_JCT_INFLATION  # of wall time, unmitigated
    per_episode_s = STRAGGLER_EPISODE_H * HOUR * (1.0 - 1.0 / STRAGGLER_SLOWDOWN)
    episodes_per_s = slow_share / per_episode_s
    replaced = min(
        1.0, episodes_per_s * (min(find_s, STRAGGLER_EPISODE_H * HOUR) * (1.0 - 1.0 / STRAGGLER_SLOWDOWN) + replace_s)
    )
    sdc_rate = LLAMA3_SDC_SHARE / job_mtbf_s
    unchecked = min(1.0, sdc_rate * (SDC_UNNOTICED_H * HOUR + job_restart_s))
    checked = min(1.0, check_cost + sdc_rate * (check_interval_s / 2.0 + rollback_s))
    return SlowAndSilent(slow_share, replaced, unchecked, checked)
