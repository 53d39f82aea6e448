"""The trainer every rank runs: a thin composition root and the training loop.

:class:`Trainer` is built in a fixed order, one build step each (see ``__init__``); ``train()``
is the loop: per step ``train_step()`` inside ``attempt.step(...)``, then
``checkpointer.after_step(...)``; at the end ``checkpointer.finish(...)``. The resilience hooks
are one object, :class:`~..resilience.attempt.Attempt`. Run by :mod:`.entrypoint`; what outlives
an in-process restart is :mod:`.resources`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.group import RankGroup
from ..checkpoint.memory import prefetch
from ..checkpoint.state import CheckpointState
from ..checkpoint.votes import Votes
from ..checkpoint.writer.process import NVRX_VERSION
from .. import atomic
from ..config import Config, ConfigError, dump_yaml
from ..data import remote_copy, token_files
from ..hf import export as hf_export
from ..hf import model as hf_model
from ..hf import names as hf_names
from ..hf import weights as hf_weights
from ..resilience import accounting, non_finite, sdc, stragglers
from ..resilience.faults import node_index
from ..resilience.attempt import Attempt
from ..resilience.graceful_stop import StopRequested
from ..resilience.inprocess import InProcessAttempt
from . import distributed, footprint, global_batch, parallelize, state_fit
from .data import BatchLoader, TokenFile, build_dataset
from .factories import call_factory
from .metrics import MetricsLog, params_sha256
from .model import build_model, count_params, preset_args
from .resources import ProcessResources


@dataclass
class TrainCounters:
    """The trainer's own counters; saved with the model so a resume continues the count."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


def vocab_size_of(cfg: Config) -> int:
    if cfg.model.hf_config:
        return int(hf_model.load_config(cfg.model.hf_config).vocab_size)
    return cfg.model.vocab_size or preset_args(cfg.model.preset).vocab_size


def model_name_of(cfg: Config) -> str:
    m = cfg.model
    if m.factory:
        return f"model.factory={m.factory}"
    return f"model.hf_config={m.hf_config}" if m.hf_config else f"model.preset={m.preset}"


def build_any_model(cfg: Config) -> nn.Module:
    """The built-in transformer, a ``model.hf_config`` causal LM, or ``model.factory``'s module;
    always on the meta device."""
    with torch.device("meta"):
        if cfg.model.factory:
            return call_factory(cfg.model.factory, "model.factory", nn.Module, cfg.model)
        if cfg.model.hf_config:
            return hf_model.build(cfg.model.hf_config)
        return build_model(cfg.model.preset, cfg.model.vocab_size)


