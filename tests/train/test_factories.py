"""model.factory / data.factory: imports by name, with errors that say what to fix."""

from __future__ import annotations

import sys

import pytest
from torch import nn

from resilient_fsdp.config import ConfigError, DataConfig, ModelConfig
from resilient_fsdp.train.data import build_dataset
from resilient_fsdp.train.factories import call_factory, load_factory
from tests.support import write_module


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    write_module(
        tmp_path,
        "my_plugins",
        """
        import torch
        from torch import nn
        NOT_CALLABLE = 3
        def build_model(cfg):
            return nn.Linear(4, 4)
        def build_wrong(cfg):
            return "a string"
        class Tokens:
            def __init__(self, cfg, vocab):
                self.cfg, self.vocab = cfg, vocab
            def __len__(self):
                return 10
            def __getitem__(self, i):
                return torch.full((self.cfg.seq_len + 1,), i % self.vocab)
        def build_dataset(cfg, vocab):
            return Tokens(cfg, vocab)
        def build_no_len(cfg, vocab):
            return object()
    """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_plugins", None)


def test_factory_is_imported_and_called(plugins):
    model = call_factory("my_plugins:build_model", "model.factory", nn.Module, ModelConfig())
    assert isinstance(model, nn.Linear)
    ds = build_dataset(DataConfig(factory="my_plugins:build_dataset", seq_len=5), 7, 0)
    assert len(ds) == 10 and ds[3].tolist() == [3] * 6


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("my_plugins", "expected 'pkg.module:function'"),
        ("no_such_pkg.mod:build", "cannot import module 'no_such_pkg.mod'"),
        ("my_plugins:missing", "has no attribute 'missing'; callables there: Tokens, build_dataset"),
        ("my_plugins:NOT_CALLABLE", "is a int, not a callable"),
    ],
)
def test_bad_spec_names_key_and_fix(plugins, spec, fragment):
    with pytest.raises(ConfigError) as info:
        load_factory(spec, "model.factory")
    assert str(info.value).startswith(f"model.factory={spec!r}") and fragment in str(info.value)


def test_wrong_return_types_are_named(plugins):
    with pytest.raises(ConfigError, match=r"returned builtins.str; expected torch.nn.modules.module.Module"):
        call_factory("my_plugins:build_wrong", "model.factory", nn.Module, ModelConfig())
    with pytest.raises(ConfigError, match="without __len__, __getitem__"):
        build_dataset(DataConfig(factory="my_plugins:build_no_len"), 7, 0)
