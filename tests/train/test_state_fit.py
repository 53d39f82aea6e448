"""What the trainer refuses once the model is built, on ``meta``, before anything is allocated: a
``data.seq_len`` above what the model declares, and, on a GPU, a training state its shard group
cannot hold (train/state_fit.py, the chart's rule at render: tests/deploy/test_rule_parity.py)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from resilient_fsdp.config import ConfigError, load_config
from resilient_fsdp.train import state_fit
from resilient_fsdp.train.model import build_model
from resilient_fsdp.train.presets import PRESETS, parameter_count
from resilient_fsdp.train.trainer import Trainer, build_any_model
from tests.support import REPO


def _check(overrides: list[str], device: torch.device, world_size: int = 8):
    cfg = load_config(None, overrides)
    model = build_any_model(cfg)
    fake = SimpleNamespace(cfg=cfg, model=model, info=SimpleNamespace(device=device, world_size=world_size))
    Trainer.check_model_takes_the_job(fake)


def test_the_arithmetic_the_chart_uses():
    params = parameter_count(PRESETS["70b"])
    assert state_fit.state_bytes_per_gpu(params, 8) == params * 16 / 8
    assert not state_fit.fits(params, 8, 80 * 10**9) and not state_fit.fits(params, 16, 80 * 10**9)
    assert state_fit.fits(params, 24, 80 * 10**9)
    assert state_fit.gpus_needed(params, 80 * 10**9) == 19
    why = state_fit.refusal(params, 8, 80 * 10**9, "model.preset=70b", 8, "this GPU")
    assert "model.preset=70b does not fit" in why and "141.1 GB a GPU" in why
    assert "Shard it over 19 GPUs or more: nodes=3 or more with dist.shard_group_size=0" in why
    assert state_fit.refusal(parameter_count(PRESETS["8b"]), 32, 80 * 10**9, "model.preset=8b", 8, "x") is None


def test_a_sequence_longer_than_the_model_declares_is_refused_on_meta(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "images" / "custom-model"))
    sys.modules.pop("my_models.gpt", None)
    factory = ["model.factory=my_models.gpt:build_model", "model.vocab_size=4096"]
    with pytest.raises(ConfigError) as refused:
        _check(factory + ["data.seq_len=4096"], torch.device("cpu"))
    message = str(refused.value)
    assert "data.seq_len=4096 is above the 2048 positions model.factory=my_models.gpt:build_model takes" in message
    assert "set data.seq_len=2048 or less, and model.max_seq_len=2048" in message
    _check(factory + ["data.seq_len=2048"], torch.device("cpu"))  # as long as it takes: accepted


def test_the_configuration_refuses_it_before_the_model_is_built():
    with pytest.raises(ConfigError, match=r"data.seq_len=4096 is above model.max_seq_len=2048.*data.seq_len=2048"):
        load_config(None, ["model.max_seq_len=2048", "data.seq_len=4096"])
    with pytest.raises(ConfigError, match="data.source=tokens needs data.path"):
        load_config(None, ["data.source=tokens"])


def test_a_state_that_cannot_fit_the_gpus_is_refused_before_it_is_allocated(monkeypatch):
    """No GPU exists here: torch's answer for the device's memory is stood in for (an 80 GB H100);
    the model is the real 70b, built on meta (nothing allocated)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(total_memory=80 * 10**9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d: "NVIDIA H100 80GB HBM3")
    with pytest.raises(ConfigError) as refused:
        _check(["model.preset=70b"], torch.device("cuda", 0), world_size=8)
    message = str(refused.value)
    assert "model.preset=70b does not fit" in message and "this GPU (NVIDIA H100 80GB HBM3) has 80 GB" in message
    assert "nodes=3 or more" in message
    _check(["model.preset=70b"], torch.device("cuda", 0), world_size=32)  # four nodes: it fits
    # On CPU the rule does not apply (host memory is not the GPU's).
    _check(["model.preset=70b"], torch.device("cpu"), world_size=8)


def test_the_built_in_model_takes_any_length():
    with torch.device("meta"):
        assert getattr(build_model("tiny"), "max_seq_len", None) is None
