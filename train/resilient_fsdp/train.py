"""The trainer every pod runs: ``python -m resilient_fsdp.train [--config FILE] [--set k=v]...``.

Launched by ``ft_launcher`` (or ``torchrun``) once per rank; without a launcher it is a world of
one. The :class:`Trainer` is a thin composition root, built in a fixed order: device -> process
group -> mesh -> model on ``meta`` -> activation checkpointing -> ``fully_shard`` per block, then
the root -> ``to_empty`` + init -> optimizer / LR schedule -> checkpointer (which may resume).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from . import atomic, distributed, parallelize
from .resilience import accounting
from .checkpoint.checkpointer import Checkpointer
from .checkpoint.engines import Engine, build_engine
from .checkpoint.state import CheckpointState
from .config import Config, ConfigError, describe, dump_yaml, load_config, parse_faults
from .resilience.faults import FaultInjector, FaultLedger
from .resilience.graceful_stop import GracefulStop, StopRequested
from .resilience.inprocess import InProcessAttempt, run_in_process
from .resilience.rank_monitor import ProgressMonitor
from .data import BatchLoader, build_dataset
from .factories import call_factory
from .metrics import MetricsLog, params_sha256
from .model import build_model, count_params, preset_args
from .checkpoint import store as checkpoint_store
from .checkpoint.s3.uploader import Uploader

@dataclass
class TrainState:
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


class ProcessResources:
    """What outlives an in-process restart: the checkpoint engine (its writer process and staging
    buffers), rank 0's S3 uploader (its backlog), the link to ``ft_launcher``'s rank monitor, and
    the SIGTERM flag. Re-creating the first would cost a process spawn per restart, the second
    would drop uploads; the others belong to the process, not to an attempt."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.engine: Optional[Engine] = None
        self.uploader: Optional[Uploader] = None
        self.summary_path: Optional[Path] = None  # written by this process (rank 0)
        self.monitor = ProgressMonitor(cfg.resilience)
        self.stop = GracefulStop()
        self.stop.install()

    def checkpoint_engine(self, rank: int) -> Engine:
        if self.engine is None:
            # The launcher signals a node's ranks by process group, which includes the writer
            # processes NVRx spawns. They must outlive a SIGTERM long enough for the graceful
            # stop's final checkpoint: started with SIGTERM ignored (kept across exec), they are
            # ended by the engine's close instead.
            previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                self.engine = build_engine(self.cfg.checkpoint.mode, rank, self.cfg.checkpoint.writer_threads)
            finally:
                signal.signal(signal.SIGTERM, previous)
        return self.engine

    def s3_uploader(self, rank: int) -> Optional[Uploader]:
        """Rank 0's uploader (one rank, so no file is uploaded twice); None on other ranks or
        without ``checkpoint.s3.uri``."""
        s3 = self.cfg.checkpoint.s3
        if rank != 0 or not s3.uri or not s3.upload:
            return None
        if self.uploader is None:
            self.uploader = Uploader(s3)
        return self.uploader

    def close(self, failed: bool) -> None:
        if self.engine is not None:
            self.engine.close(abort=failed)
            self.engine = None
        # Before the uploads drain: a rank monitor would take a long drain for a hang.
        self.monitor.close()
        if self.uploader is not None:
            self.finish_uploads(failed)
        self.stop.uninstall()

    def finish_uploads(self, failed: bool) -> None:
        """Rank 0, after the process group is gone (no peer waits in a collective meanwhile): give
        pending uploads ``checkpoint.s3.drain_timeout_s`` unless the attempt failed (then the
        restarted one uploads them), report, and put the outcome into ``summary.json``.

        A SIGTERM during the wait ends it (the pod is going away; the next run uploads the rest).
        """
        uploader, self.uploader = self.uploader, None
        s3, ckpt = self.cfg.checkpoint.s3, self.cfg.checkpoint
        log = MetricsLog(Path(self.cfg.run_dir), True, self.cfg.train.log_every)
        try:
            pending = uploader.pending()
            if pending and not failed:
                log.info(f"waiting up to {s3.drain_timeout_s:g} s for the S3 upload of step(s) "
                         f"{', '.join(map(str, pending))} (checkpoint.s3.drain_timeout_s)")
                deadline, stopping = time.monotonic() + s3.drain_timeout_s, self.stop.requested
                # In slices, so errors show in the log as they happen and a SIGTERM is noticed.
                while not uploader.drain(min(1.0, max(0.0, deadline - time.monotonic()))):
                    report_s3_events(log, uploader)
                    if time.monotonic() >= deadline:
                        break
                    if self.stop.requested and not stopping:
                        log.info("SIGTERM received while waiting for S3 uploads: not waiting any longer")
                        break
            uploader.close()
            report_s3_events(log, uploader)
            # Checkpoints kept only for their upload can go now (an abandoned one stays held).
            checkpoint_store.apply_retention(self.cfg.checkpoint_dir, ckpt.keep_last, held=uploader.holds)
            status = uploader.summary()
            if status["pending"]:
                log.info(f"warning: step(s) {', '.join(map(str, status['pending']))} not uploaded to {s3.uri} "
                         f"(last error: {status['last_error']}); the next run with this checkpoint.dir uploads them")
            if self.summary_path is not None and self.summary_path.exists():
                summary = json.loads(self.summary_path.read_text())
                summary["s3"] = {**(summary.get("s3") or {}), **status}
                atomic.write_json(self.summary_path, summary)
        finally:
            log.close()


