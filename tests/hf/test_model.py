"""A Hugging Face causal LM by its ``config.json`` (``model.hf_config``) and pretrained weights in
(``model.init_from``): built on meta, sharded per decoder layer by FSDP2, trained on 2 pods
bitwise-reproducibly through a killed rank, started from the weights ``transformers`` computes
the same first loss with."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from resilient_fsdp.config import ConfigError, load_config
from resilient_fsdp.hf import model as hf_model
from resilient_fsdp.hf import names
from resilient_fsdp.hf.weights import load_pretrained
from resilient_fsdp.train.data import SyntheticTokens
from resilient_fsdp.train.model import build_model
from tests.support import LANES, lane_path, read_events, read_losses, read_summary, run_local, run_trainer

# The tiny preset's shapes as a Llama: the built-in model and transformers' read the same weights.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def llama_dir(path, seed: int = 3, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised Llama saved as transformers saves a pretrained one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).to(dtype).save_pretrained(path)
    for f in path.iterdir():
        f.chmod(0o644)  # save_pretrained writes weights owner-only; the pods run as another user
    return path


def first_batch_loss(model_dir, ranks: int, micro_batch: int = 4, seq_len: int = 64) -> float:
    """transformers' loss on the first global batch the trainer draws (synthetic, seed 0)."""
    from transformers import AutoModelForCausalLM

    ds = SyntheticTokens(256, seq_len, seed=0)
    batch = torch.stack([ds[i] for i in range(ranks * micro_batch)])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # the trainer's parameters
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


