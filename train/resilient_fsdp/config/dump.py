"""The configuration as text: the resolved YAML a run keeps, and every key described."""

from __future__ import annotations

import dataclasses

import yaml
from pydantic import TypeAdapter

from .fault_spec import FAULT_KINDS
from .sections import Config, subsection

_ADAPTER = TypeAdapter(Config)


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
            section = subsection(cls, f.name)
            if section is not None:
                lines.append(f"\n[{key}] {info.description or ''}")
                walk(section, key + ".", values[f.name])
            else:
                desc = " ".join((info.description or "").split())
                lines.append(f"{key} = {values[f.name]!r}\n    {desc}")

    walk(Config, "", defaults)
    lines.append("\n[resilience.inject kinds] KIND@STEP[:rank=R | :node=N][:for=SECONDS][:factor=F]")
    for kind in FAULT_KINDS.values():
        lines.append(f"{kind.name}\n    {kind.what}; recovered by: {kind.recovered_by}")
    return "\n".join(lines).strip() + "\n"
