"""The typed run configuration: one source of truth for every component.

Precedence, lowest first: the defaults declared here < a YAML file (``--config FILE``) <
``--set section.key=value`` overrides, applied in the order given. Unknown keys and bad values
are rejected before anything is allocated, with a message naming the key and what it accepts.

Each section is a dataclass whose fields carry a docstring; ``describe()`` prints them, so the
documentation of a key lives next to its type and default.

Over 400 lines because every key is declared here with its type, default and docstring, next to
the two value grammars the keys use (fault specs, ``s3://`` URIs): the module imports nothing
else of this package, so everything can import it.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

# extra="forbid" rejects typos; attribute docstrings become field descriptions for describe().
_STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

PRESETS = ("tiny", "125m", "1b", "8b", "70b")


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message names the key and the fix."""

    # With the PyTorchJob restart policy `ExitCode`, codes 1-127 fail the job at once while
    # 128-255 recreate the pod: a retry cannot fix a configuration error, so fail fast.
    exit_code = 2


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
    blocks: Optional[str] = None
    """Attribute (a dotted path, e.g. ``transformer.h``) of a ``model.factory`` model that holds its
    repeated blocks (an ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``): each is sharded
    by FSDP on its own and wrapped by activation checkpointing. Unset: ``layers``; a model with
    neither is refused."""


@dataclass(config=_STRICT)
class DataConfig:
    source: Literal["synthetic", "tokens"] = "synthetic"
    """``synthetic``: a deterministic, learnable token stream; ``tokens``: a memory-mapped token file."""
    path: Optional[str] = None
    """Token file for ``source=tokens``: a flat ``.bin`` array of token ids."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of the token file (uint16 for vocabularies up to 65,536)."""
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
    restore_timeout_s: float = Field(default=3600.0, gt=0)
    """Longest restore from S3 at start (every rank downloads its share, then rank 0 commits). The
    ranks wait for each other through the rendezvous store with this deadline, not in a collective,
    so ``dist.timeout_s`` does not bound it; ``resilience.init_timeout_s`` must cover it too."""


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
    Incomplete checkpoints are never deleted."""
    save_final: bool = True
    """Save a checkpoint at the end of training."""
    resume: bool = True
    """Resume from the newest complete checkpoint in ``dir`` when one exists."""
    resume_from: Optional[str] = None
    """Resume from this checkpoint directory (a ``step_N``) instead of the newest one, at the job's
    first start only (restarts of the job resume from its newest checkpoint). Checkpoints in
    ``dir`` newer than it are renamed ``*.abandoned-*`` then: never deleted, never picked again."""
    writer_threads: int = Field(default=2, gt=0)
    """Files each rank writes in parallel (``async`` mode)."""
    verify: Literal["load", "restore", "never"] = "load"
    """Check files against the checksums in ``COMPLETE`` (CRC32C, recorded while writing):
    ``load``: before every resume (each rank reads a share of the files) and after an S3 restore;
    ``restore``: after an S3 restore only; ``never``. A checkpoint that fails is skipped for the
    previous one, the file named."""
    write_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for a background write when the loop must wait for it (a save due while the
    previous one is written, the final save); past it the checkpoint fails on every rank. Keep it
    below ``resilience.checkpoint_timeout_s``, so a stuck write is reported as such."""
    job_id: Optional[str] = None
    """Who writes ``dir``: two jobs may not write one directory (a lease names the holder).
    Unset: the launcher's rendezvous id (``TORCHELASTIC_RUN_ID``, the same for every restart of a
    job), else the process (a trainer without a launcher)."""
    s3: S3Config = dataclasses.field(default_factory=S3Config)
    """The S3 tier: durable copies of committed checkpoints, restore on a fresh cluster."""


