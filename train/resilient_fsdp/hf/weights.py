"""Pretrained weights into the sharded model (``model.init_from``): a directory of safetensors
files (``model.safetensors`` or shards with ``model.safetensors.index.json``), read through torch
DCP's ``HuggingFaceStorageReader``. Every rank reads only the slices its shards hold, so no rank
ever holds the full model.

Names: a ``model.hf_config`` model and a custom factory's model are loaded under their own
parameter names; the built-in model under Llama's (:mod:`.names`), so a preset starts from a Llama
checkpoint of its shape, or from one ``checkpoints export`` wrote.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable

from torch import nn

from ..config import ConfigError
from .model import tied_names

KEY = "model.init_from"


def safetensors_dir(path: str) -> Path:
    """The directory ``path`` names (or the directory of a ``.safetensors`` file), checked to hold
    safetensors files."""
    p = Path(path)
    directory = p.parent if p.suffix == ".safetensors" else p
    if not directory.is_dir() or not any(directory.glob("*.safetensors")):
        raise ConfigError(
            f"{KEY}={path!r}: no .safetensors files there; set {KEY} to a local or shared-volume "
            "directory of a Hugging Face model's weights (model.safetensors, or its shards and "
            "model.safetensors.index.json)"
        )
    for f in sorted(directory.glob("*.safetensors")):
        if not os.access(f, os.R_OK):
            st = f.stat()
            raise ConfigError(
                f"{KEY}={path!r}: {f} is not readable by this process's user (uid {os.getuid()}, groups "
                f"{sorted(os.getgroups())}): mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}, gid "
                f"{st.st_gid}. transformers' save_pretrained writes weights owner-only (0600): make "
                "them readable by the pods' user or group (chmod a+r, or chgrp to the pods' fsGroup "
                "and chmod g+r)"
            )
    return directory


def load_pretrained(model: nn.Module, path: str, rename: Callable[[str], str]) -> int:
    """Load ``path``'s weights into ``model`` (sharded, materialised) in place; the number of
    tensors loaded. ``rename`` maps a parameter's name to its name in the files. A tensor the model
    has and the files lack, or of another shape, is refused naming it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    directory = safetensors_dir(path)
    ours = get_model_state_dict(model, options=StateDictOptions())
    skip = tied_names(model)
    theirs = {}
    for name, tensor in ours.items():
        if name in skip:
            continue
        try:
            theirs[rename(name)] = tensor
        except KeyError as exc:
            raise ConfigError(
                f"{KEY}={path!r}: the model's parameter {name!r} has no name in a Hugging Face checkpoint"
            ) from exc
    reader = HuggingFaceStorageReader(str(directory))
    available = reader.read_metadata().state_dict_metadata
    missing = sorted(set(theirs) - set(available))
    if missing:
        raise ConfigError(
            f"{KEY}={path!r}: {len(missing)} of the model's {len(theirs)} tensors are not in {directory}, "
            f"e.g. {', '.join(missing[:3])}; the weights belong to another architecture or size"
        )
    for name, tensor in theirs.items():
        shape = tuple(getattr(available[name], "size", ()))
        if shape and shape != tuple(tensor.shape):
            raise ConfigError(
                f"{KEY}={path!r}: {name} is {list(shape)} in {directory}, the model's is "
                f"{list(tensor.shape)}; the weights belong to a model of another size"
            )
    dcp.load(theirs, storage_reader=HuggingFaceStorageReader(str(directory)))
    set_model_state_dict(model, ours)
    return len(theirs)
