"""Loading the configuration: defaults < a YAML file (``--config FILE``) < ``--set
section.key=value`` overrides in the order given, validated, with cross-key rules.

Values are read as their key's type takes them (a number written ``3e-4`` for a number key,
the text as written for a string key), the same from a file and from ``--set``. Every problem is
reported naming the dotted key and what it accepts; an unknown key names the closest valid one.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import TypeAdapter, ValidationError

from .errors import ConfigError, did_you_mean
from .fault_spec import MEMORY_FAULT_KINDS, REPLICA_FAULT_KINDS, parse_fault
from .s3_uri import split_s3_uri
from .sections import Config, S3Config, field_annotation, section_of

_ADAPTER = TypeAdapter(Config)

# A section whose on/off switch is a key inside it.
SECTION_SWITCHES = {"resilience.in_process": "resilience.in_process.enabled"}


def _explain(error: dict) -> str:
    """One line per problem: the dotted key, what is wrong, and what would be accepted."""
    loc = tuple(str(p) for p in error["loc"])
    key = ".".join(loc)
    if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        parent = section_of(loc)
        valid = [f.name for f in dataclasses.fields(parent)] if parent else []
        where = ".".join(loc[:-1]) or "the top level"
        msg = f"unknown key '{key}'" + did_you_mean(loc[-1], valid, prefix="".join(f"{p}." for p in loc[:-1]))
        return msg + (f"; valid keys in {where}: {', '.join(valid)}" if valid else "")
    if error["type"] == "literal_error":
        return f"{key}: {error['input']!r} is not valid; choose one of {error['ctx']['expected']}"
    if error["type"] in ("dataclass_type", "model_type", "dataclass_args_type"):
        if key in SECTION_SWITCHES:
            return f"{key}: a section, not a value: set {SECTION_SWITCHES[key]}={yaml.safe_dump(error['input']).split(chr(10))[0]}"
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
        annotation = field_annotation(path)
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
    annotation = field_annotation(key.split("."))
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
    ip, hang = r.in_process, r.hang_detection
    if ip.enabled:
        order = [
            ("soft_timeout_s", ip.soft_timeout_s),
            ("hard_timeout_s", ip.hard_timeout_s),
            ("barrier_timeout_s", ip.barrier_timeout_s),
        ]
        for (a, va), (b, vb) in zip(order, order[1:]):
            if not va < vb:
                raise ConfigError(f"resilience.in_process.{a}={va} must be less than resilience.in_process.{b}={vb}")
        # In-process restart must get its chance before ft_launcher kills the hung rank.
        for key in ("step_timeout_s", "checkpoint_timeout_s", "out_of_section_timeout_s"):
            value = getattr(hang, key)
            if value is not None and not value > ip.hard_timeout_s:
                raise ConfigError(
                    f"resilience.hang_detection.{key}={value} must exceed "
                    f"resilience.in_process.hard_timeout_s={ip.hard_timeout_s}: in-job hang detection "
                    "would kill a rank before in-process restart can recover it"
                )
        if not ip.heartbeat_timeout_s < ip.barrier_timeout_s:
            raise ConfigError(
                f"resilience.in_process.heartbeat_timeout_s={ip.heartbeat_timeout_s} must be less than "
                f"resilience.in_process.barrier_timeout_s={ip.barrier_timeout_s}"
            )
    check_injected_faults(config)
    check_data_source(config)
    check_s3_config(config.checkpoint.s3)
    check_restore_fits_init(config)
    check_lease_wait_fits_init(config)
    if config.dist.device == "cuda":  # "auto": checked by the trainer once it sees a GPU
        check_collective_timeouts(config)


def check_injected_faults(config: Config) -> None:
    """Each ``resilience.inject`` fault has what it acts on: the memory tier's faults need it on,
    the replicas' faults need replicas. Also called once ``--inject`` (the chart's chaos drill)
    has added its faults to a loaded configuration."""
    memory = config.checkpoint.memory
    for text in config.resilience.inject:
        spec = parse_fault(text, key="resilience.inject")
        if spec.kind in MEMORY_FAULT_KINDS and memory.interval_steps == 0:
            raise ConfigError(
                f"resilience.inject {text!r}: a {spec.kind} fault acts on memory checkpoints, and "
                "checkpoint.memory.interval_steps is 0 (off); set it, e.g. to 2"
            )
        if spec.kind in REPLICA_FAULT_KINDS and memory.replicas == 0:
            raise ConfigError(
                f"resilience.inject {text!r}: a {spec.kind} fault acts on the replicas ranks keep, "
                "and checkpoint.memory.replicas is 0; set it to 1"
            )


# After a collective times out, NCCL's watchdog waits for the flight recorder's dump before it
# aborts (TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC: 15 s in torch's recent sources), and ft_launcher checks its
# section timeouts every workload_check_interval_s: a minute covers both, with room for a slow
# shared volume.
DUMP_MARGIN_S = 60.0
HANG_SECTIONS = ("step_timeout_s", "checkpoint_timeout_s", "out_of_section_timeout_s")


def check_collective_timeouts(config: Config) -> None:
    """Rules for NCCL process groups, where a collective's timeout is the hang's diagnosis: the
    watchdog must time out a hung collective (and the flight recorder dump it) before in-job hang
    detection kills the rank, and after in-process restart's hard timeout (NVRx's requirement).
    Gloo has no watchdog and no dump, so CPU runs are not held to them."""
    d, r = config.dist, config.resilience
    hang = r.hang_detection
    for key in HANG_SECTIONS:
        value = getattr(hang, key)
        if value is not None and not d.timeout_s + DUMP_MARGIN_S <= value:
            raise ConfigError(
                f"dist.timeout_s={d.timeout_s:g} must be at least {DUMP_MARGIN_S:g} s below "
                f"resilience.hang_detection.{key}={value:g}: ft_launcher would kill a rank hung in a collective "
                f"before NCCL's watchdog times the collective out and its flight recorder dumps; set "
                f"dist.timeout_s={value - DUMP_MARGIN_S:g} or less, or raise resilience.hang_detection.{key}"
            )
    if hang.init_timeout_s is not None and not d.init_timeout_s + DUMP_MARGIN_S <= hang.init_timeout_s:
        raise ConfigError(
            f"dist.init_timeout_s={d.init_timeout_s:g} must be at least {DUMP_MARGIN_S:g} s below "
            f"resilience.hang_detection.init_timeout_s={hang.init_timeout_s:g}: a collective hung during start-up "
            f"would be killed before NCCL times it out and dumps; set dist.init_timeout_s="
            f"{hang.init_timeout_s - DUMP_MARGIN_S:g} or less, or raise resilience.hang_detection.init_timeout_s"
        )
    if r.in_process.enabled and not d.timeout_s > r.in_process.hard_timeout_s:
        raise ConfigError(
            f"dist.timeout_s={d.timeout_s:g} must exceed resilience.in_process.hard_timeout_s="
            f"{r.in_process.hard_timeout_s:g}: NCCL's watchdog would end the process before in-process restart "
            "can recover it (NVRx's requirement)"
        )


def check_data_source(config: Config) -> None:
    """What the data needs besides itself: a token file's path, and sequences the model takes. The
    chart applies the same rules at render (``templates/validations.yaml``)."""
    data, model = config.data, config.model
    if data.source == "tokens" and not data.factory and not data.path:
        raise ConfigError(
            "data.source=tokens needs data.path: set data.path to the directory `resilient-fsdp data "
            "prepare` wrote, on the shared volume or under s3:// (or data.source=synthetic)"
        )
    if data.path and data.path.startswith("s3://"):
        split_s3_uri(data.path, "data.path")
    if model.hf_config and model.factory:
        raise ConfigError(
            f"model.hf_config={model.hf_config!r} and model.factory={model.factory!r} both name the model: keep one"
        )
    if model.hf_config and model.vocab_size is not None:
        raise ConfigError(
            f"model.vocab_size={model.vocab_size} does not apply with model.hf_config (its config.json's "
            "vocab_size is the model's): remove model.vocab_size"
        )
    if model.max_seq_len is not None and data.seq_len > model.max_seq_len:
        raise ConfigError(
            f"data.seq_len={data.seq_len} is above model.max_seq_len={model.max_seq_len}, the longest "
            f"sequence the model takes: set data.seq_len={model.max_seq_len} or less"
        )


def check_restore_fits_init(config: Config) -> None:
    """An S3 restore runs at start, inside the init hang-detection section: a restore allowed
    longer than that section would be killed by ft_launcher as a hang while it still downloads."""
    ckpt, hang = config.checkpoint, config.resilience.hang_detection
    restores = bool(ckpt.s3.uri and ckpt.s3.restore and ckpt.resume and not ckpt.resume_from)
    if not restores or hang.init_timeout_s is None:
        return
    if not ckpt.s3.restore_timeout_s < hang.init_timeout_s:
        raise ConfigError(
            f"checkpoint.s3.restore_timeout_s={ckpt.s3.restore_timeout_s:g} must be less than "
            f"resilience.hang_detection.init_timeout_s={hang.init_timeout_s:g}: the restore from S3 runs in the "
            f"init section, and ft_launcher would kill a rank still restoring as hung; lower "
            f"checkpoint.s3.restore_timeout_s, raise resilience.hang_detection.init_timeout_s, or set "
            f"checkpoint.s3.restore=false"
        )


def check_lease_wait_fits_init(config: Config) -> None:
    """The wait for an earlier install's lease is part of start-up, inside the init hang-detection
    section: a wait allowed longer would be killed by ft_launcher as a hang."""
    ckpt, hang = config.checkpoint, config.resilience.hang_detection
    if hang.init_timeout_s is not None and not ckpt.lease_wait_s < hang.init_timeout_s:
        raise ConfigError(
            f"checkpoint.lease_wait_s={ckpt.lease_wait_s:g} must be less than "
            f"resilience.hang_detection.init_timeout_s={hang.init_timeout_s:g}: the wait for an earlier install to "
            "release checkpoint.dir is part of start-up, which ft_launcher would kill as hung; lower "
            "checkpoint.lease_wait_s or raise resilience.hang_detection.init_timeout_s"
        )


def check_s3_config(cfg: S3Config) -> None:
    """Rules across ``checkpoint.s3`` keys; each message names the key and the fix."""
    if cfg.uri is None:
        return
    split_s3_uri(cfg.uri)
    if cfg.endpoint_url is not None and not re.match(r"^https?://[^/\s]+", cfg.endpoint_url):
        raise ConfigError(f"checkpoint.s3.endpoint_url={cfg.endpoint_url!r} must look like http(s)://host:port")
    if cfg.retry_backoff_s > cfg.retry_backoff_max_s:
        raise ConfigError(
            f"checkpoint.s3.retry_backoff_s={cfg.retry_backoff_s} must not exceed "
            f"checkpoint.s3.retry_backoff_max_s={cfg.retry_backoff_max_s}"
        )
