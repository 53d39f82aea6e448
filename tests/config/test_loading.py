"""Configuration: precedence, and errors that name the key and the valid choices."""

from __future__ import annotations

import re

import pytest
import yaml

from resilient_fsdp.config import Config, ConfigError, describe, dump_yaml, load_config, user_tree


def test_defaults_when_nothing_given():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.model.preset == "tiny" and cfg.checkpoint.interval_steps == 0


def test_precedence_defaults_then_file_then_set(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"seed": 7, "train": {"steps": 40, "log_every": 5}, "model": {"preset": "125m"}}))
    cfg = load_config(path, ["train.steps=12", "model.activation_checkpointing=true"])
    assert cfg.seed == 7  # file beats default
    assert cfg.train.steps == 12  # --set beats file
    assert cfg.train.log_every == 5  # file value kept where --set is silent
    assert cfg.model.preset == "125m" and cfg.model.activation_checkpointing is True
    assert cfg.optim.lr == Config().optim.lr  # default where neither speaks


def test_later_set_wins():
    assert load_config(None, ["train.steps=3", "train.steps=9"]).train.steps == 9


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(None, ["seed=3", "data.seq_len=32", "optim.betas=[0.8, 0.9]"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.presett=1b", ["unknown key 'model.presett'", "did you mean 'model.preset'", "valid keys in model"]),
        ("trian.steps=3", ["unknown key 'trian'", "did you mean 'train'"]),
        ("model.preset=huge", ["model.preset", "'huge'", "'tiny'", "'70b'"]),
        ("data.source=csv", ["data.source", "'synthetic'", "'tokens'"]),
        ("train.steps=abc", ["train.steps", "integer", "'abc'"]),
        ("train.steps=0", ["train.steps", "greater than 0"]),
        ("optim.lr=-1", ["optim.lr", "greater than 0"]),
        ("model=3", ["model", "expected a section"]),
    ],
)
def test_bad_values_name_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    for fragment in expected:
        assert fragment in str(info.value)


def test_bad_file_key_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("checkpoint:\n  interval_step: 5\n")
    with pytest.raises(
        ConfigError, match=r"unknown key 'checkpoint.interval_step' \(did you mean 'checkpoint.interval_steps'"
    ):
        load_config(path)


@pytest.mark.parametrize("text, fragment", [("[1, 2]", "must be a mapping"), ("a: [", "not valid YAML")])
def test_malformed_file(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_config(path)


def test_missing_file_and_malformed_set():
    with pytest.raises(ConfigError, match="no such file"):
        load_config("/nonexistent/run.yaml")
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["train.steps"])


def test_describe_lists_every_key_with_its_docstring():
    text = describe()
    for key in (
        "seed",
        "model.preset",
        "model.factory",
        "data.factory",
        "train.steps",
        "checkpoint.dir",
        "checkpoint.interval_steps",
    ):
        assert f"\n{key} = " in "\n" + text
    assert "Optimizer steps to train for." in text


# ---- --set values are read as a config file's: by the key's type -------------------------------


def _keys_of_kind() -> dict[str, list[str]]:
    """Every leaf key by the kind of value it takes: float, int, str (optional ones included)."""
    import dataclasses
    import typing

    kinds: dict[str, list[str]] = {"float": [], "int": [], "str": [], "float pair": []}

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            annotation = cls.__pydantic_fields__[f.name].annotation
            key = prefix + f.name
            if dataclasses.is_dataclass(annotation):
                walk(annotation, key + ".")
                continue
            args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
            if typing.get_origin(annotation) is tuple:
                kinds["float pair"].append(key)
            elif args[0] is float:
                kinds["float"].append(key)
            elif args[0] is int and key != "seed":
                kinds["int"].append(key)
            elif args[0] is str:
                kinds["str"].append(key)

    walk(Config, "")
    return kinds


def _set_value(key: str, text: str):
    """What ``--set key=text`` puts into the user tree at ``key``."""
    value = user_tree(None, [f"{key}={text}"])
    for part in key.split("."):
        value = value[part]
    return value


