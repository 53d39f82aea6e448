"""The container image's Python dependencies: this project's pins on top of what the base ships.

Runs inside ``docker build``, before the trainer's source is copied, so it uses the standard
library only (``python image_deps.py ...`` from a lone copy of this file): ``plan`` writes the
constraints and requirements for pip (:func:`plan`), ``verify`` checks the installed set after the
installs (:func:`verify`). The base's versions win because NVIDIA built its torch, CUDA and NCCL
against them: replacing one risks an ABI mismatch that shows only on a GPU. NVRx is the one
exception: the image runs the version the tests exercise (``constraints-image.txt``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import sys
from pathlib import Path
from typing import Iterable, Optional

# Owned by the image: installed at constraints-image.txt's pin even where the base ships another.
OWNED = ("nvidia-resiliency-ext",)
# The base must bring these; this file never installs them (a CUDA build of torch is the base's).
FROM_BASE = ("torch",)
PROJECT_PINS = "constraints.txt"
IMAGE_PINS = "constraints-image.txt"

# PEP 440's public version grammar (with local versions), for telling pip-usable versions from
# the free-form ones some source-built packages report.
_PEP440 = re.compile(
    r"^\s*v?(?:(?:[0-9]+!)?[0-9]+(?:\.[0-9]+)*"
    r"(?:[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview)[-_.]?[0-9]*)?"
    r"(?:-[0-9]+|[-_.]?(?:post|rev|r)[-_.]?[0-9]*)?"
    r"(?:[-_.]?dev[-_.]?[0-9]*)?)"
    r"(?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?\s*$",
    re.IGNORECASE,
)


class DepsError(Exception):
    """A problem with the image's dependencies; the message says what to change."""


def canonical(name: str) -> str:
    """PEP 503 normalised name: ``PyYAML`` and ``pyyaml``, ``typing_extensions`` and ``typing-extensions`` match."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_pep440(version: str) -> bool:
    return bool(_PEP440.match(version))


def read_pins(path: Path) -> dict[str, tuple[str, str]]:
    """``name==version`` lines of a constraints file, by canonical name."""
    pins: dict[str, tuple[str, str]] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip() or any(c in version for c in "<>=!~;, "):
            raise DepsError(f"{path.name}:{number}: expected an exact pin 'name==version', got {raw.strip()!r}")
        pins[canonical(name.strip())] = (name.strip(), version.strip())
    return pins


def merged_pins(project: Path) -> dict[str, tuple[str, str]]:
    """The project's pins with the image's overrides (constraints-image.txt wins)."""
    pins = read_pins(project / PROJECT_PINS)
    pins.update(read_pins(project / IMAGE_PINS))
    return pins


def installed() -> dict[str, tuple[str, str]]:
    """Every distribution this interpreter sees, by canonical name (the first on sys.path wins)."""
    found: dict[str, tuple[str, str]] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] if dist.metadata else None
        if name:
            found.setdefault(canonical(name), (name, dist.version))
    return found


# Extras the image installs besides ``[project].dependencies``: ``hf`` builds model.hf_config models.
IMAGE_EXTRAS = ("hf",)


def project_requirements(pyproject: Path) -> list[str]:
    """``[project].dependencies`` of ``pyproject.toml`` and the extras in :data:`IMAGE_EXTRAS`:
    what the trainer needs at run time."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the image has 3.12, this path is for odd hosts only
        raise DepsError("reading pyproject.toml needs Python 3.11 or newer (tomllib)") from None
    data = tomllib.loads(pyproject.read_text())
    deps = data.get("project", {}).get("dependencies")
    if not isinstance(deps, list) or not deps:
        raise DepsError(f"{pyproject}: no [project].dependencies list")
    extras = data.get("project", {}).get("optional-dependencies", {})
    for name in IMAGE_EXTRAS:
        if not isinstance(extras.get(name), list):
            raise DepsError(f"{pyproject}: no [project.optional-dependencies].{name} list (the image installs it)")
        deps = deps + [d for d in extras[name] if d not in deps]
    return [str(d) for d in deps]


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise DepsError(f"cannot read a package name from requirement {requirement!r}")
    return canonical(match.group(1))


def plan(
    base: dict[str, tuple[str, str]], pins: dict[str, tuple[str, str]], owned: Iterable[str] = OWNED
) -> tuple[list[str], list[str]]:
    """Constraint lines for pip and notes on every pin the base overrode.

    Base packages are pinned at the base's versions (free-form versions pip cannot parse are left
    out: ``verify`` still catches a change), owned packages at their pin, and everything else at
    this project's pin.
    """
    owned = {canonical(n) for n in owned}
    for name in owned:
        if name not in pins:
            raise DepsError(f"{IMAGE_PINS} must pin {name} (the image installs it at that version)")
    for name in FROM_BASE:
        if name not in base:
            raise DepsError(
                f"the base image has no {name}: the trainer image expects NVIDIA's PyTorch container "
                "as BASE_IMAGE, whose CUDA build of torch it keeps"
            )
    lines, notes = [], []
    for key, (name, version) in sorted(base.items()):
        if key in owned:
            if version != pins[key][1]:
                notes.append(f"{name}: the base's {version} is replaced by {pins[key][1]} ({IMAGE_PINS})")
            continue
        if not is_pep440(version):
            notes.append(f"{name}: the base's version {version!r} is not PEP 440; left unconstrained")
            continue
        lines.append(f"{name}=={version}")
        if key in pins and pins[key][1] != version:
            notes.append(f"{name}: the base's {version} kept (the project pins {pins[key][1]})")
    for key, (name, version) in sorted(pins.items()):
        if key in owned or key not in base:
            lines.append(f"{name}=={version}")
    return lines, notes


