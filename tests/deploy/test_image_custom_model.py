"""images/custom-model: its package trains through model.factory, selected by its values file.

The chart renders the values file into the trainer's configuration; that configuration then runs
a real local job (ft_launcher, two ranks on CPU) with the example package on PYTHONPATH, as the
image puts it on sys.path.
"""

from __future__ import annotations

import importlib
import math
import re
import sys

import pytest
import yaml

from tests.deploy.chart_support import IMAGE, PROFILES, config_map, profile_files, render, render_error
from tests.support import assert_no_leftovers, read_summary, run_local, run_trainer
from tests.deploy.image_support import REPO
from resilient_fsdp.deploy import chart
from resilient_fsdp.config import ModelConfig
from resilient_fsdp.deploy.image import dockerfile_args, project_version

EXAMPLE = REPO / "images/custom-model"
VALUES = EXAMPLE / "values.yaml"
FACTORY = "my_models.gpt:build_model"


def rendered_config(tmp_path):
    """The trainer configuration the chart mounts, for the dev-cpu profile plus the example's values."""
    values = chart.load_values([REPO / "values/dev-cpu.yaml", VALUES])
    assert chart.lint(values) == []
    rendered = chart.render(values)
    path = tmp_path / "config.yaml"
    path.write_text(rendered.find("ConfigMap")["data"]["config.yaml"])
    return rendered, path


def test_values_select_the_factory_and_the_custom_image(tmp_path):
    rendered, path = rendered_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    assert config["model"]["factory"] == FACTORY
    pod = rendered.find("PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["containers"][0]["image"] == f"resilient-fsdp:{project_version()}-custom-model"


def test_the_package_trains_through_model_factory_in_a_local_run(tmp_path):
    _, config = rendered_config(tmp_path)
    run_dir = tmp_path / "run"
    out = run_local(
        run_dir,
        nodes=1,
        nproc=2,
        pythonpath=[EXAMPLE],
        extra=["--config", str(config)],
        overrides=["train.steps=4", "train.log_every=1", "checkpoint.interval_steps=2", "data.seq_len=32"],
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    sys.path.insert(0, str(EXAMPLE))
    try:
        gpt = importlib.import_module("my_models.gpt")
        expected = sum(p.numel() for p in gpt.build_model(ModelConfig(factory=FACTORY, vocab_size=4096)).parameters())
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("my_models.gpt", None)
        sys.modules.pop("my_models", None)
    assert f"model {FACTORY}: {expected:,} parameters" in out.stdout
    summary = read_summary(run_dir)
    assert summary["final_step"] == 4 and summary["world_size"] == 2 and math.isfinite(summary["final_loss"])
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    assert_no_leftovers(run_dir)


@pytest.mark.parametrize("profile", [p for p in PROFILES if p != "dev-cpu"])
def test_the_example_renders_on_every_gpu_profile_within_its_sequence_limit(profile):
    """Every GPU profile, then the cluster's file, then the example's values: the chart renders it,
    and the sequences the pods train are within what the model declares."""
    rendered = render(files=profile_files(profile) + [VALUES], base=IMAGE)
    config = config_map(rendered, "config.yaml")
    assert config["model"]["factory"] == FACTORY
    assert config["data"]["seq_len"] <= config["model"]["max_seq_len"] == _declared_max_seq_len()
    longer = render_error(
        f"trainer.data.seq_len={config['model']['max_seq_len'] + 1}",
        files=profile_files(profile) + [VALUES],
        base=IMAGE,
    )
    assert "is above trainer.model.max_seq_len" in longer


def _declared_max_seq_len() -> int:
    sys.path.insert(0, str(EXAMPLE))
    try:
        gpt = importlib.import_module("my_models.gpt")
        return gpt.build_model(ModelConfig(factory=FACTORY, vocab_size=4096)).max_seq_len
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("my_models.gpt", None)
        sys.modules.pop("my_models", None)


def test_a_missing_vocabulary_size_is_a_configuration_error(tmp_path):
    out = run_trainer(tmp_path / "run", overrides=[f"model.factory={FACTORY}", "train.steps=2"], pythonpath=[EXAMPLE])
    assert out.returncode == 2
    assert "my_models.gpt needs model.vocab_size" in out.stderr


def test_dockerfile_starts_from_the_trainer_image_and_adds_only_the_package():
    text = (EXAMPLE / "Dockerfile").read_text()
    assert dockerfile_args(EXAMPLE / "Dockerfile") == {
        "TRAINER_IMAGE": f"resilient-fsdp:{project_version()}",
        "EXTRA_PIP_PACKAGES": "",
        "TRAINER_UID": "10001",
    }
    # Extra packages install as root, under the trainer image's constraints, and the user is restored.
    trainer_uid = dockerfile_args(REPO / "images/trainer/Dockerfile")["TRAINER_UID"]
    assert trainer_uid == "10001"
    steps = re.findall(r"^(USER .*|RUN .*|COPY .*)$", text, re.M)
    assert steps[:3] == [
        "USER 0:0",
        'RUN if [ -n "${EXTRA_PIP_PACKAGES}" ]; then \\',
        "USER ${TRAINER_UID}:${TRAINER_UID}",
    ]
    assert "--constraint /opt/resilient-fsdp/deps/constraints.txt" in text
    assert re.search(r"^WORKDIR /opt/resilient-fsdp$", (REPO / "images/trainer/Dockerfile").read_text(), re.M)
    assert "image_deps.py plan --project . --out deps" in (REPO / "images/trainer/Dockerfile").read_text()
    assert re.search(r"^FROM \$\{TRAINER_IMAGE\} AS custom-model$", text, re.M)
    assert "COPY my_models/ /opt/resilient-fsdp/models/my_models/" in text
    # That directory is on the trainer image's sys.path, and the build imports the same factory.
    assert (
        "resilient-fsdp-models.pth').write_text('/opt/resilient-fsdp/models"
        in (REPO / "images/trainer/Dockerfile").read_text()
    )
    assert f"load_factory('{FACTORY}', 'model.factory')" in text
    assert yaml.safe_load(VALUES.read_text())["trainer"]["model"]["factory"] == FACTORY


def test_readme_shows_build_push_and_install():
    readme = (EXAMPLE / "README.md").read_text()
    assert "scripts/build-image --image custom-model " in readme
    assert "scripts/build-image --image custom-model --push" in readme
    assert re.search(r"helm install .*\\\n.*-f images/custom-model/values.yaml", readme)