@dataclass(config=_STRICT)
class ResilienceConfig:
    in_process: bool = False
    """Wrap training in NVRx in-process restart (``inprocess.Wrapper``): after an exception or a
    hang in any rank, every rank re-creates the process group and the model and reloads the
    newest checkpoint in the same processes. The in-job restart stays on either way."""
    in_process_max_iterations: int = Field(default=5, gt=0)
    """In-process restarts a process makes before it gives up and leaves the fault to the in-job
    restart (``ft_launcher`` respawns the workers)."""
    in_process_soft_timeout_s: float = Field(default=60.0, gt=0)
    """A rank making no progress (no completed step) this long is aborted and restarted in-process."""
    in_process_hard_timeout_s: float = Field(default=90.0, gt=0)
    """A rank still hung this long is terminated (then the in-job restart takes over)."""
    in_process_heartbeat_timeout_s: float = Field(default=30.0, gt=0)
    """A rank whose in-process monitor misses heartbeats this long is considered gone."""
    in_process_barrier_timeout_s: float = Field(default=120.0, gt=0)
    """How long ranks wait for each other between in-process restart iterations."""
    in_process_store_port_offset: int = Field(default=1, gt=0)
    """The in-process restart's store listens on ``MASTER_PORT`` + this on the rank-0 host."""
    max_restarts: int = Field(default=3, ge=0)
    """In-job restarts: how many times ``ft_launcher`` respawns a node's workers before the node
    fails (then the job-level policy, ``restartPolicy``/``backoffLimit``, decides)."""
    init_timeout_s: Optional[float] = Field(default=900.0, gt=0)
    """In-job hang detection: longest start-up (process group, model, resume) before the rank is
    declared hung and restarted. ``null`` disables it."""
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
    workers_stop_timeout_s: float = Field(default=15.0, gt=0)
    """When restarting workers after a fault, how long ``ft_launcher`` waits between SIGTERM and
    SIGKILL (a rank stuck in a collective that cannot be aborted is killed after this)."""
    graceful_stop_timeout_s: float = Field(default=600.0, gt=0)
    """On SIGTERM to a node (eviction, spot reclaim), how long its ranks get to finish the step and
    commit a checkpoint before they are killed; keep it below the pod's
    ``terminationGracePeriodSeconds``."""
    stop_exit_code: int = Field(default=143, ge=128, le=255)
    """Exit code of a rank that stopped gracefully on SIGTERM: 128-255, which the PyTorchJob
    ``ExitCode`` restart policy retries."""
    inject: list[str] = dataclasses.field(default_factory=list)
    """Faults to inject, ``KIND@STEP[:rank=R | :node=N][:for=SECONDS]`` (also ``--inject``); KIND is
    exception, hang, hang-in-collective, sigkill, sigkill-during-save, sigterm, node-loss or
    partition (``for=`` only). ``node=N``: the node's local rank 0. Each fires once per job. For
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


_ADAPTER = TypeAdapter(Config)


_SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "dist": DistConfig,
    "checkpoint": CheckpointConfig,
    "resilience": ResilienceConfig,
}


def _section_class(loc: tuple) -> Optional[type]:
    """The dataclass holding the key at ``loc``; None when the parent is not a section."""
    cls: Optional[type] = Config
    for part in loc[:-1]:
        cls = _subsection(cls, part)
        if cls is None:
            return None
    return cls


def _subsection(cls: type, name: str) -> Optional[type]:
    """The dataclass type of ``cls.name`` when that field is a nested section, else None."""
    info = getattr(cls, "__pydantic_fields__", {}).get(name)
    annotation = info.annotation if info is not None else None
    return annotation if isinstance(annotation, type) and dataclasses.is_dataclass(annotation) else None


def _explain(error: dict) -> str:
    """One line per problem: the dotted key, what is wrong, and what would be accepted."""
    loc = tuple(str(p) for p in error["loc"])
    key = ".".join(loc)
    if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        parent = _section_class(loc)
        valid = [f.name for f in dataclasses.fields(parent)] if parent else []
        hint = difflib.get_close_matches(loc[-1], valid, n=1)
        where = ".".join(loc[:-1]) or "the top level"
        msg = f"unknown key '{key}'"
        if hint:
            msg += f" (did you mean '{'.'.join(loc[:-1] + (hint[0],))}'?)"
        return msg + (f"; valid keys in {where}: {', '.join(valid)}" if valid else "")
    if error["type"] == "literal_error":
        return f"{key}: {error['input']!r} is not valid; choose one of {error['ctx']['expected']}"
    if error["type"] in ("dataclass_type", "model_type", "dataclass_args_type"):
        return f"{key}: expected a section (a mapping of keys), got {error['input']!r}"
    return f"{key}: {error['msg']} (got {error['input']!r})"


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"--set {dotted}=...: empty key segment; use section.key=value")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


# A number as people write one: YAML 1.1 (PyYAML) reads `3e-4` and `1e30` as strings, since its
# floats need a dot and a signed exponent.
_NUMBER = re.compile(r"^[-+]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)(?:[eE][-+]?\d+)?$")


def _field_annotation(parts: list[str]) -> Any:
    """The declared type of the key at ``parts`` (a section's class for a section), or None."""
    cls: Optional[type] = Config
    for part in parts[:-1]:
        cls = _subsection(cls, part)
        if cls is None:
            return None
    info = getattr(cls, "__pydantic_fields__", {}).get(parts[-1])
    return info.annotation if info is not None else None


def _alternatives(annotation: Any) -> list[Any]:
    """The types a value of ``annotation`` may have (``Optional[float]``: ``[float]``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _typed(annotation: Any, value: Any, raw: Optional[str] = None) -> Any:
    """``value`` as a key of type ``annotation`` takes it: a number written ``3e-4`` for a number
    key, the text as written for a string key (``raw``: the ``--set`` text, when there is one).
    Anything else is left for validation to accept or to refuse with the key's name."""
    if value is None:
        return value
    kinds = _alternatives(annotation)
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        if float in kinds:
            return float(value)
        if int in kinds and float(value).is_integer():
            return int(float(value))  # 1e5 steps
    textual = [k for k in kinds if k is str or typing.get_origin(k) is Literal]
    if raw is not None and textual and len(textual) == len(kinds) and not isinstance(value, str):
        return raw  # a string key: --set model.factory=123 is the text 123
    if isinstance(value, (list, tuple)) and kinds and typing.get_origin(kinds[0]) in (tuple, list):
        args = [a for a in typing.get_args(kinds[0]) if a is not Ellipsis]
        if args:
            return [_typed(args[min(i, len(args) - 1)], v) for i, v in enumerate(value)]
    return value


def _typed_tree(tree: dict, parts: tuple[str, ...] = ()) -> dict:
    """Every value of a user tree as its key's type takes it (see :func:`_typed`)."""
    out = {}
    for key, value in tree.items():
        path = [*parts, str(key)]
        annotation = _field_annotation(path)
        if isinstance(value, dict) and isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            out[key] = _typed_tree(value, tuple(path))
        else:
            out[key] = _typed(annotation, value) if annotation is not None else value
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key=value``; the value is read as a config file's would be: YAML (``3`` is an int,
    ``true`` a bool), a number for a number key however it is written (``3e-4``), the text itself
    for a string key."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value, for example --set train.steps=50")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    annotation = _field_annotation(key.split("."))
    if annotation is not None and not (isinstance(annotation, type) and dataclasses.is_dataclass(annotation)):
        value = _typed(annotation, value, raw)
    elif isinstance(value, dict) and annotation is not None:
        value = _typed_tree(value, tuple(key.split(".")))
    return key, value


