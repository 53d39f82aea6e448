"""Helm's refusals as sentences: a values-schema report becomes one line per problem (the dotted
key, what was given, what is allowed, the closest valid key), and a template's ``fail`` its own
message. Used by :mod:`.chart` when a render fails.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from ..config.errors import did_you_mean


# Keys a values file may carry from other charts' vocabulary, with what this chart says instead.
NOT_CHART_KEYS = {
    "elastic": (
        "a job trains at a fixed world of `nodes` pods: NVRx 0.6 and newer (the image's) trains at the "
        "first number of --nnodes=min:max and keeps the other pods standby. Set nodes (the pods that "
        "train) and spares (standby pods that take a lost pod's place within an in-job restart); to "
        "train at another size, launch again with another nodes (checkpoints reshard)"
    ),
}

_SCHEMA_LINE = re.compile(r"^- at '(?P<path>[^']*)': (?P<what>.*)$")
_ADDITIONAL = re.compile(r"additional propert(?:y|ies) (?P<names>.+) not allowed")
_TYPE = re.compile(r"^got (?P<got>\w+), want (?P<want>.+)$")
_BOUND = re.compile(
    r"^(?P<rule>minimum|maximum|exclusiveMinimum|exclusiveMaximum|minLength|maxLength|minItems|"
    r"maxItems): got (?P<got>\S+), want (?P<want>\S+)$"
)
_BOUND_TEXT = {
    "minimum": "{} or more",
    "maximum": "at most {}",
    "exclusiveMinimum": "more than {}",
    "exclusiveMaximum": "less than {}",
    "minLength": "at least {} character(s)",
    "maxLength": "at most {} character(s)",
    "minItems": "at least {} item(s)",
    "maxItems": "at most {} item(s)",
}
_TYPE_TEXT = {
    "integer": "a whole number",
    "number": "a number",
    "string": "text",
    "boolean": "true or false",
    "object": "a map of keys",
    "array": "a list",
    "null": "nothing (null)",
}


def _schema_at(schema: dict, parts: list[str]) -> dict:
    """The schema node of the value at ``parts`` (list indexes walk into ``items``); ``{}`` if unknown."""
    node = schema
    for part in parts:
        if part.isdigit() and "items" in node:
            node = node["items"] if isinstance(node["items"], dict) else {}
        else:
            node = (node.get("properties") or {}).get(part) or (
                node["additionalProperties"] if isinstance(node.get("additionalProperties"), dict) else {}
            )
    return node


def _value_at(values: dict, parts: list[str]) -> Any:
    node: Any = values
    for part in parts:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def _dotted(parts: list[str]) -> str:
    return "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in parts).lstrip(".")


def trainer_top_keys(schema: dict) -> set[str]:
    """The trainer's own top-level keys (``train``, ``optim``, ...): a chart value under ``trainer``."""
    return set((schema.get("properties", {}).get("trainer") or {}).get("properties", {}))


def _unknown_key(parent: list[str], name: str, schema: dict) -> str:
    full = _dotted(parent + [name])
    if full in NOT_CHART_KEYS:
        return f"unknown key '{full}': {NOT_CHART_KEYS[full]}"
    if not parent and name in trainer_top_keys(schema):
        return (
            f"unknown key '{full}': {name} is a trainer key; in the chart's values it is trainer.{name} "
            f"(e.g. --set trainer.{name}.KEY=VALUE, or under trainer: in a values file)"
        )
    valid = _schema_at(schema, parent).get("properties") or {}
    return (
        f"unknown key '{full}'{did_you_mean(full, [_dotted(parent + [k]) for k in valid])}: remove it or use one of the keys of "
        f"{_dotted(parent) or 'the top level'} ({', '.join(sorted(valid)) or 'none'})"
    )


