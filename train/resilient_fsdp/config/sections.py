"""The configuration's sections: one dataclass per section, each field with its type, default and
docstring (``describe`` prints them), so the documentation of a key lives next to it.

Unknown keys and bad values are rejected by validation (:mod:`.loading`), naming the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Optional

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

# extra="forbid" rejects typos; attribute docstrings become field descriptions for describe().
_STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


@dataclass(config=_STRICT)
class ModelConfig:
    preset: Literal["tiny", "125m", "1b", "8b", "70b"] = "tiny"
    """Size preset of the built-in decoder-only transformer (tiny runs in seconds on CPU)."""
    factory: Optional[str] = None
    """``pkg.module:function`` building a custom ``torch.nn.Module`` from this section; replaces the
    built-in model. Called under the meta device; see docs/config.md, "Custom models and datasets"."""
    vocab_size: Optional[int] = Field(default=None, gt=0)
    """Vocabulary size; default: the preset's. Token ids in the data must be below it."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward: less memory, ~30% more compute.
    The RNG state is replayed for the recompute (dropout draws the same masks) unless the model
    class sets ``recompute_needs_rng = False``."""
    max_seq_len: Optional[int] = Field(default=None, gt=0)
    """The longest sequence the model takes; a longer ``data.seq_len`` is refused when the
    configuration is loaded (and by the chart at render, before GPU nodes are held). Unset: what the
    model declares, checked once it is built (a ``model.factory`` module's ``max_seq_len``
    attribute; the built-in presets take any length). Set it to what a factory's model declares."""
    blocks: Optional[str] = None
    """Attribute (a dotted path, e.g. ``transformer.h``) of a ``model.factory`` model that holds its
    repeated blocks (an ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``): each is sharded
    by FSDP on its own and wrapped by activation checkpointing. Unset: ``layers`` (a
    ``model.hf_config`` model: its decoder layers); a model with neither is refused."""
    hf_config: Optional[str] = None
    """A Hugging Face causal LM's ``config.json``, or a local directory holding one (Llama,
    Mistral, Qwen, ...): ``transformers`` builds that model instead of the built-in one, on the
    meta device, and FSDP shards its decoder layers. Nothing is downloaded: the file is on the
    shared volume or in the image. ``model.preset`` and ``model.vocab_size`` do not apply; the
    configuration's ``max_position_embeddings`` is the longest ``data.seq_len`` it takes."""
    init_from: Optional[str] = None
    """A directory of safetensors weights to start from (a Hugging Face model's, or what
    ``resilient-fsdp checkpoints export`` wrote), read at a fresh start only: a resume loads its
    checkpoint instead. Each rank reads just its shards (torch DCP's Hugging Face reader). The
    built-in model reads Llama's parameter names."""


@dataclass(config=_STRICT)
class DataConfig:
    source: Literal["synthetic", "tokens"] = "synthetic"
    """``synthetic``: a deterministic, learnable token stream; ``tokens``: a memory-mapped token file."""
    path: Optional[str] = None
    """Data for ``source=tokens``: the directory ``resilient-fsdp data prepare`` wrote (or its
    ``tokens.bin``), an ``s3://bucket/prefix`` holding one (copied once to ``data.cache_dir``), or
    a flat ``.bin`` array of token ids of ``data.token_dtype``."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of a flat ``.bin`` without ``data prepare``'s metadata (uint16 for
    vocabularies up to 65,536); a prepared directory records its own."""
    cache_dir: Optional[str] = None
    """Where an ``s3://`` ``data.path`` is copied: once, by global rank 0, checksum-verified, then
    reused by every restart and by later jobs that name the same data. Unset: ``<run_dir>/data``."""
    seq_len: int = Field(default=64, gt=0)
    """Tokens per training sequence."""
    micro_batch_size: int = Field(default=4, gt=0)
    """Sequences per rank per micro-batch."""
    factory: Optional[str] = None
    """``pkg.module:function`` building a custom map-style dataset; replaces ``source``."""