@pytest.mark.parametrize(
    "text, number",
    [
        ("3e-4", 3e-4),
        ("1e-5", 1e-5),
        ("2.5E+3", 2500.0),
        ("-1e-3", -1e-3),
        ("1e30", 1e30),
        ("1.0e30", 1e30),
        ("0.0003", 3e-4),
        (".5", 0.5),
    ],
)
def test_every_float_key_takes_a_number_however_it_is_written(text, number):
    """YAML 1.1 reads ``3e-4`` as a string; a number key takes it as the number."""
    keys = _keys_of_kind()["float"]
    assert (
        "optim.lr" in keys
        and "resilience.hang_detection.step_timeout_s" in keys
        and "checkpoint.s3.max_bandwidth_mb_s" in keys
    )
    for key in keys:
        value = _set_value(key, text)
        assert isinstance(value, float) and value == number, key


def test_every_int_key_takes_a_whole_number_in_exponent_notation():
    keys = _keys_of_kind()["int"]
    assert "train.steps" in keys and "train.stop_at_step" in keys and "model.vocab_size" in keys
    for key in keys:
        value = _set_value(key, "2e3")
        assert value == 2000 and type(value) is int, key
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(None, ["train.steps=2.5e0"])  # not a whole number: refused, naming the key


def test_a_float_pair_takes_numbers_in_exponent_notation():
    assert _keys_of_kind()["float pair"] == ["optim.betas"]
    assert load_config(None, ["optim.betas=[9e-1, 0.95]"]).optim.betas == (0.9, 0.95)


def test_every_string_key_keeps_the_text_as_written():
    keys = _keys_of_kind()["str"]
    assert "run_dir" in keys and "model.factory" in keys and "checkpoint.s3.uri" in keys
    for key in keys:
        assert _set_value(key, "1e3") == "1e3", key