def lr_lambda(cfg: Config):
    """Linear warm-up to the peak, then cosine decay to ``min_lr_ratio`` at the last step."""
    warmup, total, floor = cfg.optim.warmup_steps, cfg.train.steps, cfg.optim.min_lr_ratio

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Trainer:
    """One attempt at training, built in the order of its build steps, then :meth:`train`."""

    cfg: Config
    info: distributed.DistInfo
    attempt: Attempt
    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR
    data: BatchLoader
    counters: TrainCounters
    metrics: MetricsLog
    checkpointer: Checkpointer

    def __init__(
        self, cfg: Config, resources: Optional[ProcessResources] = None, in_process: Optional[InProcessAttempt] = None
    ):
        # Without resources from the caller (benchmarks, probes) the trainer owns its own.
        self.owns_resources = resources is None
        resources = resources or ProcessResources(cfg)
        self.cfg, self.resources = cfg, resources
        self.run_dir = Path(cfg.run_dir)
        self.t_start = time.perf_counter()
        self.attempt = Attempt(cfg.resilience, self.run_dir, resources.monitor, in_process)
        # A failure from here on ends the attempt: judged, so that the same one again is not retried.
        with self.attempt.judging_failures():
            self.build_process_group()  # 1. device, process group, the attempt's layer and faults
            self.build_data()  # 2. data first: it checks files and factories before any allocation
            self.build_model()  # 3. mesh, model on meta, AC, FSDP2 per block then root, materialised
            self.build_optimizer()  # 4. optimizer and schedule
            self.build_checkpointer()  # 5. everything a resumed run needs, and what it must match
        self.step_times: list[float] = []
        self.last_loss = float("nan")

    # -- the build steps, in order ----------------------------------------------------------------

    def build_process_group(self) -> None:
        cfg = self.cfg
        if cfg.train.deterministic:
            # Must be set before the first cuBLAS call for deterministic GEMMs on GPUs.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        me = distributed.identity(cfg.dist)
        # Reads this rank's newest memory snapshot while the group forms and the model is built
        # (checkpoint.memory.prefetch).
        self.memory_prefetch = prefetch.start(cfg.checkpoint, cfg.checkpoint_dir, me.rank, me.world_size, me.device)
        self.info = distributed.init_distributed(cfg.dist, self.attempt.store, me)
        self.attempt.mark("group")
        self.is_rank0 = self.info.rank == 0
        # Python's and NumPy's generators (datasets and user code draw from them): seeded per rank,
        # so runs repeat; checkpoints save and restore them with torch's.
        random.seed(cfg.seed * 1_000_003 + self.info.rank)
        np.random.seed((cfg.seed * 1_000_003 + self.info.rank) % 2**32)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.versions = {"nvrx_version": NVRX_VERSION, "torch_version": torch.__version__}
        self.attempt.joined(self.info.rank, self.info.world_size, self.info.device, self.run_dir / "metrics.jsonl")
        if cfg.train.deterministic:
            # On CUDA a few kernels lack deterministic versions: warn rather than refuse.
            torch.use_deterministic_algorithms(True, warn_only=self.info.device.type == "cuda")
        self.metrics = MetricsLog(self.run_dir, self.is_rank0, cfg.train.log_every)
        self.stragglers = stragglers.Stragglers(
            cfg.resilience.stragglers,
            self.info.rank,
            self.info.device,
            self.attempt.ledger,
            self.attempt.exclude_this_node,
            self.resources.monitor.active,
            stragglers.spares_in(os.environ),
            self.log_event,
        )

    def build_data(self) -> None:
        cfg = self.cfg
        vocab = vocab_size_of(cfg)
        local = None
        if cfg.data.source == "tokens" and not cfg.data.factory and (cfg.data.path or "").startswith("s3://"):
            cache = Path(cfg.data.cache_dir) if cfg.data.cache_dir else self.run_dir / "data"
            local = str(
                remote_copy.local_copy(
                    cfg.data.path,
                    cache,
                    cfg.checkpoint.s3,
                    self.info.rank,
                    say=lambda m: print(f"[resilient-fsdp] {m}", file=sys.stderr, flush=True),
                )
            )
        dataset = build_dataset(cfg.data, vocab, cfg.seed, local, model_name_of(cfg))
        self.data_dir = dataset.directory if isinstance(dataset, TokenFile) and dataset.meta else None
        self.data = BatchLoader(dataset, cfg.data, vocab, cfg.seed, self.info.rank, self.info.world_size)

    def build_model(self) -> None:
        cfg = self.cfg
        mesh = distributed.build_mesh(self.info, cfg.dist.shard_group_size)
        self.mesh = mesh
        self.model = build_any_model(cfg)
        self.check_model_takes_the_job()  # on meta still: refused before anything is allocated
        blocks = cfg.model.blocks or getattr(self.model, "hf_blocks", None)
        if cfg.model.activation_checkpointing:
            parallelize.apply_ac(self.model, blocks)
        parallelize.apply_fsdp(self.model, mesh, self.info.device, blocks)
        parallelize.materialize(
            self.model, self.info.device, cfg.seed, init=hf_model.init_weights if cfg.model.hf_config else None
        )
        self.num_params = count_params(self.model)

    def check_model_takes_the_job(self) -> None:
        """The sequences the model declares it takes, and, on a GPU, whether its training state fits
        (:mod:`.state_fit`, the chart's rule at render): refused with the keys that fix them."""
        cfg, info = self.cfg, self.info
        name = model_name_of(cfg)
        declared = getattr(self.model, "max_seq_len", None)
        if isinstance(declared, int) and cfg.data.seq_len > declared:
            raise ConfigError(
                f"data.seq_len={cfg.data.seq_len} is above the {declared} positions {name} takes (its "
                f"max_seq_len): set data.seq_len={declared} or less, and model.max_seq_len={declared} so "
                "that the chart refuses a longer one at render"
            )
        if info.device.type == "cuda":
            group = distributed.shard_group_size(info.world_size, cfg.dist.shard_group_size)
            memory = torch.cuda.get_device_properties(info.device).total_memory
            why = state_fit.refusal(
                count_params(self.model),
                group,
                memory,
                name,
                int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                f"this GPU ({torch.cuda.get_device_name(info.device)})",
            )
            if why:
                raise ConfigError(why)

    def build_optimizer(self) -> None:
        # foreach=False keeps CPU numerics independent of grouping.
        o = self.cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
            foreach=self.info.device.type == "cuda",
        )
        self.attempt.mark("model")
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(self.cfg))
        self.counters = TrainCounters()

    def build_checkpointer(self) -> None:
        cfg, info, resources = self.cfg, self.info, self.resources
        state = CheckpointState(
            self.model,
            self.optimizer,
            self.lr_scheduler,
            self.counters,
            self.data,
            info.rank,
            resilience=resources.monitor,
        )
        identity = {
            "model": cfg.model.factory or cfg.model.hf_config or cfg.model.preset,
            "num_params": self.num_params,
            "shape_digest": state.shape_digest(),
            "shard_group_size": distributed.shard_group_size(info.world_size, cfg.dist.shard_group_size),
        }
        self.grad_accum = cfg.train.grad_accum_steps  # a resume at another world size may change it
        self.checkpointer = Checkpointer(
            cfg.checkpoint,
            cfg.checkpoint_dir,
            RankGroup(info.rank, info.world_size, info.device),
            state,
            identity,
            log=self.metrics,
            hooks=self.attempt,
            engine_factory=lambda: resources.checkpoint_engine(info.rank),
            uploader=resources.s3_uploader(info.rank, info.world_size),
            batch={
                "grad_accum_steps": self.grad_accum,
                "micro_batch_size": cfg.data.micro_batch_size,
                "global_batch_target": self.global_batch,
            },
            choose_batch=functools.partial(global_batch.at_resume, policy=cfg.train.elastic_batch),
            memory_prefetch=self.memory_prefetch,
        )
        self.attempt.memory_built(self.checkpointer.memory)
        self.checkpointer.preflight()
        # Replicas compared every resilience.sdc.interval_steps steps (HSDP): refused here without HSDP.
        spares, active = stragglers.spares_in(os.environ), self.resources.monitor.active
        ckpt = self.checkpointer
        self.replica_check = sdc.ReplicaCheck(
            cfg.resilience.sdc,
            self.mesh,
            self.info.rank,
            self.attempt.ledger,
            lambda: self.resumed_step,
            lambda step: ckpt.memory.discard_newer_than(step) if ckpt.memory is not None else [],
            ckpt.root,
            lambda: stragglers.why_not_replaceable(active, spares, node_index(), self.attempt.ledger),
            self.attempt.exclude_this_node,
            self.log_event,
        )

    # -- training ---------------------------------------------------------------------------------

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step at this world size (``train.elastic_batch`` may make it differ
        from the run's target, ``global_batch_target``)."""
        return self.info.world_size * self.grad_accum * self.cfg.data.micro_batch_size

    @property
    def global_batch_target(self) -> int:
        return self.checkpointer.batch.get("global_batch_target") or self.global_batch

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.cfg.data.seq_len

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs)
        logits = getattr(logits, "logits", logits)  # a transformers model returns an output object
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
        (loss / self.grad_accum).backward()
        return loss.detach()

    def train_step(self) -> tuple[float, bool]:
        """One optimizer step over ``grad_accum_steps`` micro-batches.

        Returns the global mean loss and whether any rank was asked to stop (SIGTERM): the flag
        rides on the loss all-reduce, so agreeing on it costs no extra collective.
        """
        accum = self.grad_accum
        local_loss = torch.zeros((), device=self.info.device)
        with self.stragglers.section("forward_backward"):
            for micro in range(accum):
                # Reduce-scatter gradients only after the last micro-batch.
                self.model.set_requires_gradient_sync(micro == accum - 1)
                inputs, targets = self.data.next_batch(self.info.device)
                local_loss += self.forward_backward(inputs, targets)
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.checkpointer.before_optimizer_step()  # a checkpoint's copy of the state must be done
        with self.stragglers.section("optimizer"):  # the rank's own work: no peer waits inside it
            self.optimizer.step()
            self.attempt.local_compute()
        self.attempt.after_optimizer_step(self.counters.step + 1, self.parameter_shards)
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        # The stop flag and the checkpointer's votes ride on the loss all-reduce (summed): one
        # collective a step, which the checkpointer would otherwise add to agree on its own.
        flags = torch.tensor(
            [1.0 if self.resources.stop.requested else 0.0, *self.checkpointer.votes().to_floats()],
            device=self.info.device,
        )
        self.attempt.before_collective(self.counters.step + 1, local_loss)
        self.local_loss = local_loss  # which rank's loss it was, should the global one be non-finite
        # gloo has no AVG reduction: sum and divide.
        reduced = torch.cat([local_loss.reshape(1), flags])
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        loss_sum, stops, *votes = reduced.tolist()
        self.checkpoint_votes = Votes.from_floats(votes)
        return loss_sum / (accum * self.info.world_size), stops > 0

    def parameter_shards(self) -> list[torch.Tensor]:
        """This rank's shard of every parameter (a DTensor's local tensor), in a fixed order."""
        return [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]

    def train(self) -> dict:
        with self.attempt.judging_failures():
            attempt, ckpt = self.attempt, self.checkpointer
            attempt.mark("built")
            ckpt.resume(suspect=sdc.suspect_window(attempt.ledger))
            if self.cfg.model.init_from and ckpt.resumed_from is None and self.counters.step == 0:
                self.load_pretrained()
            attempt.mark("resumed")
            self.grad_accum = ckpt.grad_accum_steps or self.grad_accum
            self.log_start()
            ckpt.started()
            attempt.started()
            self.model.train()
            resumed_step = self.resumed_step = self.counters.step
            last = min(self.cfg.train.steps, self.cfg.train.stop_at_step or self.cfg.train.steps)
            while self.counters.step < last:
                step = self.counters.step + 1
                lr = self.optimizer.param_groups[0]["lr"]
                with attempt.step(step):
                    t0 = time.perf_counter()
                    loss, stop = self.train_step()
                    step_time = time.perf_counter() - t0
                self.counters.step = step
                self.counters.tokens_seen += self.tokens_per_step
                self.step_times.append(step_time)
                self.last_loss = loss
                if not math.isfinite(loss):  # one restart, as a suspected hardware fault; the same step again fails
                    non_finite.stop(
                        step,
                        loss,
                        self.local_loss / self.grad_accum,
                        self.info.rank,
                        self.attempt.ledger,
                        self.log_event,
                    )
                ckpt_s = ckpt.after_step(step, agreed=self.checkpoint_votes)
                self.metrics.step(
                    {
                        "event": "step",
                        "step": step,
                        "loss": loss,
                        "step_time_s": step_time,
                        "ckpt_s": ckpt_s,
                        "tokens": self.tokens_per_step,
                        "global_batch": self.global_batch,
                        "lr": lr,
                        "t": time.time(),
                    }
                )
                if len(self.step_times) == 1:
                    self.after_first_step(resumed_step)
                self.stragglers.after_step(step, self.step_times)
                self.replica_check.after_step(step, self.parameter_shards)
                self.log_learned(attempt.maybe_learn())
                if stop:
                    self.stop_gracefully()
            ckpt.finish(self.counters.step, save=self.cfg.checkpoint.save_final)
            return self.finish()

    def load_pretrained(self) -> None:
        """``model.init_from``'s weights, at a fresh start (nothing resumed)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        rename = (lambda n: n) if cfg.model.factory or cfg.model.hf_config else hf_names.to_hf
        count = hf_weights.load_pretrained(self.model, cfg.model.init_from, rename)
        self.metrics.info(
            f"model.init_from: {count} tensors from {cfg.model.init_from} in {time.perf_counter() - t0:.1f} s"
        )

    def keep_model_files(self) -> None:
        """What ``checkpoints export`` needs besides the checkpoint, in ``<run_dir>/model/``: a
        ``model.hf_config`` model's ``config.json``, the prepared data's tokenizer and metadata."""
        cfg, dest = self.cfg, self.run_dir / hf_export.MODEL_DIR
        files = {}
        if cfg.model.hf_config:
            files["config.json"] = hf_model.config_file(cfg.model.hf_config)
        if self.data_dir is not None and self.data_dir.is_dir():
            files[token_files.META] = self.data_dir / token_files.META
            tokenizer = self.data_dir / token_files.TOKENIZER_DIR
            for f in sorted(tokenizer.iterdir()) if tokenizer.is_dir() else []:
                files[f"{token_files.TOKENIZER_DIR}/{f.name}"] = f
        for name, source in files.items():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            atomic.write_bytes(dest / name, source.read_bytes())

    def after_first_step(self, resumed_step: int) -> None:
        """The attempt is training: its recoveries are closed, collectives get their steady
        timeout, and the checkpointer prepares its buffers for the state as it now is."""
        self.attempt.after_first_step(resumed_step, self.log_event)
        stragglers.close_replacements(self.attempt.ledger, resumed_step, time.time(), self.log_event)
        distributed.use_steady_timeout(self.cfg.dist)
        self.checkpointer.prepare()

    def stop_gracefully(self) -> None:
        """Commit a checkpoint of this step, then leave with the retryable stop code."""
        self.checkpointer.finish(self.counters.step, save=True, stopping=True)
        code = self.cfg.resilience.stop.exit_code
        self.log_event(
            {"event": "stop", "t": time.time(), "step": self.counters.step, "exit_code": code},
            f"stop requested (SIGTERM): checkpoint of step {self.counters.step} committed; exiting with "
            f"code {code} so the job is restarted and resumes here",
        )
        raise StopRequested(self.counters.step, code)

    # -- what the run reports ---------------------------------------------------------------------

    def log_event(self, record: dict, message: str) -> None:
        """Rank 0's record of an event in ``metrics.jsonl``, and ``message`` on the log (none: none)."""
        self.metrics.event(record)
        if message:
            self.metrics.info(message)

    def log_start(self) -> None:
        cfg, info = self.cfg, self.info
        resumed = self.counters.step
        layer = self.attempt.layer
        held = footprint.gather(info.device)  # collective: what every rank's process holds now
        grown = footprint.grown()
        if grown and self.attempt.number >= 2:  # the first restart's start holds what every restart's does
            print(
                f"[resilient-fsdp] rank {info.rank} holds more than at its previous restart's start: "
                + ", ".join(f"{name} x{n}" for name, n in sorted(grown.items())),
                file=sys.stderr,
                flush=True,
            )
        if self.is_rank0:
            (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
            self.keep_model_files()
            # Steps past the one we resume from will be trained again: drop their records so the
            # step and checkpoint lines describe a single timeline. Lifecycle events stay.
            if self.metrics.path.exists():
                keep = [
                    ln for ln in self.metrics.path.read_text().splitlines() if ln.strip() and _keep_line(ln, resumed)
                ]
                self.metrics.path.write_text("".join(ln + "\n" for ln in keep))
            self.metrics.event(
                {
                    "event": "start",
                    "t": time.time(),
                    "layer": layer,
                    "attempt": self.attempt.number,
                    "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    "resumed_from_step": resumed if self.checkpointer.resumed_from else None,
                    "resumed_from_tier": (self.checkpointer.resumed_from or {}).get("tier"),
                    "world_size": info.world_size,
                    "footprint": held,
                }
            )
        model_name = cfg.model.factory or cfg.model.hf_config or f"preset {cfg.model.preset}"
        how = "" if layer == "start" else f" | restarted ({layer.replace('_', '-')})"
        # Every rank says where it runs: which pod holds which ranks, as the node ranks ordered them,
        # and how many threads its CPU work runs on (OMP_NUM_THREADS, taken when torch was loaded).
        threads = torch.get_num_threads()
        print(
            f"[resilient-fsdp] rank {info.rank} of {info.world_size}: node {os.environ.get('GROUP_RANK', '?')}, "
            f"local rank {info.local_rank}, {threads} CPU thread{'' if threads == 1 else 's'}, "
            f"host {socket.gethostname()}",
            file=sys.stderr,
            flush=True,
        )
        self.metrics.info(
            f"world size {info.world_size} ({info.device.type}, {info.backend}) | model {model_name}: "
            f"{self.num_params:,} parameters | {self.tokens_per_step:,} tokens/step | NVRx "
            f"{self.versions['nvrx_version']}, torch {self.versions['torch_version']} | "
            f"config {self.run_dir / 'config.yaml'}{how}"
        )

    def log_learned(self, timeouts: Optional[dict]) -> None:
        if timeouts:
            self.log_event(
                {"event": "timeouts_learned", "t": time.time(), "step": self.counters.step, **timeouts},
                f"hang-detection timeouts learned from observed durations: {timeouts}",
            )

    def s3_summary(self) -> Optional[dict]:
        s3 = self.cfg.checkpoint.s3
        if not s3.uri:
            return None
        status = self.checkpointer.uploader.summary() if self.checkpointer.uploader else {"uri": s3.uri}
        return {**status, "restored_from": self.checkpointer.restored_from_s3}

    def close(self, failed: bool) -> None:
        """Stop the checkpoint worker (an engine owned by the process is drained instead, when an
        in-process restart will reuse it)."""
        self.attempt.close()
        self.stragglers.close()
        with self.attempt.draining():
            self.checkpointer.close(abort=failed, drain=self.attempt.retried_in_process)
            self.metrics.close()
            if self.owns_resources:
                self.resources.close(failed)

    def finish(self) -> dict:
        """The run's summary (the same on every rank); rank 0 hands it to the process, which
        writes ``summary.json`` once its uploads are done (:meth:`.ProcessResources.close`)."""
        with self.attempt.draining():
            digest = params_sha256(self.model)  # collective: every rank takes part
        wall = time.perf_counter() - self.t_start
        productive = sum(self.step_times)
        ckpt = self.checkpointer
        summary = {
            "final_step": self.counters.step,
            "final_loss": self.last_loss,
            "params_sha256": digest,
            "wall_s": wall,
            "world_size": self.info.world_size,
            "device": self.info.device.type,
            "backend": self.info.backend,
            "num_params": self.num_params,
            "tokens_seen": self.counters.tokens_seen,
            "global_batch": self.global_batch,
            "global_batch_target": self.global_batch_target,
            "steps_this_run": len(self.step_times),
            "tokens_per_s": self.tokens_per_step * len(self.step_times) / productive if productive else 0.0,
            "resumed_from_step": (ckpt.resumed_from or {}).get("step"),
            "checkpoints": ckpt.records,
            "checkpoint_stall_s": sum(r["stall_s"] for r in ckpt.records),
            "hang_timeouts": self.resources.monitor.timeouts(),
            "straggler_detection": self.stragglers.summary(self.step_times),
            "replica_checks": self.replica_check.summary(),
            **self.versions,
        }
        if self.is_rank0:
            ckpt.settle()
            summary["s3"] = self.s3_summary()  # completed after the uploads (ProcessResources.close)
            self.metrics.event({"event": "finish", "t": time.time(), "step": self.counters.step})
            self.metrics.close()
            summary.update(accounting.summarize(self.metrics.path, self.attempt.ledger))
            path = self.resources.keep_summary(self.run_dir / "summary.json", summary)
            self.metrics.info(
                f"done: step {summary['final_step']} | final loss {summary['final_loss']:.4f} | "
                f"{summary['tokens_per_s']:,.0f} tok/s | wall {wall:.1f} s | goodput "
                f"{summary['goodput']:.3f} | params_sha256 {digest[:16]}… | summary {path}"
            )
        self.metrics.close()
        return summary


def _keep_line(line: str, resumed_step: int) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False  # torn by a crash mid-write
    if record.get("event") in ("step", "checkpoint"):
        return int(record["step"]) <= resumed_step
    return True
