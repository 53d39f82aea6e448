"""A Hugging Face causal LM defined by a ``config.json`` (``model.hf_config``), built to be sharded.

:func:`build` reads the configuration (a ``config.json`` or a model directory holding one, never a
hub download) and builds ``AutoModelForCausalLM`` under the meta device, so no rank allocates the
full model: FSDP shards the decoder layers (:func:`blocks_attr` finds them) and
:func:`init_weights` fills the shards with transformers' own initialisation once they exist.
The model returns transformers' output; the trainer takes its ``logits``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError

KEY = "model.hf_config"
CONFIG_NAME = "config.json"


def config_file(path: str, key: str = KEY) -> Path:
    """The ``config.json`` that ``path`` names (the file, or a directory holding it)."""
    p = Path(path)
    found = p / CONFIG_NAME if p.is_dir() else p
    if not found.is_file():
        raise ConfigError(
            f"{key}={path!r}: no {CONFIG_NAME} there; set {key} to a model's config.json or to a "
            "local directory holding one (on the shared volume or in the image: nothing is downloaded)"
        )
    try:
        json.loads(found.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}={path!r}: {found} is not a readable JSON file ({exc})") from exc
    return found


def load_config(path: str) -> Any:
    """transformers' configuration object for ``path``, for training: no generation cache."""
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise ConfigError(
            f"{KEY} needs the transformers package: pip install 'resilient-fsdp[hf]' (the trainer image has it)"
        ) from exc
    found = config_file(path)
    try:
        config = AutoConfig.from_pretrained(str(found.parent), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ConfigError(f"{KEY}={path!r}: transformers cannot read {found}: {exc}") from exc
    config.use_cache = False
    return config


def build(path: str) -> nn.Module:
    """The causal LM of ``path``'s configuration, its parameters on the meta device (call under
    ``torch.device("meta")``), in float32 (mixed precision is the trainer's), with SDPA attention.

    It carries what the trainer asks of a model: ``max_seq_len`` (the configuration's
    ``max_position_embeddings``), ``vocab_size``, ``hf_blocks`` (the dotted name of its decoder
    layers) and ``recompute_needs_rng`` (whether any dropout is on)."""
    from transformers import AutoModelForCausalLM

    config = load_config(path)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    except ValueError as exc:
        raise ConfigError(
            f"{KEY}={path!r}: transformers builds no causal LM from it ({str(exc).splitlines()[0]}); "
            "name a decoder-only model's config.json (model_type llama, mistral, qwen2, ...)"
        ) from exc
    model.max_seq_len = int(getattr(config, "max_position_embeddings", 0) or 0) or None
    model.vocab_size = int(config.vocab_size)
    model.hf_blocks = blocks_attr(model)
    model.recompute_needs_rng = any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()) or any(
        float(getattr(config, k, 0) or 0) > 0 for k in ("attention_dropout", "hidden_dropout", "dropout")
    )
    return model


def blocks_attr(model: nn.Module) -> str:
    """The dotted name of the ``nn.ModuleList`` holding the model's decoder layers: the list whose
    modules are of the classes transformers itself keeps whole when it splits a model
    (``_no_split_modules``), e.g. ``model.layers``."""
    whole = set(getattr(model, "_no_split_modules", None) or [])
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(type(m).__name__ in whole for m in module):
            return name
    for name, module in model.named_modules():  # no declaration: the longest list of one kind
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            return name
    raise ConfigError(
        f"{type(model).__name__} has no list of decoder layers for FSDP to shard; set model.blocks to "
        "the attribute that holds them"
    )


@torch.no_grad()
def init_weights(model: nn.Module) -> None:
    """transformers' initialisation of every module (normal weights, unit norms, rotary tables),
    on whatever shards exist after ``to_empty``. It is called per module, not through
    ``init_weights()``, which skips modules it marked initialised while they were on meta."""
    for module in model.modules():
        model._init_weights(module)


def tied_names(model: nn.Module) -> set[str]:
    """Names in the model's state dict that are another parameter under a second name (a tied
    output projection): saved and loaded once, under the first name."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:
            tied.add(name)
        else:
            seen[key] = name
    return tied
