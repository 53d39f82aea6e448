"""The built-in transformer: preset sizes (on the meta device) and a forward pass."""

from __future__ import annotations

import pytest
import torch

from resilient_fsdp.train.model import build_model, count_params
from resilient_fsdp.train.presets import PRESETS, parameter_count


@pytest.mark.parametrize("preset, nominal", [("125m", 125e6), ("1b", 1.1e9), ("8b", 8.0e9), ("70b", 70.6e9)])
def test_presets_have_their_nominal_size(preset, nominal):
    with torch.device("meta"):
        model = build_model(preset)
    assert abs(count_params(model) - nominal) / nominal < 0.1


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_presets_counted_parameters_are_the_built_models(preset):
    """``advise`` sizes checkpoints from the count without building the model."""
    with torch.device("meta"):
        model = build_model(preset)
    assert parameter_count(PRESETS[preset]) == count_params(model)


def test_meta_build_allocates_nothing():
    with torch.device("meta"):
        model = build_model("70b")
    assert all(p.is_meta for p in model.parameters())


def test_forward_shapes_and_causality():
    torch.manual_seed(0)
    model = build_model("tiny")
    model.init_weights()
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    # Changing a later token must not change earlier positions' outputs.
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    assert torch.equal(model(changed)[:, :10], logits[:, :10])
    assert not torch.equal(model(changed)[:, 10:], logits[:, 10:])
