"""Silent data corruption under HSDP (``resilience.sdc``): the replicas of each shard compare a
digest of their parameters, and a mismatch rolls the job back to the state last seen to agree.

Under HSDP the replicas of a shard are bitwise equal. Every ``interval_steps`` steps each rank
digests its shards and compares them with its replicas' (:class:`ReplicaCheck`). A mismatch
names the odd replica out, or every replica as a suspect; sets aside the checkpoints newer than
the last passing check (:func:`suspect_window`); records it in ``<run_dir>/faults/sdc/``; lets
an odd replica out leave for a hot spare; and ends every rank with :class:`SilentCorruption`
(exit 205, an in-job restart). The same again before any check passed fails the job (exit 2).
The trainer calls it after each step.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..checkpoint import store
from ..config import ConfigError
from ..config.sections import SdcConfig
from .deterministic import RepeatedFailure
from .faults import node_index
from .ledger import FaultLedger
from .stragglers import NOT_REPLACED

# 2**31 - 1, a prime: the place weights stay below it, so a word times its weight stays below 2**63
# (their sums wrap, alike on every replica).
_WEIGHT_MODULUS = 2**31 - 1


class SilentCorruption(BaseException):
    """The replicas disagreed: every rank ends the attempt with the code the in-job restart
    retries. A ``BaseException``, so that in-process restart (the same processes, the same
    devices) passes it on."""


class RepeatedCorruption(RepeatedFailure):
    """The replicas disagreed again before any check passed after a rollback: no restart fixes
    it (a configuration-type failure, exit 2)."""


# Words digested at a time: the int64 copies of a chunk (about 4x its bytes) are all a digest adds
# to the device's memory, whatever the size of the largest shard.
_CHUNK = 1 << 24


def digest(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two int64 sums over the bits of ``tensors`` (each viewed as 32- or 16-bit words), on their
    device: the words, and the words weighted by their place (mod a prime)."""
    device = tensors[0].device if tensors else torch.device("cpu")
    total = torch.zeros(2, dtype=torch.int64, device=device)
    offset = 0
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        words = flat.view(
            torch.int32 if flat.element_size() == 4 else torch.int16 if flat.element_size() == 2 else torch.int64
        )
        for start in range(0, words.numel(), _CHUNK):
            chunk = words[start : start + _CHUNK].to(torch.int64)
            weights = (
                torch.arange(offset, offset + chunk.numel(), dtype=torch.int64, device=device) % _WEIGHT_MODULUS
            ) + 1
            total[0] += chunk.sum()
            total[1] += (chunk * weights).sum()
            offset += chunk.numel()
    return total


def odd_ones(digests: list[tuple[int, int]]) -> Optional[list[int]]:
    """Replica indices whose digest differs from a strict majority's; None when no strict
    majority exists (two replicas that differ: either may be the bad one)."""
    counts: dict[tuple[int, int], int] = {}
    for d in digests:
        counts[d] = counts.get(d, 0) + 1
    best, n = max(counts.items(), key=lambda kv: kv[1])
    if n * 2 <= len(digests):
        return None
    return [i for i, d in enumerate(digests) if d != best]


