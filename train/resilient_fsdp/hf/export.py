"""A committed checkpoint as a Hugging Face model directory (``checkpoints export``).

The tensors are read from the DCP checkpoint a group at a time, each group one safetensors file
of at most ``max_shard_bytes`` (so the workstation holds one file's worth, not the model), with the
``config.json`` and tokenizer files the run trained with. The built-in model becomes
``LlamaForCausalLM`` (:mod:`.names`), a ``model.hf_config`` model keeps its own names, a custom
factory's its state dict's. The directory appears whole or not at all: written beside its final
name and renamed; an existing one is never replaced. ``resilient-fsdp checkpoints export`` runs it.
"""

from __future__ import annotations

import json
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import atomic
from ..checkpoint import store
from ..config import Config, ConfigError
from ..train.presets import preset_args
from .names import llama_config, to_hf

MODEL_DIR = "model"  # <run_dir>/model/: the config.json and tokenizer files a run trains with
DEFAULT_SHARD_BYTES = 5 * 1024**3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _reader(path: Path):
    """A DCP reader of ``path`` that unpickles ``.metadata`` once for every group it reads (at a
    thousand ranks the file holds every rank's chunks: hundreds of MB)."""
    from torch.distributed.checkpoint import FileSystemReader

    class MetadataOnce(FileSystemReader):
        _metadata = None

        def read_metadata(self, *args, **kwargs):
            if self._metadata is None:
                self._metadata = super().read_metadata(*args, **kwargs)
            return self._metadata

    return MetadataOnce(str(path))


def model_tensors(reader) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The model's tensors in a DCP checkpoint: name (without the ``model.`` section) -> (shape, dtype)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = reader.read_metadata()
    return {
        key[len("model.") :]: (tuple(meta.size), meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }


def plan(cfg: Config, run_dir: Path, names: list[str]) -> tuple[Callable[[str], str], Optional[dict], list[str]]:
    """How the run's model is exported: the rename, the ``config.json`` (None for a custom factory)
    and the names left out (a tied output projection, saved once)."""
    m = cfg.model
    if m.factory:
        return (lambda n: n), None, []
    if m.hf_config:
        saved = run_dir / MODEL_DIR / "config.json"
        source = saved if saved.is_file() else Path(m.hf_config)
        source = source / "config.json" if source.is_dir() else source
        if not source.is_file():
            raise ConfigError(
                f"the run's model.hf_config ({m.hf_config}) is not readable here and {saved} is missing; "
                "pass --hf-config with the config.json the run trained"
            )
        config = json.loads(source.read_text())
        left_out = ["lm_head.weight"] if config.get("tie_word_embeddings") and "lm_head.weight" in names else []
        return (lambda n: n), config, left_out
    tokens = _token_meta(run_dir)
    config = llama_config(
        preset_args(m.preset, m.vocab_size),
        m.max_seq_len or cfg.data.seq_len,
        eos_token_id=tokens.get("eos_id"),
        bos_token_id=tokens.get("bos_id"),
    )
    return to_hf, config, []


def _token_meta(run_dir: Path) -> dict:
    path = run_dir / MODEL_DIR / "tokens.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def export(
    cfg: Config,
    run_dir: Path,
    ckpt: store.CheckpointInfo,
    out: Path,
    dtype: Optional[str] = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    tokenizer: Optional[Path] = None,
    hf_config: Optional[Path] = None,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict:
    """Write ``ckpt``'s model to ``out``; what was written (files, tensors, bytes)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    if ckpt.manifest.get("mode") == "torch-async":
        raise ConfigError(
            f"{ckpt.path} was written by checkpoint.mode=torch-async (one file per rank, read back only "
            "at the same world size); export reads DCP checkpoints (checkpoint.mode=async or sync)"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not empty; name a new directory (nothing there is replaced)")
    if hf_config is not None:
        cfg.model.hf_config = str(hf_config)
    reader = _reader(ckpt.path)
    tensors = model_tensors(reader)
    if not tensors:
        raise ConfigError(f"{ckpt.path} holds no model tensors")
    rename, config, left_out = plan(cfg, run_dir, sorted(tensors))
    target = DTYPES[dtype] if dtype else None
    names = [n for n in sorted(tensors) if n not in left_out]
    try:
        renamed = {n: rename(n) for n in names}
    except KeyError as exc:
        raise ConfigError(
            f"{ckpt.path}: parameter {exc} is not one of the built-in model's; was the run's "
            "model.factory or model.hf_config left out of its config.yaml?"
        ) from exc
    groups = _groups(names, tensors, target, max_shard_bytes)
    for stale in out.parent.glob(f"{out.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a killed export's scratch directory: never a model
    partial = out.with_name(f"{out.name}.partial-{uuid.uuid4().hex[:8]}")
    partial.mkdir(parents=True)
    try:
        index, total = {}, 0
        for i, group in enumerate(groups):
            fname = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            progress(f"{fname}: {len(group)} tensors")
            state = {"model": {n: torch.empty(tensors[n][0], dtype=tensors[n][1]) for n in group}}
            with warnings.catch_warnings():  # no process group: torch says it assumes one process, as it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, storage_reader=reader)
            out_tensors = {renamed[n]: (t.to(target) if target else t).contiguous() for n, t in state["model"].items()}
            save_file(out_tensors, str(partial / fname), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in out_tensors.values())
            index.update({name: fname for name in out_tensors})
            del state, out_tensors  # before the next group is allocated: one group in memory at a time
        if len(groups) > 1:
            (partial / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, indent=2)
            )
        if config is not None:
            # The dtype the weights were written in (a model's config.json may name its published
            # weights' bf16 while training kept float32): what from_pretrained loads them as.
            written = dtype or str(tensors[names[0]][1]).removeprefix("torch.")
            config = {**config, "torch_dtype": written, "dtype": written}
            (partial / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copied = _copy_tokenizer(tokenizer or run_dir / MODEL_DIR / "tokenizer", partial)
        for f in partial.iterdir():
            atomic.fsync_file(f)
        atomic.rename(partial, out)  # onto an empty directory too (POSIX rename replaces it)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # this command's own scratch directory
        raise
    return {
        "step": ckpt.step,
        "out": str(out),
        "files": len(groups),
        "tensors": len(index),
        "bytes": total,
        "config": config is not None,
        "tokenizer_files": copied,
    }


def _groups(names: list[str], tensors: dict, target: Optional[torch.dtype], limit: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for n in names:
        shape, dtype = tensors[n]
        nbytes = int(torch.Size(shape).numel()) * (target or dtype).itemsize
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    return groups


def _copy_tokenizer(source: Path, dest: Path) -> list[str]:
    if source.is_file():
        files = [source]
    elif source.is_dir():
        files = sorted(p for p in source.iterdir() if p.is_file())
    else:
        return []
    for f in files:
        shutil.copyfile(f, dest / f.name)
    return [f.name for f in files]