def test_a_config_file_with_exponent_notation_gives_numbers(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 3e-4\n  eps: 1e-8\ntrain:\n  steps: 1e2\n")
    assert user_tree(path) == {"optim": {"lr": 3e-4, "eps": 1e-8}, "train": {"steps": 100}}
    cfg = load_config(path, ["optim.weight_decay=1e-2"])
    assert (cfg.optim.lr, cfg.optim.eps, cfg.train.steps, cfg.optim.weight_decay) == (3e-4, 1e-8, 100, 0.01)
    assert "lr: 0.0003" in dump_yaml(cfg)


def test_the_fault_kinds_the_docs_list_are_the_table():
    from resilient_fsdp.config import FAULT_KINDS
    from tests.support import REPO

    text = (REPO / "docs" / "faults-and-restarts.md").read_text()
    rows = re.findall(r"^\| `([a-z-]+)` \| ", text.split("## Injecting faults", 1)[1], re.M)
    assert rows[: len(FAULT_KINDS)] == list(FAULT_KINDS)
    assert all(f"\n{kind}\n" in describe() for kind in FAULT_KINDS)


def test_an_unknown_key_is_refused_naming_the_closest_valid_key():
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'resilience.launcher.max_restart' \(did you mean "
        r"'resilience.launcher.max_restarts'\?\)",
    ):
        load_config(None, ["resilience.launcher.max_restart=2"])


def test_in_process_restart_is_switched_on_inside_its_section():
    with pytest.raises(
        ConfigError, match="resilience.in_process: a section, not a value: set resilience.in_process.enabled=true"
    ):
        load_config(None, ["resilience.in_process=true"])
    assert load_config(None, ["resilience.in_process.enabled=true"]).resilience.in_process.enabled


def test_in_process_timeouts_must_be_ordered():
    with pytest.raises(
        ConfigError,
        match="resilience.in_process.soft_timeout_s=90.0 must be less than resilience.in_process.hard_timeout_s=90.0",
    ):
        load_config(None, ["resilience.in_process.enabled=true", "resilience.in_process.soft_timeout_s=90"])
    with pytest.raises(
        ConfigError,
        match="resilience.hang_detection.step_timeout_s=30.0 must exceed resilience.in_process.hard_timeout_s=90.0",
    ):
        load_config(None, ["resilience.in_process.enabled=true", "resilience.hang_detection.step_timeout_s=30"])
    with pytest.raises(ConfigError, match="stop.exit_code"):
        load_config(None, ["resilience.stop.exit_code=1"])  # would fail the job instead of restarting it


def test_on_nccl_the_collective_timeout_must_fire_and_dump_before_hang_detection_kills():
    """dist.device=cuda: the loader holds the NCCL rules (dist.device=auto: the trainer, once it
    sees a GPU, calls the same check); gloo (cpu) is not held to them."""
    from resilient_fsdp.config import check_collective_timeouts

    with pytest.raises(
        ConfigError,
        match=r"dist.timeout_s=600 must be at least 60 s below "
        r"resilience.hang_detection.step_timeout_s=300: .*set dist.timeout_s=240 "
        r"or less, or raise resilience.hang_detection.step_timeout_s",
    ):
        load_config(None, ["dist.device=cuda", "dist.timeout_s=600", "resilience.hang_detection.step_timeout_s=300"])
    with pytest.raises(ConfigError, match="resilience.hang_detection.out_of_section_timeout_s=200"):
        load_config(
            None,
            [
                "dist.device=cuda",
                "dist.timeout_s=240",
                "resilience.hang_detection.step_timeout_s=300",
                "resilience.hang_detection.out_of_section_timeout_s=200",
            ],
        )
    with pytest.raises(
        ConfigError,
        match="dist.init_timeout_s=600 must be at least 60 s below resilience.hang_detection.init_timeout_s=620",
    ):
        load_config(None, ["dist.device=cuda", "resilience.hang_detection.init_timeout_s=620"])
    with pytest.raises(ConfigError, match="dist.timeout_s=80 must exceed resilience.in_process.hard_timeout_s=90"):
        load_config(None, ["dist.device=cuda", "dist.timeout_s=80", "resilience.in_process.enabled=true"])
    ok = load_config(None, ["dist.device=cuda", "dist.timeout_s=240", "resilience.hang_detection.step_timeout_s=300"])
    assert ok.dist.timeout_s == 240
    # A disabled section timeout is no bound; on CPU none of this applies.
    load_config(
        None,
        [
            "dist.device=cuda",
            "resilience.hang_detection.step_timeout_s=null",
            "resilience.hang_detection.out_of_section_timeout_s=null",
        ],
    )
    cpu = load_config(None, ["dist.device=cpu", "dist.timeout_s=600", "resilience.hang_detection.step_timeout_s=8"])
    auto = load_config(None, ["dist.timeout_s=600", "resilience.hang_detection.step_timeout_s=300"])
    with pytest.raises(ConfigError, match="dist.timeout_s=600 must be at least 60 s below"):
        check_collective_timeouts(auto)
    assert cpu.resilience.hang_detection.step_timeout_s == 8


def test_s3_restore_must_fit_the_init_section():
    s3 = ["checkpoint.s3.uri=s3://bucket/run", "resilience.hang_detection.init_timeout_s=900"]
    assert load_config(None, s3 + ["checkpoint.s3.restore_timeout_s=600"]).checkpoint.s3.restore_timeout_s == 600
    with pytest.raises(ConfigError) as err:
        load_config(None, s3 + ["checkpoint.s3.restore_timeout_s=3600"])
    for text in (
        "checkpoint.s3.restore_timeout_s=3600",
        "resilience.hang_detection.init_timeout_s=900",
        "checkpoint.s3.restore=false",
    ):
        assert text in str(err.value)
    # Without a restore at start the restore's timeout is not used.
    load_config(None, s3 + ["checkpoint.s3.restore_timeout_s=3600", "checkpoint.s3.restore=false"])
    load_config(None, ["checkpoint.s3.restore_timeout_s=3600"])


def test_a_fault_added_by_inject_needs_what_it_acts_on_as_one_in_the_config_does():
    """The chart's chaos drill adds its faults with ``--inject``, after the configuration is
    loaded: a memory fault without the memory tier is refused there too, naming the key."""
    from resilient_fsdp.config import ConfigError
    from resilient_fsdp.train.arguments import parse_args, resolve_config

    for fault, key in (
        ("sigkill-during-replication@4", "checkpoint.memory.interval_steps is 0"),
        ("memory-corrupt@4", "checkpoint.memory.interval_steps is 0"),
    ):
        with pytest.raises(ConfigError, match=key):
            resolve_config(parse_args([f"--inject={fault}"]))
    with pytest.raises(ConfigError, match="checkpoint.memory.replicas is 0; set it to 1"):
        resolve_config(
            parse_args(
                [
                    "--inject=sigkill-during-replication@4",
                    "--set",
                    "checkpoint.memory.interval_steps=2",
                    "--set",
                    "checkpoint.memory.replicas=0",
                ]
            )
        )
    assert resolve_config(
        parse_args(
            [
                "--inject=sigkill-during-replication@4",
                "--set",
                "checkpoint.memory.interval_steps=2",
                "--set",
                "checkpoint.memory.replicas=1",
            ]
        )
    ).resilience.inject == ["sigkill-during-replication@4"]
