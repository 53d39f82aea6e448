"""The rules the chart applies at render and the trainer applies again in the pod cannot drift:
each case goes to both, Helm's real engine rendering the chart (templates/validations.yaml) and the
trainer's own code judging the trainer configuration those values give its pods. Both must refuse
or both accept, in the same words (the chart names the keys under ``trainer.``), or, for whether
a training state fits, with the same arithmetic.
"""

from __future__ import annotations

import re

import pytest
import yaml

from resilient_fsdp.config import ConfigError, check_collective_timeouts, load_config
from resilient_fsdp.deploy import chart
from resilient_fsdp.goodput.costs import GPU_MEMORY_GB
from resilient_fsdp.train import state_fit
from resilient_fsdp.train.presets import PRESETS, parameter_count, preset_args
from tests.deploy.chart_support import BASE, REPO

CHART_VALUES = yaml.safe_load((REPO / "charts" / "resilient-fsdp" / "values.yaml").read_text())
INSTANCE_TYPES = CHART_VALUES["instanceTypes"]
_TRAINER_KEY = re.compile(r"(?<![\w.])((?:data|model|dist|resilience|checkpoint|train|optim)\.[a-z_.]*[a-z_])")


def chart_outcome(sets: list[str]) -> str | None:
    """The chart's refusal of ``sets`` (over :data:`BASE`), or None when it renders."""
    try:
        chart.render(chart.load_values([], BASE + sets))
    except chart.ChartError as exc:
        return str(exc)
    return None


def trainer_config_of(sets: list[str], tmp_path) -> dict:
    """The trainer configuration the pods of ``sets`` load: the chart's ``trainer`` defaults with
    the case's ``trainer.*`` values over them, as a file for the trainer's loader."""
    values = chart.deep_merge(CHART_VALUES, chart.load_values([], BASE + sets))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(values["trainer"]))
    return path


def trainer_outcome(sets: list[str], tmp_path, on_gpu: bool) -> str | None:
    """The trainer's refusal of the same case: its loader, then (on a GPU node, where it uses NCCL)
    its collective-timeout rule; None when it accepts."""
    try:
        cfg = load_config(trainer_config_of(sets, tmp_path))
        if on_gpu:
            check_collective_timeouts(cfg)
    except ConfigError as exc:
        return str(exc)
    return None


def in_chart_words(message: str) -> str:
    """The trainer's message as the chart says it: its keys under ``trainer.``."""
    return _TRAINER_KEY.sub(r"trainer.\1", message)


