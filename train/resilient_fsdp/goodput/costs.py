"""What one checkpoint costs, estimated from the model's size, the GPUs and the shared volume.

``resilient-fsdp advise`` and the values profiles use it when no measured costs are given
(``bench checkpoint`` and ``scripts/gpu-check`` measure them). The state is ``BYTES_PER_PARAM``
per parameter (fp32 weights, AdamW's moments); the stall ``delta`` is a GPU's shard (the state
over the shard group) copied to the host at the GPU's rate plus ``STALL_FIXED_S``; the write
``W`` is the whole state at FSx's throughput (capacity x per-TiB rate) plus rank 0's commit: every
rank's write results unpickled and DCP's ``.metadata`` pickled at ``RANK0_COMMIT_MB_S``, linear in
the world under FSDP and in the shard group under HSDP (``bench.commit_scale`` measures it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..train.presets import PRESETS, parameter_count
from ..train.state_fit import TRAINING_BYTES_PER_PARAM

BYTES_PER_PARAM = 12
"""fp32 master weights + two AdamW moments (8B parameters: ~96 GB; 70B: ~847 GB)."""
STALL_FIXED_S = 0.5
"""Per save besides the copy: the save plan, the ranks' agreement, the writer's hand-off."""
COMMIT_BYTES_PER_RANK = 250e3
"""Pickled write results (and file checksums) one rank hands rank 0 per save, for a 70b-like state
(80 layers: ~2,200 tensor shards of weights and AdamW moments, ~115 B each; bench.commit_scale).
Shallower models have fewer tensors and less; the estimate keeps the deep model's figure."""
METADATA_PER_RESULT_BYTE = 1.05
"""Bytes of ``.metadata`` per byte of gathered write results (bench.commit_scale at 1,024 ranks:
68.0 MB from 65.0 MB)."""
COMMIT_FILE_BYTES_PER_RANK = 500
"""What a rank hands rank 0 besides its write results: its files' checksums and the outcome's
envelope (bench.commit_scale under HSDP: 23.1 MB gathered at 16,384 ranks, 16.0 MB at 1,024, for
the same results)."""
RANK0_COMMIT_MB_S = 5.0
"""Rank 0's rate through unpickling the gathered results and pickling ``.metadata`` (MB/s, one
core): ``python -m resilient_fsdp.bench.commit_scale --world 256 1024 --layers 20`` measures
5.1-5.3 MB/s on an idle core of the 2-core development machine (DCP's write results are many
small objects, so the rate is set by object count, not bytes)."""
# Device-to-host copy rate per GPU (GB/s), measured: ~25 on PCIe Gen4 (A100, A10G, L4), ~53 on
# PCIe Gen5 (H100, H200; B200 hosts link at Gen5 too). Keyed by instance family.
# GPU memory (GB) per instance family: A100 40/80, A10G 24, L4 24, H100 80, H200 141, B200 180.
GPU_MEMORY_GB = {
    "p4d": 40.0,
    "p4de": 80.0,
    "g5": 24.0,
    "g6": 24.0,
    "p5": 80.0,
    "p5e": 141.0,
    "p5en": 141.0,
    "p6-b200": 180.0,
}
STATE_SHARE_OF_GPU = 0.5
"""The share of a GPU's memory the advisor plans the sharded training state to take when it
suggests a shard group, leaving room for the gathered bf16 layers, activations and NCCL's buffers.
A plan, not a limit: the chart and the trainer refuse a state only above
``train.state_fit.MAX_STATE_PERCENT``."""
D2H_GB_S = {"p4d": 25.0, "p4de": 25.0, "g5": 25.0, "g6": 25.0, "p5": 53.0, "p5e": 53.0, "p5en": 53.0, "p6-b200": 53.0}
HOST_COPY_GB_S = 25.0
"""A CPU "GPU" (instance type ``cpu``): a memory copy into touched buffers on this kind of machine."""
# FSx for Lustre throughput per TiB of capacity (MB/s/TiB): SCRATCH_2 has one baseline; a
# PERSISTENT_2 file system is given one of 125, 250, 500 or 1000 when it is created.
SCRATCH_2_MB_S_PER_TIB = 200.0
PERSISTENT_2_MB_S_PER_TIB = (125.0, 250.0, 500.0, 1000.0)
_CAPACITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(Gi|Ti)\s*$")


class CostError(ValueError):
    """An input the estimate cannot use; the message names the flag and the fix."""