def user_tree(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> dict:
    """The keys a user set, typed: the YAML file at ``path``, then ``overrides`` (``key=value``)."""
    tree: dict = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"--config {path}: no such file") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config {path}: not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"--config {path}: the top level must be a mapping of sections")
        tree = _typed_tree(loaded or {})
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    return tree


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> Config:
    """Build the configuration: defaults < YAML file at ``path`` < ``overrides`` (``key=value``)."""
    tree = user_tree(path, overrides)
    try:
        config = _ADAPTER.validate_python(tree)
    except ValidationError as exc:
        lines = [_explain(e) for e in exc.errors()]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None
    _check_across_keys(config)
    return config


def _check_across_keys(config: Config) -> None:
    """Rules that involve more than one key; each message names the keys and the fix."""
    r = config.resilience
    if r.in_process:
        order = [("in_process_soft_timeout_s", r.in_process_soft_timeout_s),
                 ("in_process_hard_timeout_s", r.in_process_hard_timeout_s),
                 ("in_process_barrier_timeout_s", r.in_process_barrier_timeout_s)]
        for (a, va), (b, vb) in zip(order, order[1:]):
            if not va < vb:
                raise ConfigError(f"resilience.{a}={va} must be less than resilience.{b}={vb}")
        # In-process restart must get its chance before ft_launcher kills the hung rank.
        for key in ("step_timeout_s", "checkpoint_timeout_s", "out_of_section_timeout_s"):
            value = getattr(r, key)
            if value is not None and not value > r.in_process_hard_timeout_s:
                raise ConfigError(f"resilience.{key}={value} must exceed resilience.in_process_hard_timeout_s="
                                  f"{r.in_process_hard_timeout_s}: in-job hang detection would kill a rank before "
                                  "in-process restart can recover it")
        if not r.in_process_heartbeat_timeout_s < r.in_process_barrier_timeout_s:
            raise ConfigError(f"resilience.in_process_heartbeat_timeout_s={r.in_process_heartbeat_timeout_s} must be "
                              f"less than resilience.in_process_barrier_timeout_s={r.in_process_barrier_timeout_s}")
    for text in r.inject:
        parse_fault(text, key="resilience.inject")
    check_s3_config(config.checkpoint.s3)


