"""The Helm chart from Python: merge values as ``helm -f/--set`` does, render, lint.

Rendering uses Helm v4's own engine through ``helm-python-sdk`` (import ``helm_python``), so the
templates, ``values.schema.json`` and the ``fail`` rules in ``templates/validations.yaml`` behave
exactly as in ``helm install``, without a ``helm`` binary. Errors come back as :class:`ChartError`
with the offending key named, as the trainer's configuration errors do.

The chart's ``trainer`` values are the trainer's own configuration; :func:`trainer_schema` derives
their part of ``values.schema.json`` from :mod:`resilient_fsdp.config`, so the chart rejects exactly
the keys the trainer rejects (``python -m resilient_fsdp.deploy.chart --update-schema`` rewrites it).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from ..config import ConfigError
from .values_errors import explain_render_error, explain_schema_error

REPO_ROOT = Path(__file__).resolve().parents[3]
CHART_ENV = "RESILIENT_FSDP_CHART"
DEFAULT_RELEASE = "resilient-fsdp"
DEFAULT_NAMESPACE = "default"
# Where `lint` and the Kubernetes schema validation assume the cluster is (see validate.py).
KUBERNETES_VERSION = "1.34.0"


class ChartError(ConfigError):
    """Values the chart refuses, or a chart that cannot be loaded; the message names the key."""


def _helm():
    """``helm_python``, or an error saying which extra brings it."""
    try:
        import helm_python
    except ImportError:
        raise ChartError(
            "the chart commands need the `chart` extra: pip install -c constraints.txt -e '.[chart]'"
        ) from None
    return helm_python


def chart_dir(explicit: Optional[str | Path] = None) -> Path:
    """The chart: ``explicit``, else ``$RESILIENT_FSDP_CHART``, else ``charts/resilient-fsdp`` of this checkout."""
    path = Path(explicit or os.environ.get(CHART_ENV) or REPO_ROOT / "charts" / "resilient-fsdp")
    if not (path / "Chart.yaml").is_file():
        raise ChartError(
            f"no Helm chart at {path}: pass --chart DIR or set {CHART_ENV} to the "
            "charts/resilient-fsdp directory of a resilient-fsdp checkout"
        )
    return path


def values_schema(chart: Optional[str | Path] = None) -> dict:
    """The chart's ``values.schema.json``."""
    return json.loads((chart_dir(chart) / "values.schema.json").read_text())


def deep_merge(base: dict, override: dict) -> dict:
    """``override`` onto ``base``: maps merge key by key, anything else is replaced (Helm's ``-f``)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_values(files: list[str | Path] = (), sets: list[str] = (), set_json: list[str] = ()) -> dict:
    """User values as ``helm -f FILE... --set-json k=json... --set k=v...`` builds them: files in
    order, then ``--set-json``, then ``--set``."""
    helm_python = _helm()
    values: dict = {}
    for f in files:
        try:
            loaded = yaml.safe_load(Path(f).read_text())
        except FileNotFoundError:
            raise ChartError(f"-f {f}: no such file") from None
        except yaml.YAMLError as exc:
            raise ChartError(f"-f {f}: not valid YAML: {exc}") from None
        if loaded is None:
            continue
        if not isinstance(loaded, dict):
            raise ChartError(f"-f {f}: a values file must be a mapping of keys at the top level")
        values = deep_merge(values, loaded)
    for flag, expression in [("--set-json", e) for e in set_json] + [("--set", e) for e in sets]:
        _refuse_trainer_key(flag, expression)
    for expression in set_json:
        try:
            values = deep_merge(values, helm_python.parse_set_json(expression))
        except helm_python.HelmError as exc:
            raise ChartError(
                f"--set-json {expression!r}: {_detail(exc)} (expected key=<JSON>, e.g. "
                "--set-json trainer.optim.lr=3e-4)"
            ) from None
    for expression in sets:
        if "=" not in expression:
            raise ChartError(f"--set {expression!r}: expected key=value, e.g. --set nodes=4")
        try:
            helm_python.parse_set_string(expression)
        except helm_python.HelmError as exc:
            raise ChartError(f"--set {expression!r}: {_detail(exc)}") from None
    if sets:
        # One expression, as helm joins repeated --set flags: `a[0].name=x` and `a[0].value=y`
        # then fill the same list entry instead of the second replacing the first.
        values = deep_merge(values, helm_python.parse_set_string(",".join(sets)))
    return values


def _refuse_trainer_key(flag: str, expression: str) -> None:
    """A trainer key given as a chart value (``--set train.steps=300``): the chart holds the
    trainer's configuration under ``trainer``, so say the expression that sets it there."""
    import dataclasses

    from ..config import Config

    first = re.split(r"[.\[=]", expression, maxsplit=1)[0]
    if first in {f.name for f in dataclasses.fields(Config)}:
        raise ChartError(
            f"{flag} {expression}: {first} is a trainer key, which the chart's values hold under "
            f"trainer: use {flag} trainer.{expression}"
        )