CASES = {
    "token file without a path": (["trainer.data.source=tokens"], True),
    "token file with a path": (["trainer.data.source=tokens", "trainer.data.path=/fsx/data/tokens.bin"], True),
    "sequences longer than the model takes": (["trainer.model.max_seq_len=2048", "trainer.data.seq_len=4096"], True),
    "sequences as long as the model takes": (["trainer.model.max_seq_len=2048", "trainer.data.seq_len=2048"], True),
    "collective timeout at the step timeout": (["trainer.dist.timeout_s=600"], True),
    "collective timeout a minute below it": (["trainer.dist.timeout_s=540"], True),
    "collective timeout against a lowered checkpoint timeout": (
        ["trainer.dist.timeout_s=240", "trainer.resilience.hang_detection.checkpoint_timeout_s=290"],
        True,
    ),
    "collective timeout against no step timeout": (
        [
            "trainer.dist.timeout_s=900",
            "trainer.resilience.hang_detection.step_timeout_s=null",
            "trainer.resilience.hang_detection.checkpoint_timeout_s=null",
            "trainer.resilience.hang_detection.out_of_section_timeout_s=null",
        ],
        True,
    ),
    "start-up timeout at the init timeout": (["trainer.dist.init_timeout_s=900"], True),
    "collective timeout at in-process restart's hard timeout": (
        ["trainer.resilience.in_process.enabled=true", "trainer.dist.timeout_s=90"],
        True,
    ),
    "collective timeouts on CPU nodes": (["instanceType=cpu", "trainer.dist.timeout_s=600"], False),
    "collective timeouts with the device forced to CPU": (
        ["trainer.dist.device=cpu", "trainer.dist.timeout_s=600"],
        False,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_should_decide_alike_in_the_same_words_when_chart_and_trainer_get_the_same_values(case, tmp_path):
    sets, on_gpu = CASES[case]
    by_chart, by_trainer = chart_outcome(sets), trainer_outcome(sets, tmp_path, on_gpu)
    assert (by_chart is None) == (by_trainer is None), (by_chart, by_trainer)
    if by_trainer is not None:
        assert by_chart == in_chart_words(by_trainer)


def test_should_refuse_every_rule_of_the_cases_at_least_once():
    """The cases cover each shared rule both ways: a refusal and an acceptance for each."""
    refused = {case for case in CASES if chart_outcome(CASES[case][0]) is not None}
    assert {
        "token file without a path",
        "sequences longer than the model takes",
        "collective timeout at the step timeout",
        "start-up timeout at the init timeout",
        "collective timeout at in-process restart's hard timeout",
    } <= refused
    assert {
        "token file with a path",
        "sequences as long as the model takes",
        "collective timeout a minute below it",
        "collective timeouts on CPU nodes",
    }.isdisjoint(refused)


# ---- whether the training state fits: the same arithmetic, the chart from the instance type's
# table, the trainer (on a GPU node) from the device's memory ----------------------------------

FITS = [
    ("70b", "p5.48xlarge", 1, 0),
    ("70b", "p5.48xlarge", 2, 0),
    ("70b", "p5.48xlarge", 3, 0),
    ("70b", "p5.48xlarge", 4, 8),
    ("70b", "p5en.48xlarge", 2, 0),
    ("70b", "p4d.24xlarge", 4, 0),
    ("8b", "g5.xlarge", 2, 0),
    ("8b", "g5.48xlarge", 1, 0),
    ("8b", "g6.12xlarge", 2, 0),
    ("1b", "g6.xlarge", 1, 0),
    ("8b", "p5.48xlarge", 4, 8),
    ("70b", "p6-b200.48xlarge", 2, 0),
]


@pytest.mark.parametrize("preset,instance,nodes,group", FITS)
def test_should_fit_a_state_alike_when_chart_and_trainer_size_the_same_job(preset, instance, nodes, group):
    sets = [
        f"instanceType={instance}",
        f"nodes={nodes}",
        f"trainer.model.preset={preset}",
        f"trainer.dist.shard_group_size={group}",
    ]
    gpus = INSTANCE_TYPES[instance]["gpus"]
    memory = INSTANCE_TYPES[instance]["gpuMemoryGB"] * 10**9
    params = parameter_count(PRESETS[preset])
    shard = group or nodes * gpus
    expected = state_fit.refusal(params, shard, memory, f"model.preset={preset}", gpus, f"instanceType={instance}")
    by_chart = chart_outcome(sets)
    assert (by_chart is None) == (expected is None), (by_chart, expected)
    if expected is not None:
        needed = state_fit.gpus_needed(params, memory)
        assert f"Shard it over {needed} GPUs or more: nodes={-(-needed // gpus)} or more" in by_chart
        assert f"trainer.model.preset={preset} does not fit" in by_chart


def test_should_size_a_preset_with_another_vocabulary_as_the_trainer_builds_it():
    # 8b with a 256k vocabulary: 1.05e9 parameters more than the preset's own, past two g6.12xlarge (8 x 24 GB).
    params = parameter_count(preset_args("8b", 256_000))
    memory = INSTANCE_TYPES["g6.12xlarge"]["gpuMemoryGB"] * 10**9
    assert state_fit.fits(parameter_count(PRESETS["8b"]), 8, memory)
    assert not state_fit.fits(params, 8, memory)
    sets = ["instanceType=g6.12xlarge", "nodes=2", "trainer.model.preset=8b"]
    assert chart_outcome(sets) is None
    assert "does not fit" in chart_outcome(sets + ["trainer.model.vocab_size=256000"])


def test_should_leave_a_factory_models_size_to_the_trainer():
    """The chart cannot import a factory: the trainer checks its size on the GPU before allocating."""
    assert (
        chart_outcome(["nodes=1", "trainer.model.preset=70b", "trainer.model.factory=my_models.gpt:build_model"])
        is None
    )


def test_should_know_each_gpu_instance_types_memory_as_the_advisor_does():
    for name, spec in INSTANCE_TYPES.items():
        if spec["gpus"]:
            assert spec["gpuMemoryGB"] == GPU_MEMORY_GB[name.split(".")[0]], name
        else:
            assert "gpuMemoryGB" not in spec, name


def test_should_refuse_a_gpu_instance_type_without_its_gpu_memory():
    message = chart_outcome(
        [
            "instanceTypes.p9\\.48xlarge.gpus=8",
            "instanceTypes.p9\\.48xlarge.efa=0",
            "instanceTypes.p9\\.48xlarge.gpuDirectRdma=false",
            "instanceTypes.p9\\.48xlarge.cpu=100",
            "instanceTypes.p9\\.48xlarge.memory=1000Gi",
            "instanceType=p9.48xlarge",
        ]
    )
    assert message is not None and "gpuMemoryGB" in message, message


def test_should_carry_the_trainers_facts_as_generated():
    text = (REPO / "charts" / "resilient-fsdp" / "templates" / chart.FACTS_TEMPLATE).read_text()
    assert text == chart.trainer_facts_template(), "stale: python -m resilient_fsdp.deploy.chart --update-schema"


def test_should_render_the_documented_custom_model_install_with_what_its_model_declares(monkeypatch):
    """images/custom-model/README.md's install, over the 4,096-token p5-4node profile: its values
    file takes the sequence length down to what the example model declares, and says so in
    model.max_seq_len, so a longer one is refused here rather than in forward on the GPU nodes."""
    from tests.deploy.chart_support import MY_CLUSTER, VALUES_DIR

    example = REPO / "images" / "custom-model"
    monkeypatch.syspath_prepend(str(example))
    from my_models import gpt

    files = [VALUES_DIR / "p5-4node.yaml", MY_CLUSTER, example / "values.yaml"]
    rendered = chart.render(chart.load_values(files))
    config = yaml.safe_load(rendered.find("ConfigMap")["data"]["config.yaml"])
    assert config["model"]["max_seq_len"] == gpt.SmallGPT.max_seq_len == gpt.MAX_SEQ_LEN
    assert config["data"]["seq_len"] <= gpt.MAX_SEQ_LEN
    with pytest.raises(chart.ChartError, match="trainer.data.seq_len=4096 is above trainer.model.max_seq_len=2048"):
        chart.render(chart.load_values(files, ["trainer.data.seq_len=4096"]))