class Trainer:
    cfg: Config
    info: distributed.DistInfo
    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR
    data: BatchLoader
    state: TrainState
    metrics: MetricsLog
    checkpointer: Checkpointer

    def __init__(self, cfg: Config, resources: Optional[ProcessResources] = None,
                 in_process: Optional[InProcessAttempt] = None):
        # Without resources from the caller (benchmarks, probes) the trainer owns its own.
        self.owns_resources = resources is None
        resources = resources or ProcessResources(cfg)
        self.cfg, self.resources = cfg, resources
        self.attempt = in_process.number if in_process else 0
        self.ping = in_process.ping if in_process else (lambda: None)
        self.monitor = resources.monitor
        self.monitor.reset()
        self.monitor.start("init")
        self.t_start = time.perf_counter()
        self.run_dir = Path(cfg.run_dir)
        if cfg.train.deterministic:
            # Must be set before the first cuBLAS call for deterministic GEMMs on GPUs.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # 1. Device and process group; backend follows the device.
        self.info = distributed.init_distributed(cfg.dist, in_process.store if in_process else None)
        self.is_rank0 = self.info.rank == 0
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ledger = FaultLedger(self.run_dir)
        self.injector = FaultInjector(parse_faults(cfg.resilience.inject, self.info.world_size), self.info.rank,
                                      self.ledger)
        self.layer = accounting.detect_layer(self.run_dir / "metrics.jsonl", self.attempt, self.info.rank, self.info.device)
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
            parallelize.apply_ac(self.model)
        parallelize.apply_fsdp(self.model, mesh, self.info.device)
        parallelize.materialize(self.model, self.info.device, cfg.seed)
        self.num_params = count_params(self.model)
        # 4. Optimizer and schedule. foreach=False keeps CPU numerics independent of grouping.
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay, foreach=self.info.device.type == "cuda")
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.state = TrainState()
        # 5. Checkpointer: everything a resumed run needs, and what it must match.
        training_state = CheckpointState(self.model, self.optimizer, self.lr_scheduler, self.state, self.data,
                                       self.info.rank, resilience=self.monitor)
        identity = {"model": cfg.model.factory or cfg.model.preset, "num_params": self.num_params,
                    "shape_digest": training_state.shape_digest()}
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.checkpoint_dir, self.info, training_state, identity,
                                         self.metrics.info,
                                         engine_factory=lambda: resources.checkpoint_engine(self.info.rank),
                                         uploader=resources.s3_uploader(self.info.rank))
        self.checkpointer.preflight()
        self.tokens_per_step = (self.info.world_size * cfg.train.grad_accum_steps * cfg.data.micro_batch_size
                                * cfg.data.seq_len)
        self.step_times: list[float] = []
        self.last_loss = float("nan")

    def log_start(self) -> None:
        cfg, info = self.cfg, self.info
        resumed = self.state.step
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
            f"{self.num_params:,} parameters | {self.tokens_per_step:,} tokens/step | "
            f"config {self.run_dir / 'config.yaml'}{how}")

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
        (loss / self.cfg.train.grad_accum_steps).backward()
        return loss.detach()

    def train_step(self) -> tuple[float, bool]:
        """One optimizer step over ``grad_accum_steps`` micro-batches.

        Returns the global mean loss and whether any rank was asked to stop (SIGTERM): the flag
        rides on the loss all-reduce, so agreeing on it costs no extra collective.
        """
        accum = self.cfg.train.grad_accum_steps
        local_loss = torch.zeros((), device=self.info.device)
        for micro in range(accum):
            # Reduce-scatter gradients only after the last micro-batch.
            self.model.set_requires_gradient_sync(micro == accum - 1)
            inputs, targets = self.data.next_batch(self.info.device)
            local_loss += self.forward_backward(inputs, targets)
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        stop = torch.tensor(1.0 if self.resources.stop.requested else 0.0, device=self.info.device)
        # gloo has no AVG reduction: sum and divide.
        reduced = torch.stack([local_loss, stop])
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        return reduced[0].item() / (accum * self.info.world_size), reduced[1].item() > 0

    def train(self) -> dict:
        self.checkpointer.resume()
        self.log_start()
        self.monitor.end("init")
        self.model.train()
        ckpt, monitor = self.checkpointer, self.monitor
        resumed_step = self.state.step
        last = min(self.cfg.train.steps, self.cfg.train.stop_at_step or self.cfg.train.steps)
        while self.state.step < last:
            monitor.start("step")
            self.injector.at_step_start(self.state.step + 1, self.state.step)
            t0 = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]
            loss, stop = self.train_step()
            step_time = time.perf_counter() - t0
            monitor.end("step")
            self.ping()
            self.state.step += 1
            self.state.tokens_seen += self.tokens_per_step
            self.step_times.append(step_time)
            self.last_loss = loss
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {self.state.step}; lower optim.lr or check the data")
            # Finalize a background write that finished, then start one if due. Both are collective.
            monitor.start("checkpoint")
            t_ckpt = time.perf_counter()
            self.log_checkpoint(ckpt.poll())
            if ckpt.due(self.state.step):
                self.log_checkpoint(ckpt.save(self.state.step))
            monitor.end("checkpoint")
            self.report_s3()
            self.injector.after_checkpoint(self.state.step, ckpt.pending is not None)
            self.metrics.step({"event": "step", "step": self.state.step, "loss": loss, "step_time_s": step_time,
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
        if self.cfg.checkpoint.save_final and ckpt.last_saved_step != self.state.step:
            self.log_checkpoint(ckpt.save(self.state.step))
        self.log_checkpoint(ckpt.wait())
        return self.finish()

    def stop_gracefully(self) -> None:
        """Commit a checkpoint of this step, then leave with the retryable stop code."""
        ckpt = self.checkpointer
        self.monitor.start("checkpoint")
        if ckpt.last_saved_step != self.state.step:
            self.log_checkpoint(ckpt.save(self.state.step))
        self.log_checkpoint(ckpt.wait())
        self.monitor.end("checkpoint")
        code = self.cfg.resilience.stop_exit_code
        self.metrics.info(f"stop requested (SIGTERM): checkpoint of step {self.state.step} committed; exiting with "
                          f"code {code} so the job is restarted and resumes here")
        self.metrics.event({"event": "stop", "t": time.time(), "step": self.state.step, "exit_code": code})
        raise StopRequested(self.state.step, code)

    def log_recoveries(self, resumed_step: int) -> None:
        for recovery in accounting.record_recoveries(self.ledger, self.layer, resumed_step, time.time()):
            self.metrics.event({"event": "recovery", "t": time.time(), **recovery})
            self.metrics.info(f"recovered from {recovery['fault']} by {recovery['layer'].replace('_', '-')} restart "
                              f"in {recovery['recovery_s']:.2f} s; {recovery['lost_steps']} step(s) trained again")

    def log_learned(self, timeouts: Optional[dict]) -> None:
        if timeouts:
            self.metrics.event({"event": "timeouts_learned", "t": time.time(), "step": self.state.step, **timeouts})
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
        """Stop the checkpoint worker (an engine owned by the process is drained instead)."""
        self.checkpointer.close(abort=failed)
        self.metrics.close()
        if self.owns_resources:
            self.resources.close(failed)

    def finish(self) -> dict:
        digest = params_sha256(self.model)  # collective: every rank takes part
        wall = time.perf_counter() - self.t_start
        productive = sum(self.step_times)
        summary = {
            "final_step": self.state.step,
            "final_loss": self.last_loss,
            "params_sha256": digest,
            "wall_s": wall,
            "world_size": self.info.world_size,
            "device": self.info.device.type,
            "backend": self.info.backend,
            "num_params": self.num_params,
            "tokens_seen": self.state.tokens_seen,
            "steps_this_run": len(self.step_times),
            "tokens_per_s": self.tokens_per_step * len(self.step_times) / productive if productive else 0.0,
            "resumed_from_step": (self.checkpointer.resumed_from or {}).get("step"),
            "checkpoints": self.checkpointer.records,
            "checkpoint_stall_s": sum(r["stall_s"] for r in self.checkpointer.records),
            "hang_timeouts": self.monitor.timeouts(),
        }
        if self.is_rank0:
            self.report_s3()
            # Uploads still pending now are waited for after the process group is gone, and
            # this entry is then updated (ProcessResources.finish_uploads).
            summary["s3"] = self.s3_summary()
            self.resources.summary_path = self.run_dir / "summary.json"
            self.metrics.event({"event": "finish", "t": time.time(), "step": self.state.step})
            self.metrics.close()
            summary.update(accounting.summarize(self.metrics.path, self.ledger))
            atomic.write_json(self.run_dir / "summary.json", summary)
            self.metrics.info(f"done: step {summary['final_step']} | final loss {summary['final_loss']:.4f} | "
                              f"{summary['tokens_per_s']:,.0f} tok/s | wall {wall:.1f} s | goodput "
                              f"{summary['goodput']:.3f} | params_sha256 {digest[:16]}… | summary "
                              f"{self.run_dir / 'summary.json'}")
        self.metrics.close()
        return summary


def report_s3_events(metrics: MetricsLog, uploader: Uploader) -> None:
    for event, message in uploader.take_events():
        metrics.event(event)
        metrics.info(message)


def _keep_line(line: str, resumed_step: int) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False  # torn by a crash mid-write
    if record.get("event") in ("step", "checkpoint"):
        return int(record["step"]) <= resumed_step
    return True


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m resilient_fsdp.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="YAML configuration file (overrides the defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key, e.g. --set train.steps=50 (repeatable; applied last)")
    p.add_argument("--run-dir", help="shorthand for --set run_dir=DIR")
    p.add_argument("--inject", action="append", default=[], metavar="KIND@STEP[:rank=R]",
                   help="inject a fault once per job (repeatable; adds to resilience.inject)")
    p.add_argument("--describe-config", action="store_true", help="print every config key and exit")
    return p.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    cfg = load_config(args.config, overrides)
    if args.inject:
        parse_faults(args.inject)  # names the bad --inject value
        cfg.resilience.inject = list(cfg.resilience.inject) + list(args.inject)
    return cfg


def attempt(cfg: Config, resources: ProcessResources, in_process: Optional[InProcessAttempt] = None) -> dict:
    """One attempt at the training function: build everything, resume, train. In-process restart
    calls it again after a fault; the process group and model are rebuilt each time."""
    trainer = None
    failed = True
    try:
        trainer = Trainer(cfg, resources, in_process)
        summary = trainer.train()
        failed = False
        return summary
    except StopRequested:
        failed = False  # a clean, checkpointed stop: tear down in order
        raise
    finally:
        if trainer is not None:
            trainer.close(failed)
        distributed.shutdown(clean=not failed)


def run(args: argparse.Namespace) -> dict:
    cfg = resolve_config(args)
    resources = ProcessResources(cfg)
    failed = True
    try:
        if cfg.resilience.in_process:
            summary = run_in_process(cfg.resilience, lambda in_process: attempt(cfg, resources, in_process))
        else:
            summary = attempt(cfg, resources)
        failed = False
        return summary
    except StopRequested:
        failed = False
        raise
    finally:
        resources.close(failed)


@record
def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.describe_config:
        print(describe(), end="")
        return 0
    try:
        run(args)
    except ConfigError as exc:
        # Recorded for the launcher's root-cause report, then a clean message and a fail-fast code.
        get_error_handler().record_exception(exc)
        rank = os.environ.get("RANK", "0")
        print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return ConfigError.exit_code
    except StopRequested as stop:
        return stop.exit_code
    finally:
        stop_helper_processes()
    return 0


def stop_helper_processes() -> None:
    """End multiprocessing helpers still running when the rank exits (the manager NVRx's writer
    reports through, helpers left by in-process restarts): the interpreter would wait for them
    at exit. The checkpoint writer itself was closed before; these hold no data. They were
    started with SIGTERM ignored (see :class:`ProcessResources`), hence SIGKILL."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=2)


if __name__ == "__main__":
    sys.exit(main())