@dataclass
class Rendered:
    """A rendered release: manifests by template path, and NOTES.txt."""

    manifests: dict[str, str]
    notes: str

    def documents(self) -> list[dict]:
        """Every Kubernetes object, in template order."""
        docs = []
        for path in sorted(self.manifests):
            for doc in yaml.safe_load_all(self.manifests[path]):
                if doc:
                    docs.append(doc)
        return docs

    def find(self, kind: str, name: Optional[str] = None) -> dict:
        """The one object of ``kind`` (and ``name``); raises KeyError naming what exists."""
        matches = [
            d for d in self.documents() if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)
        ]
        if len(matches) != 1:
            have = [f"{d.get('kind')}/{d.get('metadata', {}).get('name')}" for d in self.documents()]
            raise KeyError(f"expected one {kind}{'/' + name if name else ''}, found {len(matches)} in {have}")
        return matches[0]

    def text(self) -> str:
        """Multi-document YAML as ``helm template`` prints it."""
        parts = []
        for path in sorted(self.manifests):
            body = self.manifests[path].strip()
            if body and any(line.strip() and not line.lstrip().startswith("#") for line in body.splitlines()):
                parts.append(f"---\n# Source: {path}\n{body}\n")
        return "".join(parts)


def render(
    values: Optional[dict] = None,
    release: str = DEFAULT_RELEASE,
    namespace: str = DEFAULT_NAMESPACE,
    chart: Optional[str | Path] = None,
    upgrade: bool = False,
) -> Rendered:
    """Render the chart with ``values`` over its defaults (schema and ``fail`` rules enforced),
    as ``helm install`` does (``upgrade``: as ``helm upgrade`` does)."""
    helm_python = _helm()
    path = chart_dir(chart)
    try:
        helm_python.validate_release_name(release)
    except helm_python.HelmError as exc:
        raise ChartError(f"release name {release!r}: {_detail(exc)}") from None
    try:
        with helm_python.Chart.load(path) as loaded:
            out = loaded.render(
                values or {}, name=release, namespace=namespace, is_install=not upgrade, is_upgrade=upgrade
            )
    except helm_python.HelmValuesError as exc:
        raise ChartError(explain_schema_error(_detail(exc), values, values_schema(path))) from None
    except helm_python.HelmRenderError as exc:
        raise ChartError(explain_render_error(_detail(exc))) from None
    except helm_python.HelmError as exc:
        raise ChartError(f"chart {path}: {_detail(exc)}") from None
    notes = next((text for name, text in out.items() if name.endswith("NOTES.txt")), "")
    manifests = {
        name: text
        for name, text in out.items()
        if not name.endswith("NOTES.txt") and not name.rsplit("/", 1)[-1].startswith("_")
    }
    return Rendered(manifests, notes)


