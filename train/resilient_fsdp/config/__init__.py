"""The typed run configuration: one source of truth for every component.

- ``sections``: the sections and their keys, each with its type, default and docstring;
- ``loading``: defaults < YAML file (``--config``) < ``--set``, typed values, validation and the
  rules across keys, errors that name the key;
- ``fault_spec``: the table of fault kinds and the grammar of one fault to inject;
- ``s3_uri``: the grammar of ``s3://bucket/prefix``;
- ``dump``: the resolved configuration as YAML, and every key described;
- ``errors``: :class:`ConfigError`.

The package imports nothing else of ``resilient_fsdp``, so everything can import it.
"""

from .dump import describe, dump_yaml, to_dict
from .errors import ConfigError
from .fault_spec import (
    CUT_OFF_KINDS,
    FAULT_KINDS,
    MEMORY_FAULT_KINDS,
    NODE_FAULT_KINDS,
    REPLICA_FAULT_KINDS,
    FaultKind,
    FaultSpec,
    parse_fault,
    parse_faults,
)
from .loading import DUMP_MARGIN_S, check_collective_timeouts, check_s3_config, load_config, parse_override, user_tree
from .s3_uri import split_s3_uri
from .sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    DistConfig,
    HangDetectionConfig,
    InProcessConfig,
    LauncherConfig,
    MemoryConfig,
    ModelConfig,
    OptimConfig,
    ResilienceConfig,
    S3Config,
    StopConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DUMP_MARGIN_S",
    "DataConfig",
    "DistConfig",
    "FAULT_KINDS",
    "FaultKind",
    "CUT_OFF_KINDS",
    "FaultSpec",
    "HangDetectionConfig",
    "InProcessConfig",
    "LauncherConfig",
    "MEMORY_FAULT_KINDS",
    "REPLICA_FAULT_KINDS",
    "ModelConfig",
    "MemoryConfig",
    "NODE_FAULT_KINDS",
    "OptimConfig",
    "ResilienceConfig",
    "S3Config",
    "StopConfig",
    "TrainConfig",
    "check_collective_timeouts",
    "check_s3_config",
    "describe",
    "dump_yaml",
    "load_config",
    "parse_fault",
    "parse_faults",
    "parse_override",
    "split_s3_uri",
    "to_dict",
    "user_tree",
]