# ---- the value grammars the configuration checks -----------------------------------------------
# Here rather than in the modules that use them (resilience.faults, checkpoint.s3), so that
# those import the configuration and it imports nothing of this package.

FAULT_KINDS = ("exception", "hang", "hang-in-collective", "sigkill", "sigkill-during-save", "sigterm", "node-loss",
               "partition")
# Kinds whose effect is on a whole node (pod): their natural target is ``node=N``.
NODE_FAULT_KINDS = ("node-loss", "partition")
_FAULT_SPEC = re.compile(r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?P<options>(?::[^:]*)*)$")
_FAULT_GRAMMAR = "KIND@STEP[:rank=R | :node=N][:for=SECONDS]"


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """One fault to inject, ``KIND@STEP[:rank=R | :node=N][:for=SECONDS]`` (see
    :mod:`resilient_fsdp.resilience.faults`). ``node=N`` targets the lowest rank of node (pod) N,
    its local rank 0; without ``node`` the target is ``rank`` (0 by default). ``for_s``: how long a
    ``partition`` lasts (None: for good)."""

    kind: str
    step: int
    rank: int = 0
    node: Optional[int] = None
    for_s: Optional[float] = None

    @property
    def key(self) -> str:
        """File-name-safe identity of this fault."""
        target = f"node{self.node}" if self.node is not None else f"rank{self.rank}"
        return f"{self.kind}@{self.step}-{target}"

    @property
    def target(self) -> str:
        return f"node={self.node}" if self.node is not None else f"rank={self.rank}"

    def __str__(self) -> str:
        duration = f":for={self.for_s:g}" if self.for_s is not None else ""
        return f"{self.kind}@{self.step}:{self.target}{duration}"


