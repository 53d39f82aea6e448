"""The image's Python dependencies (resilient_fsdp.deploy.image_deps): this project's pins on the base's.

The rules are tested on made-up base images; the lock's completeness with pip's own resolver for
the image's platform (Python 3.12, glibc 2.39), against the package index.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.deploy.image_support import REPO
from resilient_fsdp.deploy import image_deps
from resilient_fsdp.deploy.image_deps import DepsError, canonical, merged_pins, plan, project_requirements, verify

SCRIPT = REPO / "train/resilient_fsdp/deploy/image_deps.py"


def base(**versions: str) -> dict[str, tuple[str, str]]:
    return {canonical(k): (k, v) for k, v in versions.items()}


PINS = base(numpy="2.4.6", pydantic="2.14.4", fastapi="0.165.0", **{"nvidia-resiliency-ext": "0.7.0"})


def test_base_versions_win_project_pins_fill_in_nvrx_is_replaced():
    lines, notes = plan(
        base(torch="2.13.0a0+9186a08b2c.nv26.07", numpy="1.26.4", **{"nvidia-resiliency-ext": "0.5.0"}), PINS
    )
    assert "torch==2.13.0a0+9186a08b2c.nv26.07" in lines  # the base's CUDA build, exactly
    assert "numpy==1.26.4" in lines and "numpy==2.4.6" not in lines
    assert "nvidia-resiliency-ext==0.7.0" in lines and "nvidia-resiliency-ext==0.5.0" not in lines
    assert {"pydantic==2.14.4", "fastapi==0.165.0"} <= set(lines)  # not in the base: the project's pins
    assert "numpy: the base's 1.26.4 kept (the project pins 2.4.6)" in notes
    assert "nvidia-resiliency-ext: the base's 0.5.0 is replaced by 0.7.0 (constraints-image.txt)" in notes


def test_free_form_base_versions_are_left_to_verify():
    lines, notes = plan(base(torch="2.13.0", weird="2024-custom build"), PINS)
    assert not any(line.startswith("weird") for line in lines)
    assert any("weird" in n and "not PEP 440" in n for n in notes)


def test_a_base_without_torch_is_refused():
    with pytest.raises(DepsError, match="the base image has no torch: the trainer image expects NVIDIA's PyTorch"):
        plan(base(numpy="1.26.4"), PINS)


def test_verify_accepts_additions_at_their_pins_only():
    before = base(torch="2.13.0a0", numpy="1.26.4", **{"nvidia-resiliency-ext": "0.5.0"})
    after = {**before, **base(fastapi="0.165.0", **{"nvidia-resiliency-ext": "0.7.0", "resilient-fsdp": "0.1.0"})}
    assert verify(before, after, PINS, extra={"resilient-fsdp": "0.1.0"}) == []
    problems = verify(
        before,
        {**after, **base(numpy="2.4.6", torch="2.13.0", uvloop="0.23.0", fastapi="0.1")},
        PINS,
        extra={"resilient-fsdp": "0.1.0"},
    )
    assert problems == [
        "numpy (from the base image) was replaced: 1.26.4 -> 2.4.6; the base's versions must stay "
        "(see images/trainer/Dockerfile)",
        "torch (from the base image) was replaced: 2.13.0a0 -> 2.13.0; the base's versions must stay "
        "(see images/trainer/Dockerfile)",
        "fastapi==0.1 was installed but the pin is 0.165.0",
        "uvloop==0.23.0 was installed but is not pinned: add it to constraints.txt "
        "(or constraints-image.txt if only the image needs it)",
    ]
    gone = {k: v for k, v in after.items() if k != "numpy"}
    assert verify(before, gone, PINS, extra={"resilient-fsdp": "0.1.0"}) == [
        "numpy 1.26.4 (from the base image) was uninstalled"
    ]
    missing = {k: v for k, v in after.items() if k != "nvidia-resiliency-ext"}
    assert "nvidia-resiliency-ext==0.7.0 is not installed" in verify(
        before, missing, PINS, extra={"resilient-fsdp": "0.1.0"}
    )


def test_constraints_files_hold_exact_pins_only(tmp_path):
    (tmp_path / "constraints.txt").write_text("# comment\nfoo==1.0\nbar>=2\n")
    with pytest.raises(DepsError, match=r"constraints.txt:3: expected an exact pin 'name==version', got 'bar>=2'"):
        image_deps.read_pins(tmp_path / "constraints.txt")


def test_image_pins_override_project_pins():
    pins = merged_pins(REPO)
    assert pins["nvidia-resiliency-ext"][1] == "0.7.0"  # constraints-image.txt, not constraints.txt's 0.4.1
    assert pins["torch"][1] == "2.13.0"


def run_script(*args: str, isolated: bool = False) -> subprocess.CompletedProcess:
    # As the Dockerfile runs it: a lone copy of the file, outside the package.
    python = [sys.executable, "-S"] if isolated else [sys.executable]
    return subprocess.run([*python, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_script_runs_from_a_lone_copy_with_the_standard_library(tmp_path):
    out = run_script("plan", "--project", str(REPO), "--out", str(tmp_path), "--nvrx", "0.7.0")
    assert out.returncode == 0, out.stderr
    constraints = (tmp_path / "constraints.txt").read_text().splitlines()
    assert "nvidia-resiliency-ext==0.7.0" in constraints  # this venv has 0.4.1: replaced, as in the image
    assert any(line.startswith("torch==2.13.0") for line in constraints)
    assert (tmp_path / "requirements.txt").read_text().splitlines() == project_requirements(REPO / "pyproject.toml")
    recorded = json.loads((tmp_path / "base-packages.json").read_text())
    assert recorded["torch"][1].startswith("2.13.0")
    out = run_script("verify", "--project", str(REPO), "--base", str(tmp_path / "base-packages.json"))
    assert out.returncode == 1  # this venv runs NVRx 0.4.1, not the image's pin
    assert "nvidia-resiliency-ext" in out.stderr
    # Without site-packages (the standard library only) the script still runs and says what is wrong.
    out = run_script("plan", "--project", str(REPO), "--out", str(tmp_path / "bare"), isolated=True)
    assert out.returncode == 2 and "the base image has no torch" in out.stderr


def test_nvrx_disagreement_fails_the_build(tmp_path):
    out = run_script("plan", "--project", str(REPO), "--out", str(tmp_path), "--nvrx", "0.6.0")
    assert out.returncode == 2
    assert "NVRX_VERSION=0.6.0 but constraints-image.txt pins nvidia-resiliency-ext==0.7.0" in out.stderr


def _stand_in_torch(directory: Path) -> Path:
    """A torch wheel with no dependencies, standing in for the base image's CUDA build of torch.

    The image never installs torch (the base has it), so its CUDA wheels' dependencies are no
    part of this project's lock; the stand-in keeps them out of the resolution.
    """
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "torch-2.13.0+base-py3-none-any.whl"
    info = "torch-2.13.0+base.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("torch/__init__.py", "")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+base\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return directory


def test_lock_covers_everything_pip_installs_in_the_image(tmp_path):
    """pip's resolver, for the image's Python and platform, installs nothing the lock does not pin."""
    lines, _ = plan(base(torch="2.13.0+base"), merged_pins(REPO))
    (tmp_path / "constraints.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "requirements.txt").write_text("\n".join(project_requirements(REPO / "pyproject.toml")) + "\n")
    report = tmp_path / "report.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            "--target",
            str(tmp_path / "target"),
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            "--abi",
            "cp312",
            *[
                a
                for p in (
                    "manylinux_2_39_x86_64",
                    "manylinux_2_28_x86_64",
                    "manylinux_2_17_x86_64",
                    "manylinux2014_x86_64",
                )
                for a in ("--platform", p)
            ],
            "--find-links",
            str(_stand_in_torch(tmp_path / "wheels")),
            "--constraint",
            str(tmp_path / "constraints.txt"),
            "--requirement",
            str(tmp_path / "requirements.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    resolved = {
        canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
    }
    assert resolved["nvidia-resiliency-ext"] == "0.7.0"
    assert resolved["torch"] == "2.13.0+base"
    pins = merged_pins(REPO)
    unpinned = {k: v for k, v in resolved.items() if k != "torch" and pins.get(k, (None, None))[1] != v}
    assert unpinned == {}, f"pin these in constraints-image.txt (image only) or constraints.txt: {unpinned}"
