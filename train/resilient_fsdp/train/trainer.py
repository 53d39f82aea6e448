"""The trainer every rank runs: a thin composition root and the training loop.

:class:`Trainer` is built in a fixed order: device -> process group -> mesh -> model on ``meta``
-> activation checkpointing -> ``fully_shard`` per block, then the root -> ``to_empty`` + init ->
optimizer / LR schedule -> checkpointer (which may resume). ``train()`` is the loop,
``train_step()`` one optimizer step. The process around it (arguments, in-process restart, exit
codes) is :mod:`.entrypoint`; what outlives an in-process restart is :mod:`.resources`.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import atomic
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.nvrx import NVRX_VERSION
from ..checkpoint.state import CheckpointState
from ..config import Config, dump_yaml, parse_faults
from ..resilience import accounting
from ..resilience.faults import FaultInjector, FaultLedger
from ..resilience.graceful_stop import StopRequested
from ..resilience.inprocess import InProcessAttempt
from . import distributed, parallelize
from .data import BatchLoader, build_dataset
from .factories import call_factory
from .metrics import MetricsLog, params_sha256
from .model import build_model, count_params, preset_args
from .resources import ProcessResources, report_s3_events


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
    return cfg.model.vocab_size or preset_args(cfg.model.preset).vocab_size


def build_any_model(cfg: Config) -> nn.Module:
    """The built-in transformer, or ``model.factory``'s module; always on the meta device."""
    with torch.device("meta"):
        if cfg.model.factory:
            return call_factory(cfg.model.factory, "model.factory", nn.Module, cfg.model)
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
    cfg: Config
    info: distributed.DistInfo
    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR
    data: BatchLoader
    counters: TrainCounters
    metrics: MetricsLog
    checkpointer: Checkpointer

    def __init__(self, cfg: Config, resources: Optional[ProcessResources] = None,
                 in_process: Optional[InProcessAttempt] = None):
        # Without resources from the caller (benchmarks, probes) the trainer owns its own.
        self.owns_resources = resources is None
        resources = resources or ProcessResources(cfg)
        self.cfg, self.resources = cfg, resources
        self.attempt = in_process.number if in_process else 0
        self.retried_in_process = in_process is not None  # a failed attempt is followed by another here
        self.ping = in_process.ping if in_process else (lambda: None)
        self.monitor = resources.monitor
        self.monitor.reset()
        self.monitor.start("init")
        self.t_start = time.perf_counter()
        # Wall-clock marks of this attempt, for where a recovery's time went (accounting.phases).
        self.marks = {"attempt": time.time()}
        self.run_dir = Path(cfg.run_dir)
        if cfg.train.deterministic:
            # Must be set before the first cuBLAS call for deterministic GEMMs on GPUs.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # 1. Device and process group; backend follows the device.
        self.info = distributed.init_distributed(cfg.dist, in_process.store if in_process else None)
        self.marks["group"] = time.time()
        self.is_rank0 = self.info.rank == 0
        # Python's and NumPy's generators (datasets and user code draw from them): seeded per rank,
        # so runs repeat; checkpoints save and restore them with torch's.
        random.seed(cfg.seed * 1_000_003 + self.info.rank)
        np.random.seed((cfg.seed * 1_000_003 + self.info.rank) % 2**32)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ledger = FaultLedger(self.run_dir)
        self.injector = FaultInjector(parse_faults(cfg.resilience.inject, self.info.world_size), self.info.rank,
                                      self.ledger)
        self.versions = {"nvrx_version": NVRX_VERSION, "torch_version": torch.__version__}
        self.layer = accounting.detect_layer(self.run_dir / "metrics.jsonl", self.attempt, self.info.rank,
                                             self.info.device)
        if cfg.train.deterministic:
            # On CUDA a few kernels lack deterministic versions: warn rather than refuse.
            torch.use_deterministic_algorithms(True, warn_only=self.info.device.type == "cuda")
        self.metrics = MetricsLog(self.run_dir, self.is_rank0, cfg.train.log_every)
        # 2. Data first: it validates files and factories before any parameter is allocated.
        vocab = vocab_size_of(cfg)
        dataset = build_dataset(cfg.data, vocab, cfg.seed)
        self.data = BatchLoader(dataset, cfg.data, vocab, cfg.seed, self.info.rank, self.info.world_size)
        # 3. Mesh, model on meta, AC, FSDP2 per block then root, materialise.
        mesh = distributed.build_mesh(self.info)
        self.model = build_any_model(cfg)
        if cfg.model.activation_checkpointing:
            parallelize.apply_ac(self.model, cfg.model.blocks)
        parallelize.apply_fsdp(self.model, mesh, self.info.device, cfg.model.blocks)
        parallelize.materialize(self.model, self.info.device, cfg.seed)
        self.num_params = count_params(self.model)
        # 4. Optimizer and schedule. foreach=False keeps CPU numerics independent of grouping.
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay, foreach=self.info.device.type == "cuda")
        self.marks["model"] = time.time()
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.counters = TrainCounters()
        # 5. Checkpointer: everything a resumed run needs, and what it must match.
        checkpoint_state = CheckpointState(self.model, self.optimizer, self.lr_scheduler, self.counters, self.data,
                                       self.info.rank, resilience=self.monitor)
        identity = {"model": cfg.model.factory or cfg.model.preset, "num_params": self.num_params,
                    "shape_digest": checkpoint_state.shape_digest()}
        self.grad_accum = cfg.train.grad_accum_steps  # a resume at another world size may change it
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.checkpoint_dir, self.info, checkpoint_state, identity,
                                         self.metrics.info,
                                         engine_factory=lambda: resources.checkpoint_engine(self.info.rank),
                                         uploader=resources.s3_uploader(self.info.rank, self.info.world_size),
                                         batch={"grad_accum_steps": self.grad_accum,
                                                "micro_batch_size": cfg.data.micro_batch_size},
                                         faults=self.injector)
        self.checkpointer.preflight()
        self.step_times: list[float] = []
        self.last_loss = float("nan")

    @property
    def tokens_per_step(self) -> int:
        return self.info.world_size * self.grad_accum * self.cfg.data.micro_batch_size * self.cfg.data.seq_len

    def log_start(self) -> None:
        cfg, info = self.cfg, self.info
        resumed = self.counters.step
        if self.is_rank0:
            (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
            # Steps past the one we resume from will be trained again: drop their records so the
            # step and checkpoint lines describe a single timeline. Lifecycle events stay.
            if self.metrics.path.exists():
                keep = [ln for ln in self.metrics.path.read_text().splitlines()
                        if ln.strip() and _keep_line(ln, resumed)]
                self.metrics.path.write_text("".join(ln + "\n" for ln in keep))
            self.metrics.event({"event": "start", "t": time.time(), "layer": self.layer, "attempt": self.attempt,
                                "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                "resumed_from_step": resumed if self.checkpointer.resumed_from else None,
                                "world_size": info.world_size})
        model_name = cfg.model.factory or f"preset {cfg.model.preset}"
        how = "" if self.layer == "start" else f" | restarted ({self.layer.replace('_', '-')})"
        self.metrics.info(
            f"world size {info.world_size} ({info.device.type}, {info.backend}) | model {model_name}: "
            f"{self.num_params:,} parameters | {self.tokens_per_step:,} tokens/step | NVRx "
            f"{self.versions['nvrx_version']}, torch {self.versions['torch_version']} | "
            f"config {self.run_dir / 'config.yaml'}{how}")

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs)
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
        for micro in range(accum):
            # Reduce-scatter gradients only after the last micro-batch.
            self.model.set_requires_gradient_sync(micro == accum - 1)
            inputs, targets = self.data.next_batch(self.info.device)
            local_loss += self.forward_backward(inputs, targets)
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.checkpointer.before_optimizer_step()  # a checkpoint's copy of the state must be done
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        stop = torch.tensor(1.0 if self.resources.stop.requested else 0.0, device=self.info.device)
        # gloo has no AVG reduction: sum and divide.
        reduced = torch.stack([local_loss, stop])
        self.injector.before_collective(self.counters.step + 1)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        return reduced[0].item() / (accum * self.info.world_size), reduced[1].item() > 0

    def train(self) -> dict:
        self.marks["built"] = time.time()
        self.checkpointer.resume()
        self.marks["resumed"] = time.time()
        self.grad_accum = self.checkpointer.grad_accum_steps or self.grad_accum
        self.log_start()
        self.monitor.end("init")
        self.model.train()
        ckpt, monitor = self.checkpointer, self.monitor
        resumed_step = self.counters.step
        last = min(self.cfg.train.steps, self.cfg.train.stop_at_step or self.cfg.train.steps)
        while self.counters.step < last:
            monitor.start("step")
            self.injector.at_step_start(self.counters.step + 1, self.counters.step)
            t0 = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]
            loss, stop = self.train_step()
            step_time = time.perf_counter() - t0
            monitor.end("step")
            self.ping()
            self.counters.step += 1
            self.counters.tokens_seen += self.tokens_per_step
            self.step_times.append(step_time)
            self.last_loss = loss
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {self.counters.step}; lower optim.lr or check the data")
            # Finalize a background write that finished, then start one if due. Both are collective.
            monitor.start("checkpoint")
            t_ckpt = time.perf_counter()
            committed = ckpt.poll()
            self.log_checkpoint(committed)
            saved = committed is not None  # only calls that saved or committed teach its timeout
            if ckpt.due(self.counters.step):
                if ckpt.pending is not None:
                    # The save would wait for the previous write: that wait has the drain budget.
                    monitor.end("checkpoint", learn=saved)
                    with self.draining():
                        self.log_checkpoint(ckpt.wait())
                    monitor.start("checkpoint")
                self.log_checkpoint(ckpt.save(self.counters.step))
                saved = True
            monitor.end("checkpoint", learn=saved)
            self.report_s3()
            self.metrics.step({"event": "step", "step": self.counters.step, "loss": loss, "step_time_s": step_time,
                               "ckpt_s": time.perf_counter() - t_ckpt, "tokens": self.tokens_per_step, "lr": lr,
                               "t": time.time()})
            if len(self.step_times) == 1:
                if self.layer != "start" and self.is_rank0:
                    self.log_recoveries(resumed_step)
                distributed.use_steady_timeout(self.cfg.dist)
                ckpt.prepare()
            self.log_learned(monitor.maybe_learn())
            if stop:
                self.stop_gracefully()
        with self.draining():
            if self.cfg.checkpoint.save_final and ckpt.last_saved_step != self.counters.step:
                self.log_checkpoint(ckpt.save(self.counters.step))
            self.log_checkpoint(ckpt.wait())
            return self.finish()

    def draining(self):
        """Waiting for checkpoint writes and the end of the job: the ``drain`` section, with the
        in-process watchdog pinged meanwhile (:meth:`.ProgressMonitor.draining`)."""
        return self.monitor.draining(self.ping)

    def stop_gracefully(self) -> None:
        """Commit a checkpoint of this step, then leave with the retryable stop code."""
        ckpt = self.checkpointer
        with self.draining():
            if ckpt.last_saved_step != self.counters.step:
                self.log_checkpoint(ckpt.save(self.counters.step))
            self.log_checkpoint(ckpt.wait())
        code = self.cfg.resilience.stop_exit_code
        self.metrics.info(f"stop requested (SIGTERM): checkpoint of step {self.counters.step} committed; exiting with "
                          f"code {code} so the job is restarted and resumes here")
        self.metrics.event({"event": "stop", "t": time.time(), "step": self.counters.step, "exit_code": code})
        raise StopRequested(self.counters.step, code)

    def log_recoveries(self, resumed_step: int) -> None:
        for recovery in accounting.record_recoveries(self.ledger, self.layer, resumed_step, time.time(), self.marks):
            self.metrics.event({"event": "recovery", "t": time.time(), **recovery})
            self.metrics.info(f"recovered from {recovery['fault']} by {recovery['layer'].replace('_', '-')} restart "
                              f"in {recovery['recovery_s']:.2f} s; {recovery['lost_steps']} step(s) trained again")

    def log_learned(self, timeouts: Optional[dict]) -> None:
        if timeouts:
            self.metrics.event({"event": "timeouts_learned", "t": time.time(), "step": self.counters.step, **timeouts})
            self.metrics.info(f"hang-detection timeouts learned from observed durations: {timeouts}")

    def log_checkpoint(self, record: Optional[dict]) -> None:
        if record is None:
            return
        self.metrics.event({"event": "checkpoint", "t": time.time(), **record})
        self.metrics.info(f"checkpoint step {record['step']} committed ({record['mode']}): stall "
                          f"{record['stall_s'] * 1000:.1f} ms, write {record['write_s']:.2f} s, "
                          f"{record['bytes'] / 1e6:.1f} MB -> {record['path']}")

    def report_s3(self) -> None:
        """Rank 0: log what the background uploader did since the last step."""
        if self.checkpointer.uploader is not None:
            report_s3_events(self.metrics, self.checkpointer.uploader)

    def s3_summary(self) -> Optional[dict]:
        s3 = self.cfg.checkpoint.s3
        if not s3.uri:
            return None
        status = self.checkpointer.uploader.summary() if self.checkpointer.uploader else {"uri": s3.uri}
        return {**status, "restored_from": self.checkpointer.restored_from_s3}

    def close(self, failed: bool) -> None:
        """Stop the checkpoint worker (an engine owned by the process is drained instead, when an
        in-process restart will reuse it)."""
        self.injector.close()
        with self.draining():
            self.checkpointer.close(abort=failed, drain=self.retried_in_process)
            self.metrics.close()
            if self.owns_resources:
                self.resources.close(failed)

    def finish(self) -> dict:
        digest = params_sha256(self.model)  # collective: every rank takes part
        wall = time.perf_counter() - self.t_start
        productive = sum(self.step_times)
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
            "steps_this_run": len(self.step_times),
            "tokens_per_s": self.tokens_per_step * len(self.step_times) / productive if productive else 0.0,
            "resumed_from_step": (self.checkpointer.resumed_from or {}).get("step"),
            "checkpoints": self.checkpointer.records,
            "checkpoint_stall_s": sum(r["stall_s"] for r in self.checkpointer.records),
            "hang_timeouts": self.monitor.timeouts(),
            **self.versions,
        }
        if self.is_rank0:
            self.report_s3()
            # Uploads still pending now are waited for after the process group is gone, and
            # this entry is then updated (ProcessResources.finish_uploads).
            summary["s3"] = self.s3_summary()
            self.resources.summary_path = self.run_dir / "summary.json"
            self.metrics.event({"event": "finish", "t": time.time(), "step": self.counters.step})
            self.metrics.close()
            summary.update(accounting.summarize(self.metrics.path, self.ledger))
            atomic.write_json(self.run_dir / "summary.json", summary)
            self.metrics.info(f"done: step {summary['final_step']} | final loss {summary['final_loss']:.4f} | "
                              f"{summary['tokens_per_s']:,.0f} tok/s | wall {wall:.1f} s | goodput "
                              f"{summary['goodput']:.3f} | params_sha256 {digest[:16]}… | summary "
                              f"{self.run_dir / 'summary.json'}")
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