class ReplicaCheck:
    """One attempt's replica checks; :meth:`after_step` is collective."""

    def __init__(
        self,
        cfg: SdcConfig,
        mesh,
        rank: int,
        ledger: FaultLedger,
        resumed_step: Callable[[], int],
        memory_discard: Callable[[int], object],
        durable_root: Path,
        can_leave: Callable[[], int],
        exclude_this_node: Callable[[str], bool],
        log: Callable[[dict, str], None],
    ):
        self.cfg, self.rank, self.ledger = cfg, rank, ledger
        self.resumed_step, self.memory_discard, self.durable_root = resumed_step, memory_discard, durable_root
        self.can_leave, self.exclude_this_node, self.log = can_leave, exclude_this_node, log
        self.group = None
        self.replicas = 1
        self.last_pass: Optional[int] = None
        self.checks = 0
        self.check_s: list[float] = []
        if cfg.interval_steps:
            names = mesh.mesh_dim_names or ()
            if "dp_replicate" not in names:
                raise ConfigError(
                    "resilience.sdc.interval_steps compares the replicas of each shard, which only HSDP "
                    "has: set dist.shard_group_size to a divisor of the world size below it (each shard "
                    "then has world / shard_group_size replicas), or resilience.sdc.interval_steps=0"
                )
            self.group = mesh["dp_replicate"].get_group()
            self.replicas = mesh["dp_replicate"].size()
            self.mesh = mesh

    def after_step(self, step: int, tensors: Callable[[], list[torch.Tensor]]) -> None:
        """After step ``step``: every ``interval_steps`` steps, compare the replicas' digests of
        ``tensors()`` (this rank's parameter shards); raises :class:`SilentCorruption` on a
        mismatch."""
        if self.group is None or step % self.cfg.interval_steps:
            return
        if self.last_pass is None:
            self.last_pass = self.resumed_step()  # what the attempt loaded was checked when it was saved
        t0 = time.perf_counter()
        mine = digest(tensors())
        gathered = [torch.zeros_like(mine) for _ in range(self.replicas)]
        dist.all_gather(gathered, mine, group=self.group)
        digests = [tuple(int(v) for v in g.tolist()) for g in gathered]
        differs = len(set(digests)) > 1
        flag = torch.tensor([1 if differs else 0], dtype=torch.int64, device=mine.device)
        dist.all_reduce(flag)
        self.checks += 1
        self.check_s.append(time.perf_counter() - t0)
        if not int(flag.item()):
            self._passed(step)
            return
        odd = odd_ones(digests) if differs else []
        me = dist.get_group_rank(self.group, self.rank) if differs else -1
        suspect = differs and (odd is None or me in odd)
        self._mismatch(step, suspect, bool(odd) and me in odd and len(odd) == 1)

    def _passed(self, step: int) -> None:
        self.last_pass = step
        if self.rank == 0:
            for record in self.ledger.sdc():
                if "reverified_at_step" not in record:
                    record["reverified_at_step"] = step
                    self.ledger.record_sdc(record)

    def _mismatch(self, step: int, suspect: bool, odd_one: bool) -> None:
        world = dist.get_world_size()
        who = [None] * world
        reason = self.can_leave() if odd_one else -1
        # Read before the gather: rank 0 records this mismatch only after every rank has arrived.
        key = f"step{step:08d}"
        earlier = [r for r in self.ledger.sdc() if "reverified_at_step" not in r and r["key"] != key]
        dist.all_gather_object(who, (suspect, odd_one, reason, node_index(), socket.gethostname()))
        suspects = [{"rank": r, "pod": w[3], "host": w[4]} for r, w in enumerate(who) if w[0]]
        leaving = [r for r, w in enumerate(who) if w[1] and w[2] == 0]
        last_pass = self.last_pass if self.last_pass is not None else 0
        dropped = self.memory_discard(last_pass)
        record = {
            "key": key,
            "step": step,
            "last_pass_step": last_pass,
            "t_detected": time.time(),
            "replicas": self.replicas,
            "suspects": suspects,
            "odd_one_out": any(w[1] for w in who),
            "replaced": [{"rank": r, "pod": who[r][3], "host": who[r][4]} for r in leaving],
        }
        staying = sorted({w[2] for w in who if w[1] and w[2] != 0})
        if staying:
            record["not_replaced"] = "; ".join(NOT_REPLACED[code] for code in staying)
        if self.rank == 0:
            aside = [str(p) for p in store.set_aside_newer(self.durable_root, last_pass, kind="suspect")]
            record["set_aside"] = aside
            self.ledger.record_sdc(record)
            names = ", ".join(f"rank {s['rank']} (pod {s['pod']}, host {s['host']})" for s in suspects)
            self.log(
                {"event": "replica_mismatch", **record},
                f"silent data corruption: the replicas of a shard differ at step {step} (last agreed at step "
                f"{last_pass}); suspects: {names}; {len(aside)} durable checkpoint(s) newer than step {last_pass} "
                f"set aside as suspect and {len(dropped or [])} memory snapshot(s) discarded on rank 0"
                + (f"; {len(leaving)} node(s) leave for a hot spare" if leaving else "")
                + "; rolling back",
            )
        if earlier:
            raise RepeatedCorruption(
                f"the replicas of a shard differ again at step {step}, after the rollback for the mismatch at step "
                f"{earlier[-1]['step']} and before any check passed: a rollback does not fix it. Suspects: "
                + ", ".join(f"rank {s['rank']} (pod {s['pod']}, host {s['host']})" for s in suspects)
                + ". Cordon their nodes (`kubectl cordon NODE`) and start the job again"
            )
        if self.rank in leaving:
            self.exclude_this_node(
                f"silent data corruption: this rank's replica differed from the others' at step {step}"
            )
        raise SilentCorruption(
            f"the replicas of a shard differ at step {step}: rolling back to step {last_pass} or before"
        )

    def summary(self) -> Optional[dict]:
        if self.group is None:
            return None
        return {
            "interval_steps": self.cfg.interval_steps,
            "replicas": self.replicas,
            "checks": self.checks,
            "check_s_median": sorted(self.check_s)[len(self.check_s) // 2] if self.check_s else None,
        }


def suspect_window(ledger: FaultLedger) -> Optional[tuple[int, int]]:
    """The steps no start may resume from: after the last passing check of a mismatch the job has
    not re-verified since, up to the mismatch's step; None when there is none."""
    open_ = [r for r in ledger.sdc() if "reverified_at_step" not in r]
    if not open_:
        return None
    return open_[-1]["last_pass_step"], open_[-1]["step"]