@dataclass(frozen=True)
class Storage:
    """The shared volume the checkpoints are written to (an FSx for Lustre file system)."""

    capacity_gib: float
    mb_s_per_tib: float
    deployment_type: str

    @property
    def capacity_tib(self) -> float:
        return self.capacity_gib / 1024

    @property
    def gb_s(self) -> float:
        """Aggregate write throughput in GB/s."""
        return self.capacity_tib * self.mb_s_per_tib / 1000


@dataclass(frozen=True)
class Estimate:
    """A checkpoint's estimated stall and write time, with the figures behind them."""

    params: int
    gpus: int
    d2h_gb_s: float
    storage: Storage
    stall_s: float
    write_s: float
    commit_s: float = 0.0
    """The commit's part of ``write_s`` (in rank 0's commit process, after every rank's write)."""
    shard_group: int = 0
    """GPUs each parameter is sharded over (``dist.shard_group_size``); 0: every GPU (FSDP)."""

    @property
    def state_gb(self) -> float:
        return self.params * BYTES_PER_PARAM / 1e9

    @property
    def shard_gb(self) -> float:
        return self.state_gb / (self.shard_group or self.gpus)

    def explain(self) -> list[str]:
        """The arithmetic, one line per cost, as the profiles' headers write it."""
        s = self.storage
        if self.shard_group:
            commit = (
                f"commit = ({self.shard_group} shards x {COMMIT_BYTES_PER_RANK / 1e3:g} kB x "
                f"(1 + {METADATA_PER_RESULT_BYTE:g}) + {self.gpus} ranks x {COMMIT_FILE_BYTES_PER_RANK} B) / "
                f"{RANK0_COMMIT_MB_S:g} MB/s = {self.commit_s:.3g} s (HSDP, dist.shard_group_size="
                f"{self.shard_group})"
            )
        else:
            commit = (
                f"commit = {self.gpus} ranks x {COMMIT_BYTES_PER_RANK / 1e3:g} kB x (1 + "
                f"{METADATA_PER_RESULT_BYTE:g}) / {RANK0_COMMIT_MB_S:g} MB/s = {self.commit_s:.3g} s"
            )
        return [
            f"state {self.params / 1e9:.1f}e9 params x {BYTES_PER_PARAM} B = {self.state_gb:,.0f} GB",
            commit,
            f"stall delta = shard {self.shard_gb:.3g} GB / ~{self.d2h_gb_s:g} GB/s + {STALL_FIXED_S:g} s = "
            f"{self.stall_s:.3g} s (the commit runs in rank 0's commit process)",
            f"write W = {self.state_gb:,.0f} GB / ({s.capacity_tib:.2f} TiB x {s.mb_s_per_tib:g} MB/s/TiB, "
            f"{s.deployment_type}) + commit = {self.write_s:.0f} s",
        ]