@pytest.mark.parametrize("lane", LANES)
def test_an_hf_llama_trains_on_two_pods_and_resumes_bitwise_from_its_pretrained_start(tmp_path, request, lane):
    """2 pods x 1 rank, activation checkpointing on; rank 1 killed after step 7 resumes from step 4
    (the checkpoint, not model.init_from again) and ends bitwise equal to the run without a fault."""
    runs = {}
    for name, inject in (("clean", []), ("faulted", ["--inject", "sigkill@7:rank=1"])):
        run_dir = tmp_path / name
        llama_dir(run_dir / "llama")
        out = run_local(
            run_dir,
            nodes=2,
            nproc=1,
            extra=inject,
            pythonpath=lane_path(request, lane),
            overrides=[
                "model.hf_config=/fsx/llama",
                "model.init_from=/fsx/llama",
                "model.activation_checkpointing=true",
                "train.steps=12",
                "checkpoint.interval_steps=4",
            ],
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        runs[name] = run_dir
    clean, faulted = (read_summary(runs[n]) for n in ("clean", "faulted"))
    assert faulted["restarts"]["in_job"] == 1, faulted["restarts"]
    assert faulted["params_sha256"] == clean["params_sha256"]
    assert read_losses(runs["faulted"])[-12:] == read_losses(runs["clean"])
    # Started from the pretrained weights: transformers' loss on the same first batch.
    assert read_losses(runs["clean"])[0] == pytest.approx(first_batch_loss(runs["clean"] / "llama", ranks=2), rel=1e-5)
    assert (runs["clean"] / "model" / "config.json").is_file()  # what `checkpoints export` writes out


def test_the_built_in_preset_starts_from_a_llama_checkpoint_of_its_shape(tmp_path):
    source = llama_dir(tmp_path / "llama")
    out = run_trainer(tmp_path / "run", ["model.preset=tiny", f"model.init_from={source}", "train.steps=1"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "model.init_from: 21 tensors" in out.stderr + out.stdout
    assert read_losses(tmp_path / "run")[0] == pytest.approx(first_batch_loss(source, ranks=1), rel=1e-5)
    assert read_events(tmp_path / "run", "start")[0]["resumed_from_step"] is None


def test_a_tied_output_projection_is_loaded_trained_and_exported_once(tmp_path):
    """tie_word_embeddings (Llama 3.2 1B, small Qwens): the files hold the embedding only; it stays
    one parameter through FSDP and the export leaves lm_head.weight to the tie. The weights are
    bf16, as published checkpoints are: read into the float32 parameters."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    source = llama_dir(tmp_path / "llama", dtype=torch.bfloat16, tie_word_embeddings=True)
    run_dir = tmp_path / "run"
    out = run_trainer(run_dir, [f"model.hf_config={source}", f"model.init_from={source}", "train.steps=3"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "model.init_from: 20 tensors" in out.stderr + out.stdout
    assert read_losses(run_dir)[0] == pytest.approx(first_batch_loss(source, ranks=1), rel=1e-5)
    export = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "checkpoints",
            "export",
            "--run-dir",
            str(run_dir),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert export.returncode == 0, export.stderr
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32  # what training kept, not the bf16 the source's config.json names


def test_the_built_in_names_map_to_llama_and_back():
    with torch.device("meta"):  # names only: nothing is allocated
        model = build_model("8b")
    ours = [n for n, _ in model.named_parameters()]
    theirs = [names.to_hf(n) for n in ours]
    assert len(set(theirs)) == len(ours) == 2 + 32 * 9 + 1
    assert [names.from_hf(n) for n in theirs] == ours
    assert names.to_hf("layers.31.feed_forward.w1.weight") == "model.layers.31.mlp.gate_proj.weight"
    with pytest.raises(KeyError):
        names.to_hf("layers.0.attention.rotary.weight")


def test_weights_of_another_size_or_architecture_are_refused_naming_a_tensor(tmp_path):
    model = build_model("tiny")
    wider = llama_dir(tmp_path / "wider", intermediate_size=256)
    with pytest.raises(
        ConfigError,
        match=r"model.init_from=.*: model.layers.0.mlp.gate_proj.weight is \[256, 64\] "
        r"in .*, the model's is \[192, 64\]; the weights belong to a model of "
        r"another size",
    ):
        load_pretrained(model, str(wider), names.to_hf)
    deeper = build_model("tiny")
    deeper.layers.append(type(deeper.layers[0])(deeper.args))
    with pytest.raises(ConfigError, match=r"9 of the model's 30 tensors are not in .*, e.g. model.layers.2"):
        load_pretrained(deeper, str(llama_dir(tmp_path / "llama")), names.to_hf)
    shutil.rmtree(tmp_path / "llama")
    (tmp_path / "llama").mkdir()
    with pytest.raises(ConfigError, match=r"no .safetensors files there"):
        load_pretrained(model, str(tmp_path / "llama"), names.to_hf)


def test_weights_the_pods_user_cannot_read_are_refused_naming_the_file_and_the_fix(request):
    """transformers writes weights 0600; a pod running as another user (the chart's 10001) is told
    so at start, before any rank loads, instead of safetensors' 'No such file or directory'."""
    import subprocess
    import sys

    shared = Path(tempfile.mkdtemp(prefix="resilient-fsdp-weights-"))  # pytest's tmp_path is root-only (0700)
    shared.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(shared, ignore_errors=True))
    source = llama_dir(shared / "llama")
    (source / "model.safetensors").chmod(0o600)
    code = f"from resilient_fsdp.hf.weights import safetensors_dir\nsafetensors_dir({str(source)!r})\n"
    out = subprocess.run(
        ["setpriv", "--reuid=10001", "--regid=10001", "--clear-groups", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert out.returncode != 0
    assert (
        f"{source / 'model.safetensors'} is not readable by this process's user (uid 10001, groups []): mode "
        "-rw-------, owner uid 0"
    ) in out.stderr
    assert "chmod a+r" in out.stderr


def test_hf_config_mistakes_name_the_key(tmp_path):
    with pytest.raises(
        ConfigError,
        match=f"model.hf_config='{tmp_path / 'missing'}': no config.json there; set "
        "model.hf_config to a model's config.json or to a local directory",
    ):
        hf_model.build(str(tmp_path / "missing"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"is not a readable JSON file"):
        hf_model.build(str(tmp_path / "bad"))
    with pytest.raises(ConfigError, match="both name the model: keep one"):
        load_config(None, [f"model.hf_config={tmp_path}", "model.factory=x:y"])
    with pytest.raises(ConfigError, match="model.vocab_size=300 does not apply with model.hf_config"):
        load_config(None, [f"model.hf_config={tmp_path}", "model.vocab_size=300"])
