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

from . import distributed, parallelize
from .checkpoint import Checkpointer, TrainingState
from .config import Config, ConfigError, describe, dump_yaml, load_config
from .data import BatchLoader, build_dataset
from .factories import call_factory
from .metrics import MetricsLog, params_sha256, write_json_atomic
from .model import build_model, count_params, preset_args

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

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.t_start = time.perf_counter()
        self.run_dir = Path(cfg.run_dir)
        if cfg.train.deterministic:
            # Must be set before the first cuBLAS call for deterministic GEMMs on GPUs.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # 1. Device and process group; backend follows the device.
        self.info = distributed.init_distributed(cfg.dist)
        self.is_rank0 = self.info.rank == 0
        if cfg.train.deterministic:
            # On CUDA a few kernels lack deterministic versions: warn rather than refuse.
            torch.use_deterministic_algorithms(True, warn_only=self.info.device.type == "cuda")
        self.run_dir.mkdir(parents=True, exist_ok=True)
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
        training_state = TrainingState(self.model, self.optimizer, self.lr_scheduler, self.state, self.data,
                                       self.info.rank)
        identity = {"model": cfg.model.factory or cfg.model.preset, "num_params": self.num_params,
                    "shape_digest": training_state.shape_digest()}
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.checkpoint_dir, self.info, training_state, identity,
                                         self.metrics.info)
        self.checkpointer.preflight()
        self.tokens_per_step = (self.info.world_size * cfg.train.grad_accum_steps * cfg.data.micro_batch_size
                                * cfg.data.seq_len)
        self.step_times: list[float] = []
        self.last_loss = float("nan")

    def log_start(self) -> None:
        cfg, info = self.cfg, self.info
        if self.is_rank0:
            (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
            # Steps past the one we start from will be trained again: drop their records so
            # metrics.jsonl describes a single timeline.
            if self.metrics.path.exists():
                keep = [ln for ln in self.metrics.path.read_text().splitlines()
                        if ln.strip() and int(_json_step(ln)) <= self.state.step]
                self.metrics.path.write_text("".join(ln + "\n" for ln in keep))
        model_name = cfg.model.factory or f"preset {cfg.model.preset}"
        self.metrics.info(
            f"world size {info.world_size} ({info.device.type}, {info.backend}) | model {model_name}: "
            f"{self.num_params:,} parameters | {self.tokens_per_step:,} tokens/step | "
            f"config {self.run_dir / 'config.yaml'}")

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
        (loss / self.cfg.train.grad_accum_steps).backward()
        return loss.detach()

    def train_step(self) -> float:
        """One optimizer step over ``grad_accum_steps`` micro-batches; returns the global mean loss."""
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
        # gloo has no AVG reduction: sum and divide.
        dist.all_reduce(local_loss, op=dist.ReduceOp.SUM)
        return local_loss.item() / (accum * self.info.world_size)

    def train(self) -> dict:
        self.checkpointer.resume()
        self.log_start()
        self.model.train()
        ckpt = self.checkpointer
        last = min(self.cfg.train.steps, self.cfg.train.stop_at_step or self.cfg.train.steps)
        while self.state.step < last:
            t0 = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]
            loss = self.train_step()
            step_time = time.perf_counter() - t0
            self.state.step += 1
            self.state.tokens_seen += self.tokens_per_step
            self.step_times.append(step_time)
            self.last_loss = loss
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {self.state.step}; lower optim.lr or check the data")
            # Finalize a background write that finished, then start one if due. Both are collective.
            t_ckpt = time.perf_counter()
            self.log_checkpoint(ckpt.poll())
            if ckpt.due(self.state.step):
                self.log_checkpoint(ckpt.save(self.state.step))
            self.metrics.step({"event": "step", "step": self.state.step, "loss": loss, "step_time_s": step_time,
                               "ckpt_s": time.perf_counter() - t_ckpt, "tokens": self.tokens_per_step, "lr": lr})
        if self.cfg.checkpoint.save_final and ckpt.last_saved_step != self.state.step:
            self.log_checkpoint(ckpt.save(self.state.step))
        self.log_checkpoint(ckpt.wait())
        return self.finish()

    def log_checkpoint(self, record: Optional[dict]) -> None:
        if record is None:
            return
        self.metrics.event({"event": "checkpoint", **record})
        self.metrics.info(f"checkpoint step {record['step']} committed ({record['mode']}): stall "
                          f"{record['stall_s'] * 1000:.1f} ms, write {record['write_s']:.2f} s, "
                          f"{record['bytes'] / 1e6:.1f} MB -> {record['path']}")

    def close(self, failed: bool) -> None:
        """Stop the checkpoint worker; after a failure, without waiting for it."""
        self.checkpointer.close(abort=failed)

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
        }
        if self.is_rank0:
            write_json_atomic(self.run_dir / "summary.json", summary)
            self.metrics.info(f"done: step {summary['final_step']} | final loss {summary['final_loss']:.4f} | "
                              f"{summary['tokens_per_s']:,.0f} tok/s | wall {wall:.1f} s | "
                              f"params_sha256 {digest[:16]}… | summary {self.run_dir / 'summary.json'}")
        self.metrics.close()
        return summary


def _json_step(line: str) -> int:
    return json.loads(line)["step"]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m resilient_fsdp.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="YAML configuration file (overrides the defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key, e.g. --set train.steps=50 (repeatable; applied last)")
    p.add_argument("--run-dir", help="shorthand for --set run_dir=DIR")
    p.add_argument("--describe-config", action="store_true", help="print every config key and exit")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    overrides = list(args.overrides) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    cfg = load_config(args.config, overrides)
    trainer = Trainer(cfg)
    failed = True
    try:
        summary = trainer.train()
        failed = False
        return summary
    finally:
        trainer.close(failed)
        distributed.shutdown(clean=not failed)


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