def lint(values: Optional[dict] = None, chart: Optional[str | Path] = None) -> list[str]:
    """``helm lint --strict`` findings (warnings and errors) for ``values``; empty when clean."""
    helm_python = _helm()
    report = helm_python.lint(
        str(chart_dir(chart)),
        values or {},
        strict=True,
        namespace=DEFAULT_NAMESPACE,
        kube_version=f"v{KUBERNETES_VERSION}",
    )
    found = [f"{m['path']}: {m['error']}" for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    return found + list(report.get("errors") or [])


def _detail(exc: Exception) -> str:
    return str(getattr(exc, "detail", None) or exc).strip()


# ---- resilient-fsdp render ---------------------------------------------------------------------


def add_values_args(p: argparse.ArgumentParser) -> None:
    """The flags ``render`` and ``validate`` share: values as Helm takes them, and where to render."""
    p.add_argument(
        "-f",
        "--values",
        dest="values_files",
        action="append",
        default=[],
        metavar="FILE",
        help="values file, e.g. values/p5-4node.yaml (repeatable; later files win)",
    )
    p.add_argument(
        "--set",
        dest="set_values",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set one value as helm --set does, e.g. --set nodes=4 (repeatable; applied last)",
    )
    p.add_argument(
        "--set-json",
        dest="set_json",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="set one value as helm --set-json does, e.g. --set-json trainer.optim.lr=3e-4 (repeatable; before --set)",
    )
    p.add_argument("--release", default=DEFAULT_RELEASE, help=f"release name; default {DEFAULT_RELEASE}")
    p.add_argument(
        "--namespace", "-n", default=DEFAULT_NAMESPACE, help=f"namespace of the release; default {DEFAULT_NAMESPACE}"
    )
    p.add_argument("--chart", help=f"chart directory; default charts/resilient-fsdp of this checkout (or ${CHART_ENV})")


def render_from_args(args: argparse.Namespace) -> Rendered:
    return render(
        load_values(args.values_files, args.set_values, args.set_json),
        release=args.release,
        namespace=args.namespace,
        chart=args.chart,
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``resilient-fsdp render``."""
    p = sub.add_parser(
        "render",
        help="print the chart's manifests for some values (helm template, no helm binary)",
        description="Render charts/resilient-fsdp with Helm's engine: values files in order, then "
        "--set; the values schema and the chart's cross-key rules are enforced.",
    )
    add_values_args(p)
    p.add_argument("--notes", action="store_true", help="also print NOTES.txt (to stderr)")
    p.set_defaults(run=_cmd_render)


def _cmd_render(args: argparse.Namespace) -> int:
    rendered = render_from_args(args)
    sys.stdout.write(rendered.text())
    if args.notes:
        sys.stderr.write(rendered.notes)
    return 0


# ---- the trainer's part of values.schema.json ------------------------------------------------


def trainer_schema() -> dict:
    """Draft-07 schema of the ``trainer`` values, derived from the trainer's own config classes."""
    from pydantic import TypeAdapter

    from ..config import Config

    full = TypeAdapter(Config).json_schema()
    defs = full.pop("$defs", {})

    def convert(node: Any) -> Any:
        if isinstance(node, list):
            return [convert(n) for n in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            target = convert(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {**target, **{k: v for k, v in convert({k: v for k, v in node.items() if k != "$ref"}).items()}}
        out = {}
        for key, value in node.items():
            if key in ("title", "default"):
                continue  # defaults live in the trainer; titles repeat the key
            if key == "prefixItems":  # draft 2020-12 tuples are draft-07 item arrays
                out["items"] = convert(value)
                continue
            if key == "description":
                out[key] = " ".join(str(value).split())
                continue
            out[key] = convert(value)
        if out.get("type") == "object" and "properties" in out:
            out["additionalProperties"] = False
            out.pop("required", None)  # every key has a default
        return out

    schema = convert(full)
    schema["description"] = (
        "The trainer configuration (resilient-fsdp config --describe); the chart sets "
        "run_dir on the shared volume unless given."
    )
    return schema


def update_schema_file(chart: Optional[str | Path] = None) -> Path:
    """Rewrite the ``trainer`` property of the chart's ``values.schema.json`` from the config classes."""
    path = chart_dir(chart) / "values.schema.json"
    schema = json.loads(path.read_text())
    schema["properties"]["trainer"] = trainer_schema()
    schema["properties"]["chaos"]["properties"]["inject"]["items"]["pattern"] = fault_spec_pattern()
    path.write_text(json.dumps(schema, indent=2) + "\n")
    return path


def fault_spec_pattern() -> str:
    """``chaos.inject``'s schema pattern: a fault spec of one of the trainer's kinds."""
    from ..config import FAULT_KINDS

    return (
        f"^({'|'.join(FAULT_KINDS)})@[1-9][0-9]*(:(rank|node)=[0-9]+)?(:for=[0-9]+(\\.[0-9]+)?)?"
        "(:factor=[0-9]+(\\.[0-9]+)?)?$"
    )


# The chart's `trainer.resilience` defaults: the trainer's own, written between these lines of
# values.yaml (the templates read them: ft_launcher's settings, the pod's grace period).
RESILIENCE_START = "    # (generated from resilient_fsdp.config: python -m resilient_fsdp.deploy.chart --update-schema)"
RESILIENCE_END = "    # (end of generated)"


def resilience_defaults() -> list[str]:
    """``trainer.resilience``'s groups with the trainer's defaults, each key under its docstring
    as a ``# --`` comment; ``inject`` is left out (the chart's drills are ``chaos.inject``)."""
    import dataclasses
    import textwrap

    from ..config import Config, ResilienceConfig, to_dict

    defaults = to_dict(Config())["resilience"]
    lines = [RESILIENCE_START]
    for group in dataclasses.fields(ResilienceConfig):
        if group.name == "inject":
            continue
        lines.append(f"    {group.name}:")
        cls = ResilienceConfig.__pydantic_fields__[group.name].annotation
        for f in dataclasses.fields(cls):
            doc = " ".join((cls.__pydantic_fields__[f.name].description or "").split()).replace("``", "`")
            wrapped = textwrap.wrap(f"-- {doc}", width=100 - len("      # "), break_on_hyphens=False)
            lines += [f"      # {w}" for w in wrapped]
            value = yaml.safe_dump({f.name: defaults[group.name][f.name]}, default_flow_style=True).strip()[1:-1]
            lines.append(f"      {value}")
    return lines + [RESILIENCE_END]


def update_resilience_defaults(chart: Optional[str | Path] = None) -> Path:
    """Rewrite the generated ``trainer.resilience`` block of the chart's ``values.yaml``."""
    path = chart_dir(chart) / "values.yaml"
    lines = path.read_text().splitlines()
    start, end = lines.index(RESILIENCE_START), lines.index(RESILIENCE_END)
    path.write_text("\n".join(lines[:start] + resilience_defaults() + lines[end + 1 :]) + "\n")
    return path


# ---- what the chart's rules know of the trainer --------------------------------------------------

FACTS_TEMPLATE = "_trainer_facts.tpl"
# The trainer keys the chart's rules read (templates/validations.yaml), with the trainer's defaults
# for a user who leaves them out.
FACT_KEYS = (
    "model.preset",
    "model.factory",
    "model.vocab_size",
    "model.max_seq_len",
    "data.source",
    "data.path",
    "data.factory",
    "data.seq_len",
    "dist.device",
    "dist.timeout_s",
    "dist.init_timeout_s",
    "dist.shard_group_size",
)


def trainer_facts() -> dict:
    """What the chart's cross-key rules need of the trainer, from the trainer itself: the defaults
    of :data:`FACT_KEYS`, each built-in preset's size (parameters besides the embeddings, width,
    vocabulary: the embedding and the output projection are ``vocab x width`` each), and the limits
    the chart and the trainer both apply (:mod:`resilient_fsdp.train.state_fit`,
    :data:`resilient_fsdp.config.DUMP_MARGIN_S`)."""
    from ..config import DUMP_MARGIN_S, Config, to_dict
    from ..train import state_fit
    from ..train.presets import PRESETS, parameter_count

    config = to_dict(Config())
    defaults = {}
    for key in FACT_KEYS:
        section, name = key.split(".")
        defaults[key] = config[section][name]
    presets = {
        name: {
            "params_besides_embeddings": parameter_count(args) - 2 * args.vocab_size * args.dim,
            "dim": args.dim,
            "vocab_size": args.vocab_size,
        }
        for name, args in PRESETS.items()
    }
    return {
        "defaults": defaults,
        "presets": presets,
        "dump_margin_s": DUMP_MARGIN_S,
        "training_bytes_per_param": state_fit.TRAINING_BYTES_PER_PARAM,
        "max_state_percent": state_fit.MAX_STATE_PERCENT,
    }


def trainer_facts_template() -> str:
    """``templates/_trainer_facts.tpl``: :func:`trainer_facts` as a named template of JSON."""
    return (
        "{{/*\nWhat the chart's rules (validations.yaml) know of the trainer: its defaults for the keys they\n"
        "read, the built-in presets' sizes, and the limits both apply. Generated from resilient_fsdp\n"
        "(python -m resilient_fsdp.deploy.chart --update-schema); a test keeps it current.\n*/}}\n"
        '{{- define "resilient-fsdp.trainerFacts" -}}\n'
        f"{json.dumps(trainer_facts(), sort_keys=True)}\n"
        "{{- end }}\n"
    )


def update_trainer_facts(chart: Optional[str | Path] = None) -> Path:
    path = chart_dir(chart) / "templates" / FACTS_TEMPLATE
    path.write_text(trainer_facts_template())
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resilient_fsdp.deploy.chart")
    parser.add_argument(
        "--update-schema",
        action="store_true",
        help="rewrite the trainer part of values.schema.json, the trainer.resilience defaults "
        "of values.yaml and templates/_trainer_facts.tpl, from resilient_fsdp.config",
    )
    args = parser.parse_args(argv)
    if args.update_schema:
        print(f"updated {update_schema_file()}")
        print(f"updated {update_resilience_defaults()}")
        print(f"updated {update_trainer_facts()}")
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