def parse_fault(text: str, key: str = "--inject") -> FaultSpec:
    m = _FAULT_SPEC.match(text.strip())
    if not m:
        raise ConfigError(f"{key} {text!r}: expected {_FAULT_GRAMMAR}, e.g. sigkill@20:rank=1 or "
                          "node-loss@12:node=0")
    if m["kind"] not in FAULT_KINDS:
        raise ConfigError(f"{key} {text!r}: unknown fault kind '{m['kind']}'; choose one of "
                          f"{', '.join(FAULT_KINDS)}")
    step = int(m["step"])
    if step < 1:
        raise ConfigError(f"{key} {text!r}: STEP must be 1 or more")
    options: dict[str, str] = {}
    for part in m["options"].split(":")[1:]:
        name, _, value = part.partition("=")
        if name not in ("rank", "node", "for") or not value:
            raise ConfigError(f"{key} {text!r}: unknown option {part!r}; expected {_FAULT_GRAMMAR}")
        if name in options:
            raise ConfigError(f"{key} {text!r}: '{name}' is given twice")
        options[name] = value
    if "rank" in options and "node" in options:
        raise ConfigError(f"{key} {text!r}: give rank=R or node=N, not both (node=N fires on the node's local "
                          "rank 0)")
    for name in ("rank", "node"):
        if name in options and not options[name].isdigit():
            raise ConfigError(f"{key} {text!r}: {name} must be a whole number 0 or more")
    for_s = None
    if "for" in options:
        if m["kind"] != "partition":
            raise ConfigError(f"{key} {text!r}: for=SECONDS applies to partition only")
        try:
            for_s = float(options["for"])
        except ValueError:
            for_s = -1.0
        if not for_s > 0:
            raise ConfigError(f"{key} {text!r}: for= must be a number of seconds above 0")
    node = int(options["node"]) if "node" in options else None
    return FaultSpec(m["kind"], step, int(options.get("rank", 0)), node, for_s)


def parse_faults(texts: list[str], world_size: Optional[int] = None, nodes: Optional[int] = None
                 ) -> list[FaultSpec]:
    specs = [parse_fault(t, "resilience.inject") for t in texts]
    for spec in specs:
        if world_size is not None and spec.node is None and spec.rank >= world_size:
            raise ConfigError(f"resilience.inject {str(spec)!r}: rank {spec.rank} does not exist in a job of "
                              f"{world_size} ranks")
        if nodes is not None and spec.node is not None and spec.node >= nodes:
            raise ConfigError(f"resilience.inject {str(spec)!r}: node {spec.node} does not exist in a job of "
                              f"{nodes} node(s)")
    return specs


_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def split_s3_uri(uri: str, key: str = "checkpoint.s3.uri") -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without slashes at either end); a ConfigError naming
    ``key`` otherwise."""
    if not uri.startswith("s3://"):
        raise ConfigError(f"{key}={uri!r} must look like s3://bucket/prefix")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ConfigError(f"{key}={uri!r}: {bucket!r} is not a valid bucket name (3-63 characters: lower-case "
                          "letters, digits, dots and hyphens)")
    prefix = prefix.strip("/")
    if "//" in prefix:
        raise ConfigError(f"{key}={uri!r}: empty path segment in the prefix")
    return bucket, prefix


def check_s3_config(cfg: S3Config) -> None:
    """Rules across ``checkpoint.s3`` keys; each message names the key and the fix."""
    if cfg.uri is None:
        return
    split_s3_uri(cfg.uri)
    if cfg.endpoint_url is not None and not re.match(r"^https?://[^/\s]+", cfg.endpoint_url):
        raise ConfigError(f"checkpoint.s3.endpoint_url={cfg.endpoint_url!r} must look like http(s)://host:port")
    if cfg.retry_backoff_s > cfg.retry_backoff_max_s:
        raise ConfigError(f"checkpoint.s3.retry_backoff_s={cfg.retry_backoff_s} must not exceed "
                          f"checkpoint.s3.retry_backoff_max_s={cfg.retry_backoff_max_s}")


def to_dict(config: Config) -> dict:
    """Plain nested dict of the resolved configuration (tuples as lists, YAML-friendly)."""
    return _ADAPTER.dump_python(config, mode="json")


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def describe() -> str:
    """Every key with its default and docstring, for ``resilient-fsdp config --describe``."""
    lines = []
    defaults = to_dict(Config())

    def walk(cls: type, prefix: str, values: dict) -> None:
        for f in dataclasses.fields(cls):
            info = cls.__pydantic_fields__[f.name]
            key = prefix + f.name
            section = _subsection(cls, f.name)
            if section is not None:
                lines.append(f"\n[{key}] {info.description or ''}")
                walk(section, key + ".", values[f.name])
            else:
                desc = " ".join((info.description or "").split())
                lines.append(f"{key} = {values[f.name]!r}\n    {desc}")

    walk(Config, "", defaults)
    return "\n".join(lines).strip() + "\n"
