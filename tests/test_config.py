"""Configuration: precedence, and errors that name the key and the valid choices."""

from __future__ import annotations

import pytest
import yaml

from resilient_fsdp.config import Config, ConfigError, describe, dump_yaml, load_config


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


@pytest.mark.parametrize("override, expected", [
    ("model.presett=1b", ["unknown key 'model.presett'", "did you mean 'model.preset'", "valid keys in model"]),
    ("trian.steps=3", ["unknown key 'trian'", "did you mean 'train'"]),
    ("model.preset=huge", ["model.preset", "'huge'", "'tiny'", "'70b'"]),
    ("data.source=csv", ["data.source", "'synthetic'", "'tokens'"]),
    ("train.steps=abc", ["train.steps", "integer", "'abc'"]),
    ("train.steps=0", ["train.steps", "greater than 0"]),
    ("optim.lr=-1", ["optim.lr", "greater than 0"]),
    ("model=3", ["model", "expected a section"]),
])
def test_bad_values_name_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    for fragment in expected:
        assert fragment in str(info.value)


def test_bad_file_key_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("checkpoint:\n  interval_step: 5\n")
    with pytest.raises(ConfigError, match=r"unknown key 'checkpoint.interval_step' \(did you mean 'checkpoint.interval_steps'"):
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
    for key in ("seed", "model.preset", "model.factory", "data.factory", "train.steps", "checkpoint.dir",
                "checkpoint.interval_steps"):
        assert f"\n{key} = " in "\n" + text
    assert "Optimizer steps to train for." in text