@dataclass(config=_STRICT)
class OptimConfig:
    lr: float = Field(default=3e-3, gt=0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    warmup_steps: int = Field(default=10, ge=0)
    """Linear warm-up steps, then cosine decay to ``min_lr_ratio * lr`` at ``train.steps``."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Final learning rate as a fraction of ``lr``."""
    grad_clip: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""


@dataclass(config=_STRICT)
class TrainConfig:
    steps: int = Field(default=100, gt=0)
    """Optimizer steps to train for."""
    grad_accum_steps: int = Field(default=1, gt=0)
    """Micro-batches per optimizer step; gradients are reduced only on the last one."""
    elastic_batch: Literal["nearest", "exact"] = "nearest"
    """The global batch (samples per optimizer step) when a checkpoint is resumed at another world
    size: ``grad_accum_steps`` is chosen to keep the run's global batch (set at its first start)
    when world size x ``data.micro_batch_size`` divides it. Otherwise ``nearest`` trains on with
    the nearest global batch the ranks can make (ties: the smaller) and ``exact`` refuses the
    start. The learning-rate schedule counts optimizer steps either way."""
    stop_at_step: Optional[int] = Field(default=None, gt=0)
    """End this run at this step (checkpointed, as at the end of training) although the schedule
    still targets ``steps``; a later run with the same directory resumes there."""
    log_every: int = Field(default=10, gt=0)
    """Rank 0 prints a progress line every this many steps."""
    deterministic: bool = True
    """Deterministic kernels, so equal configs give bitwise-equal runs on CPU."""


@dataclass(config=_STRICT)
class DistConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` picks CUDA when a GPU is visible, else CPU; the backend follows (NCCL / gloo)."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Collective timeout once training runs. Gloo cannot be aborted, so peers of a dead rank wait
    this long; on CUDA, NCCL is aborted by in-process restart instead."""
    init_timeout_s: float = Field(default=600.0, gt=0)
    """Timeout for creating the process group and for the first step (ranks start unevenly:
    imports, model build, checkpoint load); ``timeout_s`` applies after the first step."""
    shard_group_size: int = Field(default=0, ge=0)
    """Ranks each parameter is sharded over. 0 (or the world size): every rank (FSDP). A divisor
    of the world size: HSDP, each parameter sharded within groups of this many consecutive ranks
    (a pod's, or a few pods') and replicated across the groups. A checkpoint then holds each shard
    once, so its commit and ``.metadata`` grow with the group, not the world; the price is the
    group's share of the state on every GPU. Every world size the job runs at must be a multiple."""


@dataclass(config=_STRICT)
class S3Config:
    uri: Optional[str] = None
    """``s3://bucket/prefix``: keep durable copies of committed checkpoints there, and restore from
    there when ``checkpoint.dir`` holds no complete checkpoint. Unset: no S3 tier. Credentials come
    only from boto3's default chain (IRSA or EKS Pod Identity in a cluster; environment, profile or
    instance role elsewhere); the bucket must exist."""
    endpoint_url: Optional[str] = None
    """Endpoint of an S3-compatible store (``http(s)://host:port``); unset: AWS S3."""
    region: Optional[str] = None
    """AWS region of the bucket; unset: the default chain's (``AWS_REGION``, the profile)."""
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    """Bucket in the host name (``virtual``) or in the path (``path``, which most S3-compatible
    stores need); ``auto`` lets botocore choose."""
    upload: bool = True
    """Upload every committed checkpoint in the background, never blocking a step: each rank uploads
    the files it wrote, then rank 0 the ``COMPLETE`` marker."""
    restore: bool = True
    """At start, when ``checkpoint.dir`` holds no complete checkpoint, download the newest complete
    one under ``uri`` and resume from it. S3 unreachable then fails the start (the restart layers
    retry it) rather than silently training from scratch; ``false`` starts without looking."""
    keep_last: int = Field(default=3, ge=0)
    """Complete checkpoints kept under ``uri``, independent of ``checkpoint.keep_last``; older ones
    are deleted only after a newer one is completely uploaded. 0 keeps all. Incomplete uploads are
    never deleted (``resilient-fsdp checkpoints list`` shows them)."""
    max_pending: int = Field(default=2, gt=0)
    """Backlog bound: committed checkpoints waiting for their upload besides the one in flight. When
    a new one arrives with the backlog full, the oldest waiting one is dropped (superseded: the
    newer checkpoint holds the later state) and reported. Local retention keeps a checkpoint until
    its upload finished or was dropped."""
    max_awaiting: int = Field(default=4, gt=0)
    """Rank 0 puts a checkpoint's marker once every rank uploaded its files; checkpoints waiting for
    that are held from local retention. When more than this many wait (a rank whose uploads keep
    failing), the oldest is released: named in the log with the ranks it waits for, kept locally
    only as ``keep_last`` says, and left without a marker on S3, so it is never restored."""
    max_concurrency: int = Field(default=10, gt=0)
    """Parallel requests of one transfer (parts of large files, whole small files)."""
    multipart_threshold_mb: int = Field(default=64, ge=5)
    """Files at least this large (MiB) go in parts (multipart upload, ranged downloads)."""
    multipart_chunksize_mb: int = Field(default=64, ge=5, le=5120)
    """Part size in MiB (S3 allows 5 MiB to 5 GiB, and at most 10,000 parts per object)."""
    max_bandwidth_mb_s: Optional[float] = Field(default=None, gt=0)
    """Cap on upload bandwidth (MB/s), so uploads leave room for the job's own traffic; unset: none."""
    retry_mode: Literal["standard", "adaptive"] = "adaptive"
    """botocore retry mode for each request: ``adaptive`` also slows the client down when S3
    throttles (503 SlowDown); ``standard``: exponential backoff with jitter only."""
    max_attempts: int = Field(default=10, gt=0)
    """Attempts per S3 request (botocore retries) before the transfer counts as failed."""
    connect_timeout_s: float = Field(default=10.0, gt=0)
    """Timeout for opening a connection to S3."""
    read_timeout_s: float = Field(default=60.0, gt=0)
    """Timeout for a response (or the next bytes of one) from S3."""
    retry_backoff_s: float = Field(default=5.0, gt=0)
    """After a failed checkpoint upload, wait this long before trying it again, doubling with every
    further failure up to ``retry_backoff_max_s``; training goes on meanwhile."""
    retry_backoff_max_s: float = Field(default=300.0, gt=0)
    """Longest wait between attempts at a failed checkpoint upload."""
    drain_timeout_s: float = Field(default=600.0, ge=0)
    """At the end of training (and on a graceful stop), how long each rank waits for its pending
    uploads (and rank 0 for the markers), so the final checkpoint reaches S3; what is left is
    reported in ``summary.json`` and uploaded by the next run with the same ``checkpoint.dir``."""
    restore_timeout_s: float = Field(default=600.0, gt=0)
    """Longest restore from S3 at start (every rank downloads its share, then rank 0 commits). The
    ranks wait for each other through the rendezvous store with this deadline, not in a collective,
    so ``dist.timeout_s`` does not bound it; it must be less than
    ``resilience.hang_detection.init_timeout_s``, the section the restore runs in."""


@dataclass(config=_STRICT)
class MemoryConfig:
    interval_steps: int = Field(default=0, ge=0)
    """Also keep a checkpoint of every rank's state in the pod's memory every this many steps
    (0: off): restored by a copy after an in-process or in-job restart, when every rank has the
    same step, instead of reading the durable checkpoint. Two slots per rank (one is always a
    complete snapshot); ``/dev/shm`` must hold both (``shm.sizeLimit``). A step where the durable
    save is due takes that one instead."""
    dir: str = "/dev/shm"
    """Where the slots live, and each rank's validated save plan for its next process (kept with
    the memory tier off too): the pod's memory-backed ``emptyDir`` (it outlives an in-job restart,
    not the pod). Removed when the job ends."""
    replicas: int = Field(default=0, ge=0, le=1)
    """1: each rank's newest snapshot is also kept by a rank on another pod (the same local rank
    of the next pod), sent over a gloo group of its own off the training thread, so a replacement
    pod's ranks restore from their peers' memory; 0: snapshots stay on their own pod."""


@dataclass(config=_STRICT)
class CheckpointConfig:
    dir: Optional[str] = None
    """Checkpoint directory, shared by all nodes; default ``<run_dir>/checkpoints``."""
    interval_steps: int = Field(default=0, ge=0)
    """Save every this many steps; 0 disables the step interval."""
    interval_s: float = Field(default=0.0, ge=0)
    """Also save when this many seconds passed since the last save; 0 disables the time interval."""
    mode: Literal["async", "torch-async", "sync"] = "async"
    """``async``: NVRx async DCP writer (the loop stalls only to stage state); ``torch-async``: NVRx
    ``TorchAsyncCheckpoint``, one file per rank, resumable only at the same world size; ``sync``:
    plain DCP save (the loop waits for the write)."""
    keep_last: int = Field(default=3, ge=0)
    """Committed checkpoints to keep (older ones are deleted after a newer one commits); 0 keeps all.
    Torn writes (``*.incomplete-*``) are deleted at the next start and once a commit reaches their
    step, whatever this is."""
    save_final: bool = True
    """Save a checkpoint at the end of training."""
    resume: bool = True
    """Resume from the newest complete checkpoint in ``dir`` when one exists."""
    resume_from: Optional[str] = None
    """Resume from this checkpoint directory (a ``step_N``) instead of the newest one, at the job's
    first start only (restarts of the job resume from its newest checkpoint, so retention may
    delete it once a newer one is committed). Checkpoints in ``dir`` newer than it are renamed
    ``*.abandoned-*`` then: never deleted, never picked again."""
    writer_threads: int = Field(default=2, gt=0)
    """Files each rank writes in parallel (``async`` mode)."""
    planning: Literal["decentralized", "collective"] = "decentralized"
    """How an ``async`` save without a kept plan is planned. ``decentralized``: every rank plans
    its part alone once the ranks' digests of the state's global structure agree (one small
    collective), and rank 0 builds the checkpoint's metadata from the structure; a disagreement
    falls back to ``collective``. ``collective``: DCP's own planning, every rank's plan gathered on
    rank 0 and a plan scattered back (minutes with every rank waiting at a thousand ranks), at the
    first two saves of every process. Both write the same DCP format."""
    verify: Literal["load", "restore", "never"] = "load"
    """Check files against the checksums in ``COMPLETE`` (CRC32C, recorded while writing):
    ``load``: before every resume (each rank reads a share of the files) and after an S3 restore;
    ``restore``: after an S3 restore only; ``never``. A checkpoint that fails is skipped for the
    previous one, the file named. A process verifies a checkpoint once: one it already verified,
    or downloaded from S3 and checked, is loaded without reading it again to verify it."""
    write_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for a background write when the loop must wait for it (a save due while the
    previous one is written, the final save), and the longest a commit in rank 0's commit process
    may take from its hand-over; past it the checkpoint fails on every rank (a hung commit's
    process is killed). Keep it below ``resilience.checkpoint_timeout_s``, so a stuck write is
    reported as such."""
    max_consecutive_failures: int = Field(default=3, ge=1)
    """A failed periodic save (a writer error, a full volume, a write past ``write_timeout_s``) is
    reported (log, a ``checkpoint_failed`` record) and training goes on; the next due save tries
    again. The job fails when this many saves in a row failed; 1: at the first. The final save,
    the graceful stop's save and a lost lease fail the job at once."""
    job_id: Optional[str] = None
    """Who writes ``dir``: two jobs may not write one directory (a lease names the holder).
    Unset: the launcher's rendezvous id (``TORCHELASTIC_RUN_ID``, the same for every restart of a
    job; in the chart the release's, whatever its install), else the process (a trainer without a
    launcher)."""
    lease_wait_s: float = Field(default=240.0, ge=0)
    """How long a new install of the job waits for an earlier one, still stopping, to release
    ``dir`` (its pods commit their final checkpoint first) before the start is refused. Below
    ``resilience.hang_detection.init_timeout_s``: the wait is part of start-up. New GPU pods
    rarely start before the old ones have left their nodes; raise it with ``stop.timeout_s`` where
    a final checkpoint takes minutes."""
    s3: S3Config = dataclasses.field(default_factory=S3Config)
    """The S3 tier: durable copies of committed checkpoints, restore on a fresh cluster."""
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    """The memory tier: snapshots in the pods' memory between durable checkpoints."""


@dataclass(config=_STRICT)
class InProcessConfig:
    enabled: bool = False
    """Wrap training in NVRx in-process restart (``inprocess.Wrapper``): after an exception or a
    hang in any rank, every rank re-creates the process group and the model and reloads the
    newest checkpoint in the same processes. The in-job restart stays on either way."""
    max_iterations: int = Field(default=5, gt=0)
    """In-process restarts a process makes before it gives up and leaves the fault to the in-job
    restart (``ft_launcher`` respawns the workers)."""
    soft_timeout_s: float = Field(default=60.0, gt=0)
    """A rank making no progress (no completed step) this long is aborted and restarted in-process."""
    hard_timeout_s: float = Field(default=90.0, gt=0)
    """A rank still hung this long is terminated (then the in-job restart takes over)."""
    heartbeat_timeout_s: float = Field(default=30.0, gt=0)
    """A rank whose in-process monitor misses heartbeats this long is considered gone."""
    barrier_timeout_s: float = Field(default=120.0, gt=0)
    """How long ranks wait for each other between in-process restart iterations."""
    store_port_offset: int = Field(default=1, gt=0)
    """The in-process restart's store listens on ``MASTER_PORT`` + this on the rank-0 host."""


@dataclass(config=_STRICT)
class HangDetectionConfig:
    init_timeout_s: Optional[float] = Field(default=900.0, gt=0)
    """Longest start-up (process group, model, resume) before the rank is declared hung and
    restarted by ``ft_launcher``. ``null`` disables it."""
    step_timeout_s: Optional[float] = Field(default=600.0, gt=0)
    """Longest training step before the rank is declared hung (a learned value may raise it, never
    lower it, see ``learn_timeouts``). ``null`` disables it."""
    checkpoint_timeout_s: Optional[float] = Field(default=900.0, gt=0)
    """Longest checkpoint call (staging, or committing a write), and the budget of the waits for
    checkpoint writes and the end of the job (the ``drain`` section: the final save, a graceful
    stop, a save that waits for the previous write), before the rank is declared hung."""
    out_of_section_timeout_s: Optional[float] = Field(default=600.0, gt=0)
    """Longest time outside start-up, steps and checkpoints (logging, evaluation) before the rank is
    declared hung."""
    learn_timeouts: bool = True
    """Raise the step/checkpoint/out-of-section timeouts to ``safety_factor`` times the longest
    observed durations (NVRx ``calculate_and_set_section_timeouts``) once ``learn_after_steps``
    steps and a checkpoint were seen. The configured values are floors: a learned value never lowers
    them. Learned values are saved in checkpoints and reused on resume, raised to the configured ones."""
    learn_after_steps: int = Field(default=50, gt=0)
    """Steps to observe before learning timeouts."""
    safety_factor: float = Field(default=5.0, ge=1)
    """Learned timeout = this x the longest observed duration."""
    min_learned_timeout_s: float = Field(default=60.0, gt=0)
    """Learned timeouts are never shorter than this (a short step is no reason to kill a slow one)."""
    termination_signal: Literal["SIGKILL", "SIGTERM"] = "SIGKILL"
    """Signal ``ft_launcher`` sends a hung rank."""
    workload_check_interval_s: float = Field(default=5.0, gt=0)
    """How often ``ft_launcher``'s rank monitors check for missed timeouts."""


@dataclass(config=_STRICT)
class LauncherConfig:
    max_restarts: int = Field(default=3, ge=0)
    """In-job restarts: how many times ``ft_launcher`` respawns the workers before the node fails
    (then the job-level policy, ``restartPolicy``/``backoffLimit``, decides). Under NVRx 0.7 the
    count is the job's: every node's restart rounds together."""
    workers_stop_timeout_s: float = Field(default=15.0, gt=0)
    """When restarting workers after a fault, how long ``ft_launcher`` waits between SIGTERM and
    SIGKILL (a rank stuck in a collective that cannot be aborted is killed after this)."""
    monitor_interval_s: float = Field(default=0.1, gt=0)
    """How often ``ft_launcher`` looks at its workers (``--monitor-interval``): a rank's death is
    seen within this, and every restart waits for it (NVRx 0.7's own default is 0.3 s; a look is
    a ``waitpid`` per rank)."""
    gpu_memory_poll_interval_s: float = Field(default=0.2, gt=0)
    """Before it starts new workers on a GPU node, NVRx 0.7's ``ft_launcher`` waits for the dead
    ranks' device memory to be freed, asking NVML this often (``gpu_memory_poll_interval``; NVRx's
    default 2 s makes every in-job restart wait whole seconds for memory freed in a fraction of
    one). NVRx 0.4 has no such wait and ignores the key."""
    prewarm: bool = True
    """Fork each new rank from a server in the pod that has imported torch and the trainer, so an
    in-job restart does not import them again on every rank (``resilience.prewarm``); false:
    ``ft_launcher``'s workers import their own."""


@dataclass(config=_STRICT)
class StopConfig:
    timeout_s: float = Field(default=600.0, gt=0)
    """On SIGTERM to a node (eviction, spot reclaim), how long its ranks get to finish the step and
    commit a checkpoint before they are killed; keep it below the pod's
    ``terminationGracePeriodSeconds``."""
    exit_code: int = Field(default=143, ge=128, le=255)
    """Exit code of a rank that stopped gracefully on SIGTERM: 128-255, which the PyTorchJob
    ``ExitCode`` restart policy retries."""


@dataclass(config=_STRICT)
class StragglersConfig:
    enabled: bool = False
    """Time each step's parts as NVRx's straggler detector's sections (CUDA kernels profiled with
    CUPTI on a GPU) and score every rank against the fastest (``resilience.stragglers``;
    docs/faults-and-restarts.md, "Slow ranks")."""
    report_every_s: float = Field(default=60.0, gt=0)
    """About how often the ranks' timings are gathered on rank 0 and scored (a few small
    collectives); a report covers the steps since the previous one. Rank 0 turns it into steps
    from the median step since the last report and broadcasts the next report's step, so a
    report costs the same share of any step length. The first report comes after
    ``report_every_steps`` steps, or 10."""
    report_every_steps: int = Field(default=0, ge=0)
    """Report every this many steps instead (0: by ``report_every_s``)."""
    threshold: float = Field(default=0.75, gt=0, lt=1)
    """A rank whose score (the fastest rank's median time of a part over its own) is below this is
    slow in that report; NVRx's default."""
    consecutive_reports: int = Field(default=2, gt=0)
    """Reports in a row a rank must be slow in before it is named a straggler: one slow report can
    be a hiccup (a page-cache flush, a noisy neighbour's burst)."""
    min_excess: float = Field(default=0.1, ge=0, lt=1)
    """A slow part must also cost at least this fraction of the median step (its median over the
    fastest rank's): a part of a millisecond that varies twofold slows nobody."""
    action: Literal["report", "replace"] = "report"
    """``report``: logged, in ``summary.json`` and the metrics. ``replace``: the straggler's node
    leaves the job (NVRx's request to exclude the node) and a hot spare takes its node rank in an
    in-job restart, from the memory tier; without a spare (``spares``), or on the rendezvous store's
    pod, it reports only and says why."""


@dataclass(config=_STRICT)
class SdcConfig:
    interval_steps: int = Field(default=0, ge=0)
    """Every this many steps, under HSDP (``dist.shard_group_size``), the replicas of each shard
    compare a digest of their parameters (on the device; 16 bytes a rank within its replicate
    group); a mismatch rolls the job back to the state last seen to agree (silent data corruption,
    docs/faults-and-restarts.md). 0: off."""


@dataclass(config=_STRICT)
class ResilienceConfig:
    in_process: InProcessConfig = dataclasses.field(default_factory=InProcessConfig)
    """In-process restart: the same processes re-run the training function after a fault."""
    hang_detection: HangDetectionConfig = dataclasses.field(default_factory=HangDetectionConfig)
    """In-job hang detection: section timeouts ``ft_launcher``'s rank monitors enforce."""
    launcher: LauncherConfig = dataclasses.field(default_factory=LauncherConfig)
    """In-job restart: ``ft_launcher`` respawning a node's workers."""
    stop: StopConfig = dataclasses.field(default_factory=StopConfig)
    """Graceful stop on SIGTERM: finish the step, commit a checkpoint, exit retryably."""
    stragglers: StragglersConfig = dataclasses.field(default_factory=StragglersConfig)
    """Slow ranks: found by NVRx's straggler detector, reported or replaced by a hot spare."""
    sdc: SdcConfig = dataclasses.field(default_factory=SdcConfig)
    """Silent data corruption: HSDP replicas compared every N steps, a mismatch rolled back."""
    inject: list[str] = dataclasses.field(default_factory=list)
    """Faults to inject, ``KIND@STEP[:rank=R | :node=N][:for=SECONDS][:factor=F]`` (also ``--inject``); the
    kinds are the table in :mod:`resilient_fsdp.config.fault_spec` (``resilient-fsdp config
    --describe`` lists them). ``node=N``: the node's local rank 0. Each fires once per job (``nan-loss-repeat``: each time its step runs). For
    tests and drills; docs/faults-and-restarts.md."""


@dataclass(config=_STRICT)
class Config:
    seed: int = 0
    """Seed for initialisation, data order and dropout-free numerics."""
    run_dir: str = "runs/local"
    """Where ``config.yaml``, ``metrics.jsonl`` and ``summary.json`` are written (shared by ranks)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """The training data."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """The training loop."""
    dist: DistConfig = dataclasses.field(default_factory=DistConfig)
    """Device and process group."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpointing."""
    resilience: ResilienceConfig = dataclasses.field(default_factory=ResilienceConfig)
    """Fault tolerance: in-process and in-job restart, hang detection, graceful stop, fault injection."""

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.run_dir) / "checkpoints"


def subsection(cls: type, name: str) -> Optional[type]:
    """The dataclass type of ``cls.name`` when that field is a nested section, else None."""
    info = getattr(cls, "__pydantic_fields__", {}).get(name)
    annotation = info.annotation if info is not None else None
    return annotation if isinstance(annotation, type) and dataclasses.is_dataclass(annotation) else None


def section_of(parts: tuple | list) -> Optional[type]:
    """The dataclass holding the key at ``parts``; None when the parent is not a section."""
    cls: Optional[type] = Config
    for part in parts[:-1]:
        cls = subsection(cls, part)
        if cls is None:
            return None
    return cls


def field_annotation(parts: tuple | list) -> object:
    """The declared type of the key at ``parts`` (a section's class for a section), or None."""
    cls = section_of(parts)
    info = getattr(cls, "__pydantic_fields__", {}).get(parts[-1]) if cls is not None else None
    return info.annotation if info is not None else None