def capacity_for(state_gb: float, seconds: float, mb_s_per_tib: float) -> int:
    """The smallest FSx capacity (GiB: 1,200, then steps of 2,400, as SCRATCH_2 and PERSISTENT_2
    take it) that writes ``state_gb`` within ``seconds`` at ``mb_s_per_tib``."""
    tib = state_gb / max(seconds, 1e-9) * 1000 / mb_s_per_tib
    gib = tib * 1024
    return 1200 if gib <= 1200 else 2400 * -(-int(gib) // 2400)


def params_of(preset: Optional[str], params: Optional[float]) -> Optional[int]:
    """Parameters of a built-in ``preset``, or ``params`` as given; None when neither is."""
    if preset is not None and params is not None:
        raise CostError("--preset and --params both give the model's size: pass one")
    if preset is not None:
        if preset not in PRESETS:
            raise CostError(f"--preset {preset!r}: choose one of {', '.join(PRESETS)}, or give --params")
        return parameter_count(PRESETS[preset])
    if params is not None:
        if params < 1:
            raise CostError(f"--params {params:g}: the parameter count must be at least 1 (e.g. 70.6e9)")
        return int(params)
    return None


def d2h_gb_s(instance: str) -> float:
    """One GPU's device-to-host copy rate for ``instance`` (GB/s)."""
    if instance == "cpu":
        return HOST_COPY_GB_S
    family = instance.split(".", 1)[0]
    if family not in D2H_GB_S:
        raise CostError(
            f"no device-to-host rate is known for {instance!r} (known: {', '.join(sorted(D2H_GB_S))}): "
            "pass --ckpt-stall-s, or --from-bench with measured costs"
        )
    return D2H_GB_S[family]


def capacity_gib(text: str) -> float:
    """``1200Gi`` or ``14.06Ti`` in GiB."""
    m = _CAPACITY.match(str(text))
    if not m:
        raise CostError(f"--storage-size {text!r}: give the capacity as Kubernetes writes it, e.g. 1200Gi or 14400Gi")
    return float(m[1]) * (1024 if m[2] == "Ti" else 1)


def storage(size: str, deployment_type: str, mb_s_per_tib: Optional[float]) -> Storage:
    """The shared volume from the chart's terms (``storage.size``, ``storage.fsx.deploymentType``,
    ``storage.fsx.perUnitStorageThroughput``); SCRATCH_2 has its one baseline throughput."""
    if deployment_type == "SCRATCH_2":
        if mb_s_per_tib not in (None, SCRATCH_2_MB_S_PER_TIB):
            raise CostError(
                f"--storage-throughput {mb_s_per_tib:g}: a SCRATCH_2 file system gives "
                f"{SCRATCH_2_MB_S_PER_TIB:g} MB/s/TiB; leave it out, or use --deployment-type PERSISTENT_2"
            )
        rate = SCRATCH_2_MB_S_PER_TIB
    elif deployment_type == "PERSISTENT_2":
        rate = mb_s_per_tib if mb_s_per_tib is not None else PERSISTENT_2_MB_S_PER_TIB[1]
        if rate not in PERSISTENT_2_MB_S_PER_TIB:
            raise CostError(
                f"--storage-throughput {rate:g}: PERSISTENT_2 offers "
                f"{', '.join(f'{r:g}' for r in PERSISTENT_2_MB_S_PER_TIB)} MB/s/TiB"
            )
    else:
        raise CostError(f"--deployment-type {deployment_type!r}: choose SCRATCH_2 or PERSISTENT_2")
    return Storage(capacity_gib(size), rate, deployment_type)


def estimate(params: int, gpus: int, instance: str, volume: Storage, shard_group: int = 0) -> Estimate:
    """The stall and write time of one checkpoint of ``params`` parameters sharded over ``gpus``
    (or, with ``shard_group``, over groups of that many GPUs: HSDP)."""
    rate = d2h_gb_s(instance)
    state_gb = params * BYTES_PER_PARAM / 1e9
    group = 0 if shard_group in (0, gpus) else shard_group
    commit = commit_s(gpus, group)
    stall = state_gb / (group or max(gpus, 1)) / rate + STALL_FIXED_S
    return Estimate(
        params=params,
        gpus=max(gpus, 1),
        d2h_gb_s=rate,
        storage=volume,
        stall_s=stall,
        write_s=state_gb / volume.gb_s + commit,
        commit_s=commit,
        shard_group=group,
    )


def suggested_shard_group(params: int, gpus: int, gpus_per_node: int, instance: str) -> Optional[int]:
    """The smallest HSDP shard group, whole pods that divide the job, whose share of the training
    state fits in :data:`STATE_SHARE_OF_GPU` of a GPU; None when FSDP over every GPU is the only
    fit, or the instance's GPU memory is unknown."""
    memory = GPU_MEMORY_GB.get(instance.split(".", 1)[0])
    if memory is None:
        return None
    needed = params * TRAINING_BYTES_PER_PARAM / (STATE_SHARE_OF_GPU * memory * 1e9)
    nodes = max(gpus // max(gpus_per_node, 1), 1)
    for pods in range(1, nodes):
        group = pods * gpus_per_node
        if nodes % pods == 0 and group >= needed:
            return group
    return None


MEMORY_STALL_FIXED_S = 0.02
"""Per memory save besides the copy (taking the state and its non-tensor values, starting the copy):
3-15 ms measured for ``tiny`` on two cores (``memory_checkpoint`` records); no plan, no agreement."""


def memory_stall_s(shard_gb: float, instance: str) -> float:
    """A memory save's stall: the copy of the rank's shard into its slot and the save's fixed part,
    no commit (the slot's record follows the copy off the training thread, on its own rank)."""
    return shard_gb / d2h_gb_s(instance) + MEMORY_STALL_FIXED_S


def commit_s(gpus: int, shard_group: int = 0) -> float:
    """Rank 0's commit of one checkpoint at a world of ``gpus`` ranks (linear in it), or under
    HSDP with ``shard_group`` (linear in the group, plus each rank's file checksums)."""
    if not shard_group or shard_group >= gpus:
        return max(gpus, 1) * COMMIT_BYTES_PER_RANK * (1 + METADATA_PER_RESULT_BYTE) / (RANK0_COMMIT_MB_S * 1e6)
    results = shard_group * COMMIT_BYTES_PER_RANK * (1 + METADATA_PER_RESULT_BYTE)
    return (results + gpus * COMMIT_FILE_BYTES_PER_RANK) / (RANK0_COMMIT_MB_S * 1e6)