def _sentence(parts: list[str], what: str, values: dict, schema: dict) -> str:
    """One schema failure as what was given and what is allowed."""
    key, node = _dotted(parts) or "(top level)", _schema_at(schema, parts)
    given = _value_at(values, parts)
    shown = json.dumps(given) if isinstance(given, (str, int, float, bool)) or given is None else type(given).__name__
    about = f" ({node['description'].rstrip('.')})" if node.get("description") else ""
    if m := _TYPE.match(what):
        wants = [_TYPE_TEXT.get(w.strip(), w.strip()) for w in m["want"].split(" or ")]
        return (
            f"{key}: got {shown} ({_TYPE_TEXT.get(m['got'], m['got'])}); allowed: {' or '.join(wants)}"
            + _text_for_a_number_hint(key, what)
        )
    if m := _BOUND.match(what):
        return f"{key}: got {shown}; allowed: {_BOUND_TEXT[m['rule']].format(m['want'])}"
    if what.startswith("value must be one of") and "enum" in node:
        allowed = ", ".join(json.dumps(v) for v in node["enum"])
        return (
            f"{key}: got {shown}; allowed: one of {allowed}{did_you_mean(str(given), [str(v) for v in node['enum']])}"
        )
    if "does not match pattern" in what:
        if parts[:2] == ["chaos", "inject"]:
            from ..config import FAULT_KINDS

            return (
                f"{key}: got {shown}; allowed: a fault spec KIND@STEP[:rank=R|:node=N][:for=S][:factor=F] "
                f"with KIND one of {', '.join(FAULT_KINDS)}{did_you_mean(str(given).split('@')[0], FAULT_KINDS)}"
            )
        return f"{key}: got {shown}; allowed: text matching {node.get('pattern', '?')}{about}"
    if what.endswith("' failed") and isinstance(node.get("not"), dict) and "const" in node["not"]:
        return f"{key}: got {shown}; allowed: anything but {json.dumps(node['not']['const'])}{about}"
    return f"{key}: {what}"


def explain_schema_error(detail: str, values: Optional[dict] = None, schema: Optional[dict] = None) -> str:
    """Helm's schema report as sentences, one per problem: the dotted key, what was given, what
    is allowed (and the closest valid key for an unknown one)."""
    values, schema = values or {}, schema or {}
    lines = []
    for raw in detail.splitlines():
        m = _SCHEMA_LINE.match(raw.strip())
        if not m:
            continue
        parts = [p for p in m["path"].strip("/").split("/") if p]
        extra = _ADDITIONAL.search(m["what"])
        if extra:
            lines += [_unknown_key(parts, name, schema) for name in re.findall(r"'([^']+)'", extra["names"])]
        else:
            lines.append(_sentence(parts, m["what"], values, schema))
    if not lines:  # a report shape this parser does not know: show it whole
        lines = [detail]
    unique = list(dict.fromkeys(lines))
    return "values rejected by the chart's values.schema.json:\n  " + "\n  ".join(unique)


def _text_for_a_number_hint(key: str, what: str) -> str:
    """How to pass a number where helm's ``--set`` made it text (it reads only integers and
    booleans, so ``3e-4`` and ``0.0003`` arrive as strings)."""
    if not re.search(r"got string, want (number|integer)", what):
        return ""
    trainer_key = key.removeprefix("trainer.") if key.startswith("trainer.") else None
    local = f"--set {trainer_key}=<number> or " if trainer_key else ""
    return (
        f"; helm's --set passes anything but an integer or a boolean as text: give the number with "
        f"--set-json {key}=<number> or in a values file (-f); resilient-fsdp local: {local}"
        f"--value-json {key}=<number>"
    )


def explain_render_error(detail: str) -> str:
    """The message of a template's ``fail`` (or the raw render error when it is not one)."""
    m = re.search(r"execution error at \([^)]*\): (?P<msg>.*)", detail, re.S)
    message = m["msg"] if m else detail
    # The SDK repeats the message after the error code's own text; keep one copy.
    half = len(message) // 2
    if len(message) > 1 and message[:half].strip() and message[half:].strip().endswith(message[:half].strip()):
        message = message[:half]
    return message.strip()
