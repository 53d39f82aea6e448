"""The trainer in real processes (gloo on CPU): learning, determinism, options and custom parts."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from resilient_fsdp.train.data import TokenFile
from tests.support import (
    assert_no_leftovers,
    read_events,
    read_losses,
    read_summary,
    run_local,
    run_trainer,
    write_module,
)

STEPS = 40


@pytest.fixture(scope="module")
def twin_runs(tmp_path_factory):
    """The same job twice: 1 node x 2 ranks, tiny preset, fixed seed."""
    runs = []
    for name in ("a", "b"):
        run_dir = tmp_path_factory.mktemp(f"twin-{name}")
        proc = run_local(run_dir, nodes=1, nproc=2, overrides=[f"train.steps={STEPS}", "seed=11"])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert_no_leftovers(run_dir)
        runs.append(run_dir)
    return runs


def test_loss_goes_down_on_tiny(twin_runs):
    losses = read_losses(twin_runs[0])
    assert len(losses) == STEPS
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


def test_two_identical_runs_are_bitwise_equal(twin_runs):
    a, b = (read_summary(r) for r in twin_runs)
    assert read_losses(twin_runs[0]) == read_losses(twin_runs[1])  # exact float equality
    assert a["params_sha256"] == b["params_sha256"]


def test_run_dir_holds_resolved_config_metrics_and_summary(twin_runs):
    run_dir = twin_runs[0]
    summary = read_summary(run_dir)
    assert summary["final_step"] == STEPS and summary["world_size"] == 2
    assert summary["final_loss"] == read_losses(run_dir)[-1]
    assert len(summary["params_sha256"]) == 64 and summary["wall_s"] > 0
    records = read_events(run_dir, "step")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["tokens"] == 2 * 4 * 64 and r["step_time_s"] > 0 for r in records)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["train"]["steps"] == STEPS and config["seed"] == 11
    # The pod's own view of the run directory: /fsx inside its mount namespace (netns pods), the
    # path on this machine where pods share its filesystem (loopback).
    from resilient_fsdp.local.runtime.netns_pods.plumbing import available

    assert config["run_dir"] == ("/fsx" if available()[0] else str(run_dir))


def test_different_seed_gives_different_parameters(twin_runs, tmp_path):
    proc = run_trainer(tmp_path, [f"train.steps=2", "seed=12"])
    assert proc.returncode == 0, proc.stderr
    ref = run_trainer(tmp_path / "ref", [f"train.steps=2", "seed=11"])
    assert ref.returncode == 0, ref.stderr
    assert read_summary(tmp_path)["params_sha256"] != read_summary(tmp_path / "ref")["params_sha256"]


def test_activation_checkpointing_and_grad_accumulation_keep_the_numbers(tmp_path):
    base = ["train.steps=6", "data.micro_batch_size=4"]
    plain = run_trainer(tmp_path / "plain", base)
    ac = run_trainer(tmp_path / "ac", base + ["model.activation_checkpointing=true"])
    assert plain.returncode == 0 and ac.returncode == 0, plain.stderr + ac.stderr
    # Recomputation repeats the same kernels: the numbers must not move.
    assert read_losses(tmp_path / "ac") == read_losses(tmp_path / "plain")
    assert read_summary(tmp_path / "ac")["params_sha256"] == read_summary(tmp_path / "plain")["params_sha256"]
    accum = run_trainer(tmp_path / "accum", ["train.steps=6", "data.micro_batch_size=2", "train.grad_accum_steps=2"])
    assert accum.returncode == 0, accum.stderr
    # Same samples per step, summed in two halves: equal up to float rounding, not bitwise.
    assert np.allclose(read_losses(tmp_path / "accum"), read_losses(tmp_path / "plain"), rtol=1e-4)


def test_memory_mapped_token_file(tmp_path):
    """A flat .bin without data prepare's metadata is read as data.token_dtype, in windows of
    seq_len + 1 that share their boundary token (jobs train on prepared data in tests/data, tests/hf)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "tokens.bin"
    tokens = rng.integers(0, 300, size=20_000, dtype=np.uint32)
    tokens.tofile(path)
    ds = TokenFile(path, "uint32", seq_len=64, vocab_size=300)
    assert len(ds) == (20_000 - 1) // 64 and ds.meta is None
    assert ds[3].tolist() == tokens[192:257].tolist() and ds[3][0] == ds[2][-1]


@pytest.mark.extended  # the same path as images/custom-model's local run (tests/deploy), another model
def test_custom_model_factory_is_used(tmp_path, plugin_dir):
    write_module(
        plugin_dir,
        "tiny_mlp_lm",
        """
        import torch
        from torch import nn

        class MlpLM(nn.Module):
            def __init__(self, vocab):
                super().__init__()
                self.emb = nn.Embedding(vocab, 32)
                self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(2))
                self.head = nn.Linear(32, vocab)

            def forward(self, tokens):
                h = self.emb(tokens)
                for layer in self.layers:
                    h = h + layer(h)
                return self.head(h)

        def build(cfg):
            assert torch.empty(1).is_meta, "factories are called under the meta device"
            return MlpLM(cfg.vocab_size or 256)
    """,
    )
    run_dir = tmp_path / "run"
    proc = run_local(
        run_dir,
        nodes=1,
        nproc=2,
        pythonpath=[plugin_dir],
        overrides=["train.steps=4", "model.factory=tiny_mlp_lm:build"],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = read_summary(run_dir)
    assert summary["num_params"] == 256 * 32 + 2 * (32 * 32 + 32) + 32 * 256 + 256
    assert "model tiny_mlp_lm:build" in proc.stdout
    assert_no_leftovers(run_dir)


def test_config_error_in_the_trainer_exits_2_naming_the_key(tmp_path):
    proc = run_trainer(tmp_path, ["model.factory=no_such_module:build"])
    assert proc.returncode == 2
    assert "model.factory='no_such_module:build': cannot import module 'no_such_module'" in proc.stderr
    assert "Traceback" not in proc.stderr