def verify(
    base: dict[str, tuple[str, str]],
    now: dict[str, tuple[str, str]],
    pins: dict[str, tuple[str, str]],
    extra: Optional[dict[str, str]] = None,
    owned: Iterable[str] = OWNED,
) -> list[str]:
    """Every way the installed set breaks the rules (empty: none): a base package changed version or
    disappeared (NVRx excepted), or a package arrived at a version no constraints file pins.

    ``extra`` allows packages installed from the build context itself (this project: its version).
    """
    owned = {canonical(n) for n in owned}
    allowed = {canonical(k): v for k, v in (extra or {}).items()}
    problems = []
    for key, (name, version) in sorted(base.items()):
        if key in owned:
            continue
        if key not in now:
            problems.append(f"{name} {version} (from the base image) was uninstalled")
        elif now[key][1] != version:
            problems.append(
                f"{name} (from the base image) was replaced: {version} -> {now[key][1]}; "
                "the base's versions must stay (see images/trainer/Dockerfile)"
            )
    for key, (name, version) in sorted(now.items()):
        if key in base and key not in owned:
            continue
        want = allowed.get(key) or (pins[key][1] if key in pins else None)
        if want is None:
            problems.append(
                f"{name}=={version} was installed but is not pinned: add it to {PROJECT_PINS} "
                f"(or {IMAGE_PINS} if only the image needs it)"
            )
        elif version != want:
            problems.append(f"{name}=={version} was installed but the pin is {want}")
    for key in sorted(owned):
        if key not in now:
            problems.append(f"{pins[key][0]}=={pins[key][1]} is not installed")
    return problems


def _cmd_plan(args: argparse.Namespace) -> int:
    project, out = Path(args.project), Path(args.out)
    pins = merged_pins(project)
    if args.nvrx is not None:
        pinned = pins.get("nvidia-resiliency-ext", ("", None))[1]
        if pinned != args.nvrx:
            raise DepsError(
                f"NVRX_VERSION={args.nvrx} but {IMAGE_PINS} pins nvidia-resiliency-ext=={pinned}: "
                "the two must agree (the tests exercise the constraints file's version)"
            )
    base = installed()
    lines, notes = plan(base, pins)
    requirements = project_requirements(project / "pyproject.toml")
    out.mkdir(parents=True, exist_ok=True)
    (out / "base-packages.json").write_text(json.dumps({k: list(v) for k, v in sorted(base.items())}, indent=1) + "\n")
    (out / "constraints.txt").write_text("".join(line + "\n" for line in lines))
    (out / "requirements.txt").write_text("".join(r + "\n" for r in requirements))
    for note in notes:
        print(f"[image-deps] {note}")
    print(f"[image-deps] {len(base)} base packages kept at their versions; requirements: {', '.join(requirements)}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    project = Path(args.project)
    base = {k: (v[0], v[1]) for k, v in json.loads(Path(args.base).read_text()).items()}
    extra = {}
    if args.allow_project:
        import tomllib

        meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
        extra[meta["name"]] = meta["version"]
    problems = verify(base, installed(), merged_pins(project), extra)
    for problem in problems:
        print(f"[image-deps] error: {problem}", file=sys.stderr)
    if not problems:
        added = sorted(set(installed()) - set(base))
        print(f"[image-deps] ok: base packages unchanged; {len(added)} added, each at its pin")
    return 1 if problems else 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="image_deps", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="write base-packages.json, constraints.txt and requirements.txt")
    p.add_argument("--project", default=".", help="directory with pyproject.toml and the constraints files")
    p.add_argument("--out", required=True, help="directory for the three files")
    p.add_argument("--nvrx", help="the Dockerfile's NVRX_VERSION, checked against constraints-image.txt")
    p.set_defaults(run=_cmd_plan)
    v = sub.add_parser("verify", help="check the installed packages against the base and the pins")
    v.add_argument("--project", default=".", help="directory with pyproject.toml and the constraints files")
    v.add_argument("--base", required=True, help="base-packages.json written by 'plan'")
    v.add_argument("--allow-project", action="store_true", help="accept this project's own package at its version")
    v.set_defaults(run=_cmd_verify)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except DepsError as exc:
        print(f"[image-deps] error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
