"""Activation checkpointing and the blocks FSDP shards: RNG replayed for dropout, a custom model's
blocks named by ``model.blocks`` or refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from resilient_fsdp.checkpoint.state import canonical_name
from resilient_fsdp.config import ConfigError
from resilient_fsdp.train import parallelize
from resilient_fsdp.train.model import build_model
from tests.support import read_summary, run_trainer, write_module


class DropoutNet(nn.Module):
    def __init__(self, attr: str = "layers"):
        super().__init__()
        blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.5)) for _ in range(3))
        setattr(self, attr, blocks)
        self.attr = attr
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in getattr(self, self.attr):
            x = x + block(x)
        return self.head(x)


def grads(model: nn.Module, seed: int = 7) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(8, 16)
    model.zero_grad()
    model(x).square().mean().backward()
    return {canonical_name(n): p.grad.clone() for n, p in model.named_parameters()}


def test_a_dropout_model_gets_the_same_gradients_with_activation_checkpointing():
    torch.manual_seed(0)
    plain = DropoutNet()
    wrapped = copy.deepcopy(plain)
    parallelize.apply_ac(wrapped)
    assert all(type(b).__name__ == "CheckpointWrapper" for b in wrapped.layers)
    expected, got = grads(plain), grads(wrapped)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_recompute_without_the_rng_state_would_change_the_gradients():
    """What the test above guards against: a model that declares it needs no RNG state while it
    uses dropout gets other masks in the recompute, so other gradients."""
    torch.manual_seed(0)
    plain = DropoutNet()
    wrapped = copy.deepcopy(plain)
    wrapped.recompute_needs_rng = False
    parallelize.apply_ac(wrapped)
    expected, got = grads(plain), grads(wrapped)
    assert any(not torch.equal(expected[n], got[n]) for n in expected)


def test_the_built_in_model_declares_it_needs_no_rng_state():
    with torch.device("meta"):
        model = build_model("tiny")
    assert not parallelize.needs_rng_in_recompute(model)
    assert parallelize.needs_rng_in_recompute(DropoutNet())


def test_blocks_are_found_by_model_blocks_or_refused_naming_the_key():
    assert len(parallelize.blocks_of(DropoutNet("layers"))) == 3
    nested = nn.Module()
    nested.transformer = nn.Module()
    nested.transformer.h = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    assert len(parallelize.blocks_of(nested, "transformer.h")) == 2
    with pytest.raises(ConfigError, match=r"model DropoutNet has no \.layers .*set model\.blocks"):
        parallelize.blocks_of(DropoutNet("blocks"))
    assert len(parallelize.blocks_of(DropoutNet("blocks"), "blocks")) == 3
    with pytest.raises(ConfigError, match=r"model\.blocks='trunk': DropoutNet\.trunk is missing"):
        parallelize.blocks_of(DropoutNet("blocks"), "trunk")
    with pytest.raises(ConfigError, match=r"model\.blocks='head': DropoutNet\.head is a Linear"):
        parallelize.blocks_of(DropoutNet("blocks"), "head")


BLOCKS_MODEL = """
    from torch import nn

    class Net(nn.Module):
        def __init__(self, vocab):
            super().__init__()
            self.emb = nn.Embedding(vocab, 32)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1)) for _ in range(2))
            self.head = nn.Linear(32, vocab)

        def forward(self, tokens):
            h = self.emb(tokens)
            for block in self.blocks:
                h = h + block(h)
            return self.head(h)

    def build(cfg):
        return Net(cfg.vocab_size or 256)
"""


def test_a_custom_model_without_layers_trains_once_its_blocks_are_named(tmp_path, plugin_dir):
    write_module(plugin_dir, "blocks_model", BLOCKS_MODEL)
    common = ["train.steps=2", "model.factory=blocks_model:build", "model.activation_checkpointing=true"]
    refused = run_trainer(tmp_path / "refused", common, pythonpath=[plugin_dir])
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "model Net has no .layers" in refused.stderr and "set model.blocks" in refused.stderr
    ok = run_trainer(tmp_path / "ok", common + ["model.blocks=blocks"], pythonpath=[plugin_dir])
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert read_summary(tmp_path / "ok")["final_step"] == 2
