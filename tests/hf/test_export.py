"""The path after the demo, end to end: text and a tokenizer -> ``data prepare`` -> a 2-pod local
job -> ``checkpoints export`` -> a directory ``transformers`` loads, whose loss on the prepared
tokens is below the first step's. Then the operator's view of the same run directory, with no S3:
``list``, and ``verify`` (and ``push``, ``export``) naming a truncated shard."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from resilient_fsdp.checkpoint import store
from resilient_fsdp.cli import main as cli_main
from tests.data.corpus import documents, train_tokenizer, write_jsonl
from tests.support import assert_no_leftovers, read_losses, run_local

STEPS = 30
SEQ = 64


def cli(*args: str) -> subprocess.CompletedProcess:
    """The command in this process (``resilient-fsdp data prepare`` runs as a process of its own in
    ``tests/data``): its exit status and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run directory trained on prepared text by 2 pods, its data under the shared volume (/fsx)."""
    root = tmp_path_factory.mktemp("text-run")
    docs = documents(300)
    text, tokenizer = write_jsonl(root / "in/text.jsonl", docs), train_tokenizer(root / "in/tokenizer.json", docs)
    run_dir = root / "run"
    out = cli(
        "data", "prepare", "--input", str(text), "--tokenizer", str(tokenizer), "--out", str(run_dir / "data/text")
    )
    assert out.returncode == 0, out.stderr
    job = run_local(
        run_dir,
        nodes=2,
        nproc=1,
        overrides=[
            "data.source=tokens",
            "data.path=/fsx/data/text",
            "model.vocab_size=300",
            f"data.seq_len={SEQ}",
            f"train.steps={STEPS}",
            "checkpoint.interval_steps=15",
        ],
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert_no_leftovers(run_dir)
    return run_dir


def test_the_exported_model_loads_in_transformers_and_learned_the_text(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = cli("checkpoints", "export", "--run-dir", str(trained), "--out", str(tmp_path / "model"))
    assert out.returncode == 0, out.stderr
    assert f"exported step {STEPS}: 21 tensors" in out.stdout and "config.json, tokenizer.json" in out.stdout
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "model", output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # no missing, unexpected or mismatched keys
    assert type(model).__name__ == "LlamaForCausalLM"
    tokens = np.fromfile(trained / "data/text/tokens.bin", dtype=np.uint16).astype(np.int64)
    windows = torch.from_numpy(tokens[: 8 * SEQ + 1]).unfold(0, SEQ + 1, SEQ)[:8]
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    first = read_losses(trained)[0]
    assert loss < 0.6 * first, (loss, first)
    # The tokenizer the data was prepared with travels with the model.
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    meta = json.loads((trained / "data/text/tokens.json").read_text())
    assert tokenizer.convert_tokens_to_ids("</s>") == meta["eos_id"]
    # An existing directory is never replaced.
    again = cli("checkpoints", "export", "--run-dir", str(trained), "--out", str(tmp_path / "model"))
    assert again.returncode == 2 and "exists and is not empty" in again.stderr


def test_list_and_verify_read_a_run_directory_without_s3(trained):
    listed = cli("checkpoints", "list", "--run-dir", str(trained))
    assert listed.returncode == 0, listed.stderr
    assert "step_" not in listed.stderr and f"local: {trained / 'checkpoints'}" in listed.stdout
    rows = [line.split() for line in listed.stdout.splitlines() if line.strip().split()[0].isdigit()]
    assert [(r[0], r[1], r[6]) for r in rows] == [("15", "committed", "2"), (str(STEPS), "committed", "2")]
    for action in ("list", "verify", "export"):  # a mistyped run directory is a usage error, not "no checkpoint"
        wrong = cli(
            "checkpoints", action, "--run-dir", str(trained) + "-typo", *(["--out", "x"] if action == "export" else [])
        )
        assert wrong.returncode == 2 and f"--run-dir {trained}-typo: no such directory" in wrong.stderr, action
    verified = cli("checkpoints", "verify", "--run-dir", str(trained))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "step 15: ok" in verified.stdout and f"step {STEPS}: ok" in verified.stdout


def test_verify_push_and_export_name_a_truncated_shard(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained / "checkpoints", copy / "checkpoints")
    shutil.copy(trained / "config.yaml", copy / "config.yaml")
    newest = copy / "checkpoints" / store.committed_name(STEPS)
    shard = sorted(newest.glob("*.distcp"))[1]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    out = cli("checkpoints", "verify", "--run-dir", str(copy))
    assert out.returncode == 1
    assert f"step {STEPS}: DAMAGED" in out.stdout and "step 15: ok" in out.stdout
    assert f"{shard}: {size // 2} bytes, the manifest says {size}" in out.stdout
    push = cli("checkpoints", "push", "--run-dir", str(copy), "--uri", "s3://never-contacted/run")
    assert push.returncode == 1
    assert f"step {STEPS} is damaged on the local volume, nothing pushed: {shard}: {size // 2} bytes" in push.stderr
    export = cli("checkpoints", "export", "--run-dir", str(copy), "--out", str(tmp_path / "model"))
    assert export.returncode == 1 and f"nothing exported: {shard}" in export.stderr
    assert not (tmp_path / "model").exists()
    older = cli("checkpoints", "export", "--run-dir", str(copy), "--step", "15", "--out", str(tmp_path / "model"))
    assert older.returncode == 0 and "exported step 15" in older.stdout
