"""The wheels the GPU check carries to a machine without network, and their installation there.

``constraints-gpu-check.txt`` names them (exact versions, with the reason each travels). Two steps:

- ``python -m resilient_fsdp.bench.gpu.wheels download --dest .whl``, where a package index is reachable:
  fetches exactly those wheels for CPython 3.12 on x86-64 Linux (the GPU machine's Python);
- ``python -m resilient_fsdp.bench.gpu.wheels install --wheels .whl --target DIR``, on the GPU machine:
  installs each carried wheel that the machine lacks, or has in an older version, into ``DIR``
  with ``pip --no-index --no-deps``; the caller puts ``DIR`` first on ``PYTHONPATH``.

Standard library only (``packaging`` when present): it runs before anything it installs exists.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[4]
PINS = REPO / "constraints-gpu-check.txt"
# The GPU machine runs CPython 3.12 on x86-64. pip matches manylinux tags exactly, so every glibc
# level a pinned wheel may be tagged with is listed; NVRx 0.7 is published for glibc 2.39 only.
PLATFORMS = [
    "manylinux_2_39_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
]
# Marks a target directory this module created, so a re-run may empty it and nothing else.
TARGET_MARKER = ".resilient-fsdp-gpu-wheels"
_WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)-")


@dataclass
class Decision:
    wheel: str
    name: str
    carried: str
    present: Optional[str]
    action: str  # "install" | "keep-present"
    result: str = ""  # "pip" | "unpacked" | "failed: ..." | ""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path = PINS) -> list[tuple[str, str]]:
    pins = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if "==" not in line:
            raise ValueError(f"{path}: {line!r} is not pinned; write NAME==VERSION")
        name, version = line.split("==", 1)
        pins.append((name.strip(), version.strip()))
    return pins


def download(dest: Path, pins: list[tuple[str, str]], python: str = sys.executable) -> list[Path]:
    """Fetch every pinned wheel for CPython 3.12 / x86-64 Linux into ``dest`` (nothing else)."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {normalize(n): v for n, v in pins}
    for old in dest.glob("*.whl"):
        m = _WHEEL_NAME.match(old.name)
        # One version of each package: two would stop the whole install there.
        if m is None or wanted.get(normalize(m["name"])) != m["version"]:
            old.unlink()
    cmd = [
        python,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "-d",
        str(dest),
    ]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + [f"{n}=={v}" for n, v in pins], check=True)
    wheels = sorted(dest.glob("*.whl"))
    got = {normalize(_WHEEL_NAME.match(w.name)["name"]) for w in wheels}
    missing = sorted(set(wanted) - got)
    if missing:
        raise RuntimeError(f"no wheel was downloaded for {', '.join(missing)}; check {PINS.name}")
    return wheels


def _older(present: str, carried: str) -> bool:
    try:
        from packaging.version import Version

        return Version(present) < Version(carried)
    except Exception:  # noqa: BLE001 - no packaging, or a version it cannot parse

        def key(v: str) -> tuple:
            return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+-]", v))

        return key(present) < key(carried)


def decide(wheels: list[Path]) -> list[Decision]:
    """Which carried wheels this interpreter needs: those it lacks or has in an older version."""
    decisions = []
    for wheel in wheels:
        m = _WHEEL_NAME.match(wheel.name)
        if m is None:
            continue
        name, carried = m["name"], m["version"]
        try:
            present: Optional[str] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            present = None
        action = "install" if present is None or _older(present, carried) else "keep-present"
        decisions.append(Decision(wheel.name, normalize(name), carried, present, action))
    return decisions


def _pip_install(wheels: list[Path], target: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(target),
            *map(str, wheels),
        ],
        capture_output=True,
        text=True,
    )


def _unpack(wheel: Path, target: Path) -> None:
    # A wheel is a zip of what goes into site-packages. pip refuses a wheel whose platform tag
    # this machine does not match (NVRx 0.7 is tagged glibc 2.39); its pure-Python modules,
    # which are all the check uses, still work when unpacked.
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target, [n for n in z.namelist() if not n.split("/", 1)[0].endswith(".data")])


def ensure_ft_launcher(target: Path) -> Path:
    """``target/bin/ft_launcher``: pip writes it from NVRx's entry point; an unpacked wheel has none."""
    script = target / "bin" / "ft_launcher"
    if not script.exists() and (target / "nvidia_resiliency_ext").is_dir():
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(
            f"#!{sys.executable}\nimport sys\n"
            "from nvidia_resiliency_ext.fault_tolerance.launcher import main\n"
            "sys.exit(main())\n"
        )
        script.chmod(0o755)
    return script


def install(wheels_dir: Path, target: Path) -> list[Decision]:
    wheels = sorted(wheels_dir.glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"--wheels {wheels_dir}: no .whl files there; run scripts/gpu-wheels first")
    if target.exists():
        if not (target / TARGET_MARKER).exists() and any(target.iterdir()):
            raise RuntimeError(f"--target {target} exists and was not made by this installer; pick an empty directory")
        shutil.rmtree(target)
    target.mkdir(parents=True)
    (target / TARGET_MARKER).touch()
    decisions = decide(wheels)
    chosen = [d for d in decisions if d.action == "install"]
    if chosen and _pip_install([wheels_dir / d.wheel for d in chosen], target).returncode == 0:
        for d in chosen:
            d.result = "pip"
    else:
        # One bad wheel must not keep the others out: install them one by one.
        for d in chosen:
            proc = _pip_install([wheels_dir / d.wheel], target)
            if proc.returncode == 0:
                d.result = "pip"
                continue
            try:
                _unpack(wheels_dir / d.wheel, target)
                d.result = "unpacked (pip refused it: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:200] + ")"
            except (OSError, zipfile.BadZipFile) as exc:
                d.result = f"failed: {exc}"
    ensure_ft_launcher(target)
    return decisions


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m resilient_fsdp.bench.gpu.wheels", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help=f"fetch the wheels {PINS.name} names (needs a package index)")
    d.add_argument("--dest", default=str(REPO / ".whl"), help="folder for the wheels (default .whl)")
    i = sub.add_parser("install", help="install the carried wheels this machine lacks into --target")
    i.add_argument("--wheels", required=True, help="folder of carried wheels")
    i.add_argument("--target", required=True, help="install here; put it first on PYTHONPATH afterwards")
    i.add_argument("--record", help="write the per-wheel decisions as JSON to this file")
    args = p.parse_args(argv)
    if args.command == "download":
        wheels = download(Path(args.dest), read_pins())
        total = sum(w.stat().st_size for w in wheels)
        for w in wheels:
            print(f"  {w.name}")
        print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB, in {args.dest}")
        return 0
    decisions = install(Path(args.wheels), Path(args.target))
    for dec in decisions:
        status = dec.result if dec.action == "install" else f"kept the machine's {dec.present}"
        print(f"[gpu-wheels] {dec.name} {dec.carried}: {status}", file=sys.stderr)
    if args.record:
        Path(args.record).write_text(json.dumps([asdict(x) for x in decisions], indent=2) + "\n")
    return 1 if any(x.result.startswith("failed") for x in decisions) else 0


if __name__ == "__main__":
    sys.exit(main())
