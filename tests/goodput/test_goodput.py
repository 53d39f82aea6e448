"""The goodput model, the advisor and the profiles it sets, the Monte Carlo simulation, and the
run report (from a real 2-node x 2-rank job with injected faults)."""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml

from tests.support import REPO, read_summary, run_local
from resilient_fsdp.goodput import advice_table, settings
from resilient_fsdp.goodput import advise as adv
from resilient_fsdp.goodput import model as gm
from resilient_fsdp.goodput import profiles
from resilient_fsdp.goodput import simulate as sim

VALUES_DIR = REPO / "values"
# dev-cpu is for drills on a kind/minikube cluster: nothing fails on its own there, so its
# settings are chosen for watching the layers work, not from a failure rate (its header says so).
ADVISED_PROFILES = sorted(p.stem for p in VALUES_DIR.glob("*.yaml") if p.stem != "dev-cpu")


# ---- formulas on worked examples ------------------------------------------------------------


def test_young_and_daly_intervals_match_worked_examples():
    # delta = 60 s, M = 24 h = 86,400 s.
    # Young: sqrt(2 * 60 * 86,400) = sqrt(10,368,000) = 3,219.94 s.
    assert gm.young_interval(60, 86_400) == pytest.approx(3219.94, abs=0.01)
    # Daly: x = 60 / 172,800 = 3.4722e-4, sqrt(x) = 0.018634;
    # 3,219.94 * (1 + 0.018634 / 3 + 3.4722e-4 / 9) - 60 = 3,219.94 * 1.0062499 - 60 = 3,180.07 s.
    assert gm.daly_interval(60, 86_400) == pytest.approx(3180.07, abs=0.02)
    # A stall of at least 2M: Daly says checkpoint every M.
    assert gm.daly_interval(500, 200) == 200


def test_expected_goodput_adds_up_and_matches_a_hand_computation():
    # T = 1,000 s, delta = 10 s, W = 40 s, R = 100 s, M = 100,000 s.
    # failures take (100 + 40 + 1,010 / 2) / 100,000 = 0.00645; training 0.99355 * 1000 / 1010.
    g = gm.expected_goodput(1000, 10, 40, 100, 100_000)
    assert g.productive == pytest.approx(0.99355 * 1000 / 1010)
    assert g.restarts == pytest.approx(0.001)
    assert g.lost_work == pytest.approx(0.00545)
    assert sum(g.as_dict().values()) == pytest.approx(1.0)


def test_restart_limits_are_poisson_quantiles():
    assert gm.poisson_quantile(0.0) == 0
    # Poisson(1): P(X <= 3) = 0.981, P(X <= 4) = 0.996.
    assert gm.poisson_quantile(1.0, 0.99) == 4
    # Large means do not underflow: about mean + 2.33 sqrt(mean).
    assert gm.poisson_quantile(1000.0, 0.99) == pytest.approx(1000 + 2.33 * math.sqrt(1000), abs=3)


# ---- the advisor ----------------------------------------------------------------------------


def _advice(*argv: str) -> settings.Advice:
    return settings.advise(adv.inputs_from_args(adv.parse_advise_line("# advise: " + " ".join(argv))))


def test_advisor_interval_is_daly_and_never_below_the_write_time():
    a = _advice("--instance", "p5.48xlarge", "--nodes", "64", "--ckpt-stall-s", "1", "--ckpt-write-s", "60")
    mtbf = gm.node_mtbf_hours(8) * 3600 / 64
    assert a.job_mtbf_s == pytest.approx(mtbf)
    assert a.daly_s == pytest.approx(gm.daly_interval(1, mtbf))
    assert a.interval_s == int(a.daly_s // 60) * 60  # rounded down to a whole minute
    # A write longer than Daly's interval sets the interval: saves never queue behind writes.
    slow = _advice("--instance", "p5.48xlarge", "--nodes", "64", "--ckpt-stall-s", "1", "--ckpt-write-s", "2000")
    assert slow.interval_s == 2000
    assert slow.checkpoint_timeout_s >= 5 * 2001


def test_advisor_default_failure_rate_is_llama3_and_cited():
    a = _advice("--instance", "p5.48xlarge", "--nodes", "2", "--ckpt-stall-s", "1", "--ckpt-write-s", "60")
    assert a.inputs.node_mtbf_hours == pytest.approx(54 * 24 * 16384 / 466 / 8)
    assert "466 interruptions in 54 days on 16,384" in advice_table.render_table(a)


def test_advisor_rejects_bad_input_naming_the_flag(capsys):
    with pytest.raises(settings.AdviseError, match="--instance 'p9.mega'.*--gpus-per-node"):
        _advice("--instance", "p9.mega", "--nodes", "2", "--ckpt-stall-s", "1", "--ckpt-write-s", "60")
    with pytest.raises(settings.AdviseError, match="--ckpt-write-s"):
        _advice("--instance", "p5.48xlarge", "--nodes", "2", "--ckpt-stall-s", "1")
    with pytest.raises(settings.AdviseError, match="--nodes must be at least 1"):
        _advice("--instance", "p5.48xlarge", "--nodes", "0", "--ckpt-stall-s", "1", "--ckpt-write-s", "60")


def test_hsdp_commits_in_seconds_at_16384_gpus_and_the_advisor_suggests_the_group():
    """2,048 p5 nodes, 70b: FSDP's commit is 16,384 x 250 kB x 2.05 / 5 MB/s = 1,679 s; the
    fewest pods whose share of 70.55e9 x 16 B fits in 40 GB is 4 (32 GPUs: 35.3 GB), and HSDP over
    them commits (32 x 250 kB x 2.05 + 16,384 x 500 B) / 5 MB/s = 4.9184 s."""
    flags = (
        "--instance",
        "p5.48xlarge",
        "--nodes",
        "2048",
        "--preset",
        "70b",
        "--storage-size",
        "115200Gi",
        "--deployment-type",
        "PERSISTENT_2",
        "--storage-throughput",
        "1000",
    )
    fsdp = _advice(*flags)
    assert fsdp.inputs.estimate.commit_s == pytest.approx(1679.36, abs=0.01)
    assert fsdp.inputs.suggested_shard_group == 32
    assert "--shard-group-size 32" in advice_table.render_table(fsdp)
    assert "shard_group_size" not in fsdp.values()["trainer"]["dist"]
    hsdp = _advice(*flags, "--shard-group-size", "32")
    assert hsdp.inputs.estimate.commit_s == pytest.approx(4.9184, abs=1e-4)
    assert hsdp.inputs.estimate.shard_gb == pytest.approx(fsdp.inputs.estimate.state_gb / 32)
    assert hsdp.values()["trainer"]["dist"]["shard_group_size"] == 32
    assert hsdp.goodput["productive"] > 0.95 > fsdp.goodput["productive"]
    assert hsdp.inputs.suggested_shard_group is None  # given: nothing to suggest
    # A small job's commit is short: no suggestion.
    assert _advice("--instance", "p5.48xlarge", "--nodes", "4", "--preset", "70b").inputs.suggested_shard_group is None
    with pytest.raises(settings.AdviseError, match="--shard-group-size 12 does not divide the job's 16384 GPUs"):
        _advice(*flags, "--shard-group-size", "12")


def test_advisor_estimates_the_checkpoint_costs_from_the_model_and_the_storage():
    """p5-16node by hand: 70,553,706,496 params x 12 B = 846.64 GB over 128 GPUs = 6.614 GB a shard;
    commit 128 ranks x 250 kB x 2.05 / 5 MB/s = 13.12 s, in rank 0's commit process; stall 6.614 / 53
    + 0.5 = 0.6248 s; W = 846.64 GB / (14,400 GiB / 1,024 x 500 MB/s/TiB = 7.031 GB/s) = 120.41 s,
    then the commit: 133.53 s."""
    a = _advice(
        "--instance",
        "p5.48xlarge",
        "--nodes",
        "16",
        "--preset",
        "70b",
        "--storage-size",
        "14400Gi",
        "--deployment-type",
        "PERSISTENT_2",
        "--storage-throughput",
        "500",
    )
    assert a.inputs.ckpt_stall_s == pytest.approx(0.6248, abs=1e-4)
    assert a.inputs.estimate.commit_s == pytest.approx(13.12, abs=1e-9)
    # The commit grows with the world: twice the ranks, twice the commit.
    wide = _advice(
        "--instance",
        "p5.48xlarge",
        "--nodes",
        "32",
        "--preset",
        "70b",
        "--storage-size",
        "14400Gi",
        "--deployment-type",
        "PERSISTENT_2",
        "--storage-throughput",
        "500",
    )
    assert wide.inputs.estimate.commit_s == pytest.approx(2 * a.inputs.estimate.commit_s)
    assert a.inputs.ckpt_write_s == pytest.approx(133.53, abs=0.01)
    assert dict(a.inputs.cost_sources) == {
        "ckpt_stall_s": "estimated",
        "ckpt_write_s": "estimated",
        "restart_s": "default",
    }
    # --params is the same model by its count; SCRATCH_2 has one throughput, 200 MB/s/TiB.
    same = _advice(
        "--instance",
        "p5.48xlarge",
        "--nodes",
        "16",
        "--params",
        "70553706496",
        "--storage-size",
        "14400Gi",
        "--storage-throughput",
        "500",
    )
    assert same.inputs.ckpt_write_s == a.inputs.ckpt_write_s
    scratch = _advice(
        "--instance",
        "g5.12xlarge",
        "--nodes",
        "1",
        "--preset",
        "1b",
        "--storage-size",
        "1200Gi",
        "--deployment-type",
        "SCRATCH_2",
    )
    assert scratch.inputs.ckpt_write_s == pytest.approx(
        1_100_048_384 * 12 / (1200 / 1024 * 200e6) + 4 * 250e3 * 2.05 / 5e6
    )
    assert scratch.inputs.ckpt_stall_s == pytest.approx(1_100_048_384 * 12 / 4 / 25e9 + 0.5)


def test_advisor_lets_each_measured_cost_replace_its_estimate(tmp_path):
    ckpt = tmp_path / "ckpt.json"
    ckpt.write_text(json.dumps({"async": {"stall_s": 0.4, "write_s": 3.3}}))
    stall_only = _advice("--instance", "p5.48xlarge", "--nodes", "16", "--preset", "70b", "--ckpt-stall-s", "0.9")
    assert stall_only.inputs.ckpt_stall_s == 0.9 and stall_only.inputs.ckpt_write_s > 100  # W still estimated
    sources = dict(stall_only.inputs.cost_sources)
    assert sources["ckpt_stall_s"] == "given, --ckpt-stall-s" and sources["ckpt_write_s"] == "estimated"
    measured = _advice("--instance", "p5.48xlarge", "--nodes", "16", "--preset", "70b", "--from-bench", str(ckpt))
    assert (measured.inputs.ckpt_stall_s, measured.inputs.ckpt_write_s) == (0.4, 3.3)
    assert measured.inputs.estimate is None
    assert dict(measured.inputs.cost_sources)["ckpt_write_s"] == f"measured, --from-bench {ckpt}"


def test_advise_with_only_what_a_user_knows_prints_a_full_recommendation():
    """The README's call: instance, nodes, model; storage: the chart's default volume, too slow
    for a 70b state at a small stall, which the table says along with the size that would do."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "advise",
            "--instance",
            "p5.48xlarge",
            "--nodes",
            "16",
            "--preset",
            "70b",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    for key in ("checkpoint.interval_s", "max_restarts", "step_timeout_s", "init_timeout_s", "expected goodput"):
        assert any(line.startswith(key) for line in proc.stdout.splitlines()), key
    assert "(estimated)" in proc.stdout and "847 GB" in proc.stdout
    assert "(1.17 TiB x 250 MB/s/TiB, PERSISTENT_2)" in proc.stdout  # the chart's default volume
    # With a small measured stall, Daly's interval is shorter than the default volume's write.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "advise",
            "--instance",
            "p5.48xlarge",
            "--nodes",
            "16",
            "--preset",
            "70b",
            "--ckpt-stall-s",
            "0.625",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "W is longer than Daly's interval" in proc.stdout and "storage.size 4800Gi" in proc.stdout


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], ["--preset, or --params", "--ckpt-stall-s and --ckpt-write-s", "--from-bench"]),
        (["--preset", "70b", "--params", "7e10"], ["--preset and --params both"]),
        (["--preset", "huge"], ["--preset 'huge'", "70b"]),
        (["--preset", "8b", "--deployment-type", "SCRATCH_2", "--storage-throughput", "500"], ["SCRATCH_2", "200"]),
        (["--preset", "8b", "--storage-throughput", "300"], ["PERSISTENT_2 offers 125, 250, 500, 1000"]),
        (["--preset", "8b", "--storage-size", "2TB"], ["--storage-size '2TB'", "1200Gi"]),
    ],
)
def test_advisor_estimate_refuses_bad_input_naming_the_flag(argv, words):
    with pytest.raises(settings.AdviseError) as info:
        _advice("--instance", "p5.48xlarge", "--nodes", "4", *argv)
    for w in words:
        assert w in str(info.value)


def _scale_results(path):
    """``bench scale`` records: 70b FSDP measured at 1,024 ranks (300 s of start-up), 70b HSDP-64
    extrapolated from 256 and 1,024 ranks (30 s and 120 s)."""

    def phases(blocked, resume):
        return {"cold_save_plan_s": blocked, "max_rank_blocked_s": blocked, "resume_metadata_and_plan_s": resume}

    path.write_text(
        json.dumps(
            [
                {"ranks": 1024, "preset": "70b", "layout": "fsdp", **phases(100.0, 200.0)},
                {
                    "ranks": 16384,
                    "preset": "70b",
                    "layout": "hsdp-64",
                    **phases(999.0, 999.0),
                    "extrapolated_from": {"256": phases(10.0, 20.0), "1024": phases(40.0, 80.0)},
                },
            ]
        )
    )
    return path


def test_the_start_up_a_restart_adds_is_read_from_bench_scale_at_the_jobs_size(tmp_path):
    from resilient_fsdp.goodput import simulate as gs

    scale = _scale_results(tmp_path / "scale.json")
    assert gs.startup_from_bench(scale, "70b:fsdp", 1024) == pytest.approx(300.0)
    assert gs.startup_from_bench(scale, "70b:fsdp", 2048) == pytest.approx(600.0)  # grows with the world beyond
    assert gs.startup_from_bench(scale, "70b:fsdp", 512) == pytest.approx(300.0)  # not below the smallest measured
    assert gs.startup_from_bench(scale, "70b:hsdp-64", 512) == pytest.approx(60.0)  # between measured points
    with pytest.raises(ValueError, match="8b fsdp"):
        gs.startup_from_bench(scale, "8b:fsdp", 1024)
    # The simulator adds it to every recovery and says where it came from.
    _, without = _simulate_cli(tmp_path, "--nodes", "128", "--recovery-range", "1")
    _, with_startup = _simulate_cli(
        tmp_path, "--nodes", "128", "--recovery-range", "1", "--startup-from-bench", str(scale)
    )
    assert all(a["goodput"] < b["goodput"] for a, b in zip(with_startup["rows"], without["rows"]))
    assert with_startup["inputs"]["start-up planning and resume metadata"].startswith(f"measured (bench scale {scale}")
    assert without["inputs"]["start-up planning and resume metadata"].startswith("not counted")
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "simulate",
            "--nodes",
            "8",
            "--startup-from-bench",
            str(scale),
            "--startup-case",
            "8b:fsdp",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "8b fsdp" in bad.stderr and "Traceback" not in bad.stderr
    # The advisor adds it to the restart, for the job's model and layout.
    rec = tmp_path / "rec.json"
    rec.write_text(json.dumps({"in_job": {"recovery_s_median": 9.5}}))
    a = _advice(
        "--instance",
        "p5.48xlarge",
        "--nodes",
        "128",
        "--preset",
        "70b",
        "--from-bench",
        str(rec),
        "--from-bench",
        str(scale),
    )
    assert a.inputs.restart_s == pytest.approx(9.5 + 300.0)
    assert (
        f"start-up planning and resume metadata (measured, --from-bench {scale}, 70b:fsdp)"
        in dict(a.inputs.cost_sources)["restart_s"]
    )
    with pytest.raises(settings.AdviseError, match="--preset"):
        _advice(
            "--instance",
            "p5.48xlarge",
            "--nodes",
            "8",
            "--ckpt-stall-s",
            "1",
            "--ckpt-write-s",
            "9",
            "--from-bench",
            str(scale),
        )


def test_advisor_reads_measured_costs_from_benchmark_results(tmp_path):
    ckpt = tmp_path / "ckpt.json"
    ckpt.write_text(json.dumps({"async": {"stall_s": 0.4, "write_s": 3.3}}))
    rec = tmp_path / "rec.json"
    rec.write_text(json.dumps({"in_job": {"recovery_s_median": 9.5}}))
    a = _advice("--instance", "p5.48xlarge", "--nodes", "8", "--from-bench", str(ckpt), "--from-bench", str(rec))
    assert (a.inputs.ckpt_stall_s, a.inputs.ckpt_write_s, a.inputs.restart_s) == (0.4, 3.3, 9.5)


@pytest.mark.parametrize("profile", ADVISED_PROFILES)
def test_profile_restart_settings_are_the_advisors(profile):
    text = VALUES_DIR.joinpath(f"{profile}.yaml").read_text()
    line = profiles.advise_line(text)
    advice = profiles.advice_for(line)
    values = yaml.safe_load(text)
    expected = advice.values()
    # The advisor's inputs are the profile's own facts: its instance, nodes, model and storage.
    assert values["instanceType"] == advice.inputs.instance and values["nodes"] == advice.inputs.nodes
    args = adv.parse_advise_line(line)
    assert args.preset == values["trainer"]["model"]["preset"], f"{profile}: --preset is not trainer.model.preset"
    storage = values["storage"]
    assert (args.storage_size, args.deployment_type) == (storage["size"], storage["fsx"]["deploymentType"])
    assert args.storage_throughput == storage["fsx"].get("perUnitStorageThroughput"), (
        f"{profile}: --storage-throughput is not storage.fsx.perUnitStorageThroughput"
    )
    # Its header is the advisor's arithmetic for those inputs, as generated.
    lines = text.splitlines()
    start, end = profiles.block_span(lines)
    assert lines[start : end + 1] == profiles.header_block(line), (
        f"{profile}: the restart-settings block is stale: python -m resilient_fsdp.goodput.profiles"
    )
    assert values["trainer"]["checkpoint"]["interval_s"] == expected["trainer"]["checkpoint"]["interval_s"]
    for group, keys in expected["trainer"]["resilience"].items():
        for key, value in keys.items():
            assert values["trainer"]["resilience"][group][key] == value, f"{profile}: trainer.resilience.{group}.{key}"
    assert values["job"]["backoffLimit"] == expected["job"]["backoffLimit"]
    assert values.get("spares", 0) == expected.get("spares", 0), f"{profile}: spares is not the advisor's"
    assert values["workload"]["jobSet"]["maxRestarts"] == expected["workload"]["jobSet"]["maxRestarts"], (
        f"{profile}: workload.jobSet.maxRestarts"
    )
    assert values["trainer"]["dist"]["timeout_s"] == expected["trainer"]["dist"]["timeout_s"], (
        f"{profile}: trainer.dist.timeout_s"
    )
    # The memory tier is on in every profile, at the advisor's interval, with /dev/shm to hold it.
    assert values["trainer"]["checkpoint"]["memory"] == expected["trainer"]["checkpoint"]["memory"], (
        f"{profile}: trainer.checkpoint.memory"
    )
    assert values["trainer"]["checkpoint"]["memory"]["interval_steps"] > 0
    assert values["shm"]["sizeLimit"] == expected["shm"]["sizeLimit"], f"{profile}: shm.sizeLimit"


@pytest.mark.parametrize("profile", ADVISED_PROFILES)
def test_profile_collective_timeout_fires_and_dumps_before_hang_detection_kills(profile, tmp_path):
    """Every GPU profile's trainer configuration passes the NCCL rule (dist.timeout_s at least
    DUMP_MARGIN_S below each section timeout), as the trainer applies it on a GPU node."""
    from resilient_fsdp.config import DUMP_MARGIN_S, check_collective_timeouts, load_config

    trainer = yaml.safe_load(VALUES_DIR.joinpath(f"{profile}.yaml").read_text())["trainer"]
    path = tmp_path / "trainer.yaml"
    path.write_text(yaml.safe_dump(trainer))
    cfg = load_config(path)
    check_collective_timeouts(cfg)
    assert cfg.dist.timeout_s + DUMP_MARGIN_S <= cfg.resilience.hang_detection.step_timeout_s


def test_the_docs_table_of_profiles_is_the_profiles():
    lines = profiles.DOCS_PAGE.read_text().splitlines()
    start, end = lines.index(profiles.TABLE_START), lines.index(profiles.TABLE_END)
    assert lines[start : end + 1] == profiles.profile_table(), (
        "docs/eks-helm.md's profile table is stale: python -m resilient_fsdp.goodput.profiles"
    )
    p5 = next(line for line in lines[start:end] if line.startswith("| `p5-16node`"))
    assert "| 16 x p5.48xlarge (8 GPUs, 32 EFA each) | 70b | 2,520 s | 4 / 4 / 2 |" in p5  # read off the profile


def test_advise_command_prints_a_values_snippet_the_chart_accepts(tmp_path):
    from resilient_fsdp.deploy.chart import load_values, render

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "advise",
            "--instance",
            "p5.48xlarge",
            "--nodes",
            "4",
            "--ckpt-stall-s",
            "0.5",
            "--ckpt-write-s",
            "60",
            "--values",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    snippet = tmp_path / "advised.yaml"
    snippet.write_text(proc.stdout)
    assert yaml.safe_load(proc.stdout)["job"]["backoffLimit"] >= 3
    rendered = render(
        load_values(
            [str(VALUES_DIR / "p5-4node.yaml"), str(VALUES_DIR / "examples" / "my-cluster.yaml"), str(snippet)], []
        )
    )
    job = rendered.find("PyTorchJob")
    assert "resilient-fsdp advise" in proc.stdout
    assert job["spec"]["runPolicy"]["backoffLimit"] == yaml.safe_load(proc.stdout)["job"]["backoffLimit"]


def test_the_memory_tier_model_reduces_to_the_durable_one_and_adds_up():
    # No failure covered and no memory save between durable ones: the durable model exactly.
    plain = gm.expected_goodput(1000, 10, 40, 100, 20_000)
    reduced = gm.expected_goodput_with_memory(1000, 10, 40, 100, 20_000, 1000, 0.5, 100, 0.0)
    assert reduced.as_dict() == pytest.approx(plain.as_dict())
    # T_m = 100 s, delta_m = 0.5 s, R_m = 100 s, 75% covered: lost per failure 0.75 x 50.25 +
    # 0.25 x 545 = 173.94 s; 9 memory saves per durable interval add 4.5 s of stall.
    g = gm.expected_goodput_with_memory(1000, 10, 40, 100, 20_000, 100, 0.5, 100, 0.75)
    failures = (0.75 * 50.25 + 0.25 * 545 + 100) / 20_000
    assert g.productive == pytest.approx((1 - failures) * 1000 / 1014.5)
    assert g.productive > plain.productive and sum(g.as_dict().values()) == pytest.approx(1.0)


def test_advisor_sizes_the_memory_tier_its_shm_and_the_goodput_it_gains(tmp_path):
    from resilient_fsdp.deploy.chart import load_values, render

    a = _advice(
        "--instance",
        "p5.48xlarge",
        "--nodes",
        "512",
        "--preset",
        "70b",
        "--storage-size",
        "115200Gi",
        "--deployment-type",
        "PERSISTENT_2",
        "--storage-throughput",
        "1000",
        "--memory",
    )
    m, mi = a.memory, a.inputs.memory
    mtbf = a.job_mtbf_s
    assert m["daly_s"] == pytest.approx(gm.daly_interval(mi.stall_s, mtbf / 0.75))
    assert m["interval_steps"] == int(m["daly_s"] // 10) and 1 <= m["interval_steps"] <= a.interval_s // 10
    shard_gib = 70.6e9 * 12 / 4096 / 2**30
    # Own two, a peer's two and the durable checkpoint's staging copy, for each of the 8 GPUs.
    assert m["shm_gib"] == math.ceil(5 * shard_gib * 8) + settings.SHM_MARGIN_GIB
    assert m["goodput"]["productive"] > a.goodput["productive"]
    values = a.values()
    assert values["trainer"]["checkpoint"]["memory"] == {"interval_steps": m["interval_steps"], "replicas": 1}
    assert values["shm"] == {"sizeLimit": f"{m['shm_gib']}Gi"}
    # The durable checkpoint serves the quarter of failures the tier leaves to it: Daly's for
    # M / 0.25, in the values; the durable-only interval stays beside it.
    assert m["durable_daly_s"] == pytest.approx(gm.daly_interval(a.inputs.ckpt_stall_s, mtbf / 0.25))
    assert m["durable_interval_s"] == settings.durable_interval(m["durable_daly_s"], a.inputs.ckpt_write_s)
    assert m["durable_interval_s"] >= a.interval_s
    assert values["trainer"]["checkpoint"]["interval_s"] == m["durable_interval_s"]
    assert a._values()["trainer"]["checkpoint"]["interval_s"] == a.interval_s
    # HSDP at 2,048 nodes: rounded down to ten seconds below ten minutes, twice the durable-only one.
    h = _advice(*P5_70B_HSDP, "--nodes", "2048", "--memory")
    hm = h.memory
    assert hm["durable_interval_s"] == int(hm["durable_daly_s"] // 10) * 10 == 280 and h.interval_s == 140
    assert h.values()["trainer"]["checkpoint"]["interval_s"] == 280
    assert "checkpoint.interval_s with it     280 (Daly" in advice_table.render_table(h)
    # With a stall of seconds (a commit on the training thread) it pays in the advisor's own
    # model, the quarter's longer lost work and all: 660 s instead of 340 s.
    slow = _advice(
        "--instance",
        "p5.48xlarge",
        "--nodes",
        "2048",
        "--ckpt-stall-s",
        "5.92",
        "--ckpt-write-s",
        "7.53",
        "--memory",
        "--memory-stall-s",
        "0.52",
    )
    sm, smi = slow.memory, slow.inputs.memory
    assert (slow.interval_s, sm["durable_interval_s"]) == (340, 660)
    at_durable_only = gm.expected_goodput_with_memory(
        slow.interval_s,
        5.92,
        7.53,
        slow.inputs.restart_s,
        slow.job_mtbf_s,
        sm["interval_s"],
        0.52,
        smi.restart_s,
        smi.coverage,
    )
    assert sm["goodput"]["productive"] > at_durable_only.productive + 0.002
    # Every failure covered: nothing sets it but the cap.
    every = _advice(
        "--instance", "p5.48xlarge", "--nodes", "512", "--preset", "70b", "--memory", "--memory-coverage", "1"
    ).memory
    assert every["durable_interval_s"] == settings.MAX_INTERVAL_S
    snippet = tmp_path / "advised.yaml"
    snippet.write_text(yaml.safe_dump(values))
    pod = render(
        load_values(
            [str(VALUES_DIR / "p5-4node.yaml"), str(VALUES_DIR / "examples" / "my-cluster.yaml"), str(snippet)], []
        )
    ).find("PyTorchJob")
    assert f"{m['shm_gib']}Gi" in json.dumps(pod)  # the chart takes the values as they are
    alone = _advice(
        "--instance", "p5.48xlarge", "--nodes", "512", "--preset", "70b", "--memory", "--memory-replicas", "0"
    ).memory
    assert alone["shm_gib"] == math.ceil(3 * shard_gib * 8) + settings.SHM_MARGIN_GIB
    with pytest.raises(settings.AdviseError, match="--memory-coverage"):
        _advice("--instance", "p5.48xlarge", "--nodes", "4", "--preset", "8b", "--memory", "--memory-coverage", "1.5")
    # The coverage a run measured: its restarts' start records, by where each resumed from.
    run = tmp_path / "run"
    run.mkdir()
    starts = [
        ("start", None),
        ("in_job", "memory"),
        ("in_job", "memory"),
        ("job", "durable"),
        ("in_process", "memory"),
        ("in_job", None),
    ]
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"event": "start", "layer": layer, "resumed_from_tier": tier}) + "\n" for layer, tier in starts
        )
        + '{"event": "sta\n'
    )
    assert adv.coverage_from_run(run) == (0.75, 4)
    measured = _advice(
        "--instance", "p5.48xlarge", "--nodes", "64", "--preset", "70b", "--memory", "--from-run", str(run)
    )
    assert measured.inputs.memory.coverage == 0.75
    assert f"75% of failures (measured, --from-run {run}: 3 of 4 restarts from memory)" in advice_table.render_table(
        measured
    )
    given = _advice(
        "--instance",
        "p5.48xlarge",
        "--nodes",
        "64",
        "--preset",
        "70b",
        "--memory",
        "--from-run",
        str(run),
        "--memory-coverage",
        "0.5",
    )
    assert given.inputs.memory.coverage == 0.5  # what is given wins over what was measured
    (run / "metrics.jsonl").write_text(json.dumps({"event": "start", "layer": "start"}) + "\n")
    with pytest.raises(settings.AdviseError, match="no restart of that run resumed from a checkpoint"):
        _advice("--instance", "p5.48xlarge", "--nodes", "64", "--preset", "70b", "--memory", "--from-run", str(run))
    with pytest.raises(settings.AdviseError, match="cannot read"):
        _advice(
            "--instance",
            "p5.48xlarge",
            "--nodes",
            "64",
            "--preset",
            "70b",
            "--memory",
            "--from-run",
            str(tmp_path / "missing"),
        )
    assert (
        "memory"
        not in _advice("--instance", "p5.48xlarge", "--nodes", "4", "--preset", "8b").values()["trainer"]["checkpoint"]
    )


@pytest.mark.parametrize(
    "kind, words",
    [
        ("PyTorchJob", ["in a row without a step trained past", "pods' agents count", "kubeflow/trainer#2045"]),
        ("JobSet", ["the Job absorbs", "workload.jobSet.maxRestarts"]),
        ("TrainJob", ["as JobSet", "TrainingRuntime"]),
    ],
)
def test_advise_says_what_backoff_limit_does_under_each_workload_kind(kind, words):
    args = ["--instance", "p5.48xlarge", "--nodes", "4", "--ckpt-stall-s", "0.5", "--ckpt-write-s", "60"]
    parser = argparse.ArgumentParser()
    adv.add_parser(parser.add_subparsers())
    table, snippet = io.StringIO(), io.StringIO()
    assert adv.main(parser.parse_args(["advise", *args, "--kind", kind]), out=table) == 0
    assert adv.main(parser.parse_args(["advise", *args, "--kind", kind, "--values"]), out=snippet) == 0
    row = next(line for line in table.getvalue().splitlines() if line.startswith(f"backoffLimit ({kind})"))
    header = next(line for line in snippet.getvalue().splitlines() if line.startswith("# job.backoffLimit"))
    for w in words:
        assert w in row and w in header, (w, row, header)
    # Only the keys that act under the kind: a PyTorchJob has no JobSet to restart.
    values = yaml.safe_load(snippet.getvalue())
    assert values["job"]["backoffLimit"] >= 1
    if kind == "PyTorchJob":
        assert "workload" not in values
    else:
        assert values["workload"]["kind"] == kind and values["workload"]["jobSet"]["maxRestarts"] >= 1


def test_advise_help_prints_without_a_traceback(capsys):
    from resilient_fsdp.cli import main

    assert main(["advise", "--help"]) == 0
    assert "free at most 1% of the time" in capsys.readouterr().out


# ---- the simulation -------------------------------------------------------------------------


def _scenario(nodes: int, **kw) -> sim.Scenario:
    mtbf_h = gm.node_mtbf_hours(8)
    interval = gm.daly_interval(1.0, mtbf_h * 3600 / nodes)
    base = dict(
        nodes=nodes, node_mtbf_h=mtbf_h, horizon_h=24 * 60, interval_s=max(interval, 60), stall_s=1.0, write_s=60.0
    )
    base.update(kw)
    return sim.Scenario(**base)


def test_simulation_is_reproducible_with_a_seed():
    s = _scenario(512)
    assert sim.simulate(s, "in-job", runs=20, seed=7) == sim.simulate(s, "in-job", runs=20, seed=7)
    assert sim.simulate(s, "in-job", runs=20, seed=7) != sim.simulate(s, "in-job", runs=20, seed=8)


@pytest.mark.parametrize("nodes", [64, 512, 2048])
@pytest.mark.parametrize("strategy", list(sim.STRATEGIES))
def test_simulation_agrees_with_the_closed_form_where_it_applies(nodes, strategy):
    # The closed form is first order in (T + R) / M: at 2048 nodes M is ~2.8 h, still > 10 x (T + R).
    s = _scenario(nodes)
    simulated = sim.simulate(s, strategy, runs=60, seed=1)["goodput"]
    assert simulated == pytest.approx(sim.analytic(s, strategy), rel=0.01)


def test_cheaper_recovery_layers_raise_goodput_at_scale():
    s = _scenario(2048)
    goodput = {k: sim.simulate(s, k, runs=60, seed=3)["goodput"] for k in sim.STRATEGIES}
    assert goodput["job"] < goodput["in-job"] < goodput["in-process"]


@pytest.mark.parametrize("replicas", [0, 1])
@pytest.mark.parametrize("nodes", [512, 2048])
def test_the_memory_tier_simulated_agrees_with_its_closed_form_and_cuts_the_lost_work(nodes, replicas):
    s = _scenario(nodes, memory_interval_s=20.0, memory_stall_s=0.05, memory_replicas=replicas)
    memory = sim.simulate(s, sim.MEMORY_STRATEGY, runs=60, seed=1)
    assert memory["goodput"] == pytest.approx(sim.analytic(s, sim.MEMORY_STRATEGY), rel=0.01)
    in_job = sim.simulate(s, "in-job", runs=60, seed=1)
    # With replicas every failure resumes from memory; without, the node failures (60%) do not.
    assert memory["lost_work"] < in_job["lost_work"] / (4 if replicas else 1)
    assert memory["checkpoint_stalls"] > in_job["checkpoint_stalls"]  # the snapshots' own stalls
    assert memory["restarts"] == pytest.approx(in_job["restarts"], rel=0.1)  # the same layers recover
    if replicas == 0:  # a lost node goes back to the durable checkpoint
        with_replicas = sim.simulate(
            sim.Scenario(**{**s.__dict__, "memory_replicas": 1}), sim.MEMORY_STRATEGY, runs=60, seed=1
        )
        assert with_replicas["lost_work"] < memory["lost_work"]


def test_simulate_command_writes_table_json_and_plot(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "simulate",
            "--nodes",
            "8,64",
            "--runs",
            "5",
            "--out",
            str(out),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["nodes"], r["strategy"]) for r in rows} == {(n, k) for n in (8, 64) for k in sim.STRATEGIES}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    memory = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "simulate",
            "--nodes",
            "64",
            "--runs",
            "5",
            "--memory-stall-s",
            "0.5",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert memory.returncode == 0, memory.stderr
    rows = {r["strategy"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {*sim.STRATEGIES, sim.MEMORY_STRATEGY} and sim.MEMORY_STRATEGY in memory.stdout
    assert 0 < rows[sim.MEMORY_STRATEGY]["memory_interval_s"] < rows["in-job"]["interval_s"]
    assert rows[sim.MEMORY_STRATEGY]["interval_s"] == rows["in-job"]["interval_s"]
    # The memory strategies' own durable interval; the others keep Daly's.
    longer = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "simulate",
            "--nodes",
            "64",
            "--runs",
            "5",
            "--memory-stall-s",
            "0.5",
            "--memory-durable-interval-s",
            "3000",
            "--spares",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert longer.returncode == 0, longer.stderr
    longer_rows = {r["strategy"]: r for r in json.loads(out.read_text())["rows"]}
    assert {k: r["interval_s"] for k, r in longer_rows.items()} == {
        **{k: rows["in-job"]["interval_s"] for k in (*sim.STRATEGIES, "in-job+spares")},
        sim.MEMORY_STRATEGY: 3000,
        "in-job+memory+spares": 3000,
    }
    short = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "simulate",
            "--nodes",
            "64",
            "--runs",
            "1",
            "--memory-stall-s",
            "0.5",
            "--memory-durable-interval-s",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert short.returncode != 0 and "--memory-durable-interval-s 30 is shorter than the write" in short.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "resilient_fsdp.cli", "simulate", "--mix", "1,2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "--mix" in bad.stderr


# ---- hot spares -----------------------------------------------------------------------------

P5_70B_HSDP = (
    "--instance",
    "p5.48xlarge",
    "--preset",
    "70b",
    "--storage-size",
    "115200Gi",
    "--deployment-type",
    "PERSISTENT_2",
    "--storage-throughput",
    "1000",
    "--shard-group-size",
    "32",
)


def test_spare_counts_are_poisson_tails_worked_by_hand():
    # Poisson(0.5): P(X <= 2) = e^-0.5 (1 + 0.5 + 0.125) = 0.985612, P(X <= 3) adds 0.012636 -> 0.998248.
    assert gm.p_no_spare(3, 0.5) == pytest.approx(0.014388, abs=1e-6)
    assert gm.p_no_spare(4, 0.5) == pytest.approx(0.001752, abs=1e-6)
    assert gm.spares_needed(0.5) == 4  # 3 leaves 1.4% of node losses without a spare, 4 leaves 0.18%
    assert gm.p_no_spare(0, 0.5) == 1.0 and gm.p_no_spare(2, 0.0) == 0.0
    assert gm.spares_needed(0.0) == 1  # at least one
    # Large means do not underflow: Poisson(1,000)'s median is 1,000, so P(X >= 1,000) lies between
    # 1/2 and 1/2 + P(X = 1,000).
    at_mean = math.exp(1000 * math.log(1000) - 1000 - math.lgamma(1001))
    assert 0.5 < gm.p_no_spare(1000, 1000.0) < 0.5 + at_mean
    # m = 2,047 nodes x 0.6 / 5,695.7 h x 600 s / 3,600 = 0.03594.
    m = gm.busy_spares_mean(2048, gm.node_mtbf_hours(8) * 3600, 0.6, 600)
    assert m == pytest.approx(2047 * 0.6 / gm.node_mtbf_hours(8) / 6)
    assert m == pytest.approx(0.03594, abs=1e-5)


def test_advisor_recommends_more_spares_for_more_nodes_and_slower_replacements():
    counts = {n: _advice(*P5_70B_HSDP, "--nodes", str(n), "--spares").spares["count"] for n in (64, 512, 2048, 8192)}
    # m = 0.0090 at 512 nodes: P(X >= 1) = 0.0089, one spare; m = 0.0359 at 2,048: P(X >= 1) = 0.035, two.
    assert counts[512] == 1 and counts[2048] == 2
    assert list(counts.values()) == sorted(counts.values()) and counts[8192] > counts[512]
    # At 64 nodes one spare would leave <= 1% of losses uncovered, but it idles 1/65 of the
    # node-hours for less goodput than that: none is recommended, and the table says why.
    small = _advice(*P5_70B_HSDP, "--nodes", "64", "--spares")
    s = small.spares
    assert (
        counts[64] == 0 and s["recommended"] and s["goodput_per_paid_node_hour"] == pytest.approx(s["goodput_without"])
    )
    paid_one = _advice(*P5_70B_HSDP, "--nodes", "64", "--spares", "1").spares
    assert paid_one["goodput"] > s["goodput_without"] > paid_one["goodput_per_paid_node_hour"]
    assert "none recommended: 1 spare(s) would cost 1.54% of the node-hours" in advice_table.render_table(small)
    # A replacement that takes an hour: m = 0.2156, P(X >= 2) = 1 - e^-m (1 + m) = 0.020, three.
    slow = _advice(*P5_70B_HSDP, "--nodes", "2048", "--spares", "auto", "--replacement-s", "3600").spares
    assert slow["count"] == 3 and slow["busy_mean"] == pytest.approx(0.2156, abs=1e-4)
    assert slow["p_no_spare"] == pytest.approx(1 - math.exp(-0.2156) * (1 + 0.2156 + 0.2156**2 / 2), abs=1e-4)
    assert slow["p_no_spare"] <= settings.SPARE_MISS_TARGET < gm.p_no_spare(2, slow["busy_mean"])


def test_advisor_reports_what_spares_cost_and_gain():
    a = _advice(*P5_70B_HSDP, "--nodes", "2048", "--memory", "--spares")
    s = a.spares
    assert s["count"] == 2 and s["recommended"] and s["cost_share"] == pytest.approx(2 / 2050)
    assert s["goodput"] > s["goodput_without"] and s["goodput_memory"] > s["goodput_memory_without"]
    assert s["goodput_memory"] > s["goodput"]
    assert s["goodput_per_paid_node_hour"] == pytest.approx(s["goodput_memory"] * 2048 / 2050)
    # Without spares a node loss (60% of failures) waits the job-level restart: the durable
    # figure is the closed form with a mean restart of 0.4 x 120 + 0.6 x 600 = 408 s.
    durable = gm.expected_goodput(a.interval_s, a.inputs.ckpt_stall_s, a.inputs.ckpt_write_s, 408.0, a.job_mtbf_s)
    assert s["goodput_without"] == pytest.approx(durable.productive)
    # With them: 121 s when a spare takes it (not pod 0, one free), else 600 s.
    taken = (1 - 1 / 2048) * (1 - s["p_no_spare"])
    assert s["node_loss_recovery_s"] == pytest.approx(taken * 121 + (1 - taken) * 600)
    table = advice_table.render_table(a)
    assert "goodput per paid node-hour" in table and f"{s['goodput_per_paid_node_hour']:.4f}" in table
    assert "P(Poisson(0.0359) >= 2)" in table and "0.10% of the node-hours paid" in table
    given = _advice(*P5_70B_HSDP, "--nodes", "2048", "--spares", "1").spares
    assert (given["count"], given["recommended"]) == (1, False) and given["p_no_spare"] > settings.SPARE_MISS_TARGET
    with pytest.raises(settings.AdviseError, match="pod 0, which hosts the rendezvous store"):
        _advice(*P5_70B_HSDP[:-2], "--nodes", "1", "--spares")
    with pytest.raises(settings.AdviseError, match="--spares 'two'"):
        _advice(*P5_70B_HSDP, "--nodes", "64", "--spares", "two")
    with pytest.raises(settings.AdviseError, match="--node-loss-share"):
        _advice(*P5_70B_HSDP, "--nodes", "64", "--spares", "--node-loss-share", "1.5")


def test_advise_values_print_spares_at_the_top_level_and_nothing_changes_without_them():
    args = ["--instance", "p5.48xlarge", "--nodes", "2048", "--ckpt-stall-s", "5.92", "--ckpt-write-s", "7.53"]
    parser = argparse.ArgumentParser()
    adv.add_parser(parser.add_subparsers())

    def run(*extra: str) -> str:
        out = io.StringIO()
        assert adv.main(parser.parse_args(["advise", *args, *extra]), out=out) == 0
        return out.getvalue()

    snippet = run("--values", "--spares")
    values = yaml.safe_load(snippet)
    assert values["spares"] == 2 and list(values)[0] == "spares"
    assert "--spares 2 --replacement-s 600" in snippet and "#   spares: busy spares ~ Poisson(m)" in snippet
    plain_values = run("--values")
    assert "spares" not in plain_values and "spares" not in yaml.safe_load(plain_values)
    # The spare rows come after every row of the table without them, which they leave as it is.
    plain, spared = run().splitlines(), run("--spares").splitlines()
    assert not any("spare" in line for line in plain)
    assert [" ".join(ln.split()) for ln in spared[: len(plain)]] == [" ".join(ln.split()) for ln in plain]
    assert [re.split(r"\s{2,}", ln.strip())[0] for ln in spared[len(plain) :]] == [
        "spares",
        *["spares"] * 4,
        "goodput with spares",
        "goodput per paid node-hour",
    ]
    assert _advice(*args).spares is None


def _without_spare_keys(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "p_no_spare"}


@pytest.mark.parametrize("base, spared", list(zip(sim.SPARE_STRATEGIES.values(), sim.SPARE_STRATEGIES)))
def test_simulated_spares_beat_none_on_node_losses_and_change_nothing_without_them(base, spared):
    memory = dict(memory_interval_s=20.0, memory_stall_s=0.05)
    nodes_heavy = _scenario(2048, spares=2, mix=(0.1, 0.1, 0.8), **memory)
    without, with_spares = (sim.simulate(nodes_heavy, k, runs=30, seed=2) for k in (base, spared))
    assert with_spares["goodput"] > without["goodput"] + 0.02
    assert with_spares["restarts"] < without["restarts"] / 3
    # No node losses: nothing for a spare to take, the same job to the second.
    no_nodes = _scenario(2048, spares=2, mix=(0.5, 0.5, 0.0), **memory)
    assert _without_spare_keys(sim.simulate(no_nodes, spared, runs=10, seed=2)) == sim.simulate(
        no_nodes, base, runs=10, seed=2
    )


def test_a_lost_pod_0_is_a_job_level_restart_whatever_the_spares():
    # One node: every node loss is pod 0's, and plenty of spares change nothing.
    alone = _scenario(1, spares=4, mix=(0.0, 0.0, 1.0), node_mtbf_h=50.0)
    result = sim.simulate(alone, "in-job+spares", runs=10, seed=4)
    assert result["failures_per_run"] > 20  # enough node losses to have gained from a spare
    assert _without_spare_keys(result) == sim.simulate(alone, "in-job", runs=10, seed=4)
    # Four nodes: a quarter of the node losses are pod 0's and take no spare.
    four = _scenario(4, spares=8, mix=(0.0, 0.0, 1.0), node_mtbf_h=10.0, horizon_h=4000, replacement_s=60.0)
    tally = sim.simulate_run(four, "in-job+spares", np.random.default_rng(5))
    assert tally.failures > 1000 and tally.spare_misses == 0
    assert tally.spare_losses / tally.failures == pytest.approx(0.75, abs=0.04)


@pytest.mark.parametrize("spares, replacement_s", [(1, 600.0), (2, 600.0), (1, 3600.0)])
@pytest.mark.parametrize("nodes", [512, 2048])
@pytest.mark.parametrize("strategy", list(sim.SPARE_STRATEGIES))
def test_spares_simulated_agree_with_their_closed_form(strategy, nodes, spares, replacement_s):
    s = _scenario(nodes, spares=spares, replacement_s=replacement_s, memory_interval_s=20.0, memory_stall_s=0.05)
    result = sim.simulate(s, strategy, runs=60, seed=1)
    assert result["goodput"] == pytest.approx(sim.analytic(s, strategy), rel=0.01)
    # Losses that find no spare take none, so the share without one is Erlang's loss formula,
    # which the Poisson tail bounds from above; for one spare, B = m / (1 + m).
    m = s.busy_spares_mean
    bound = gm.p_no_spare(spares, m)
    erlang = m / (1 + m) if spares == 1 else m**2 / 2 / (1 + m + m**2 / 2)
    assert result["p_no_spare"] == pytest.approx(erlang, abs=0.006)
    assert erlang <= bound
    if (spares, replacement_s, nodes) == (1, 3600.0, 2048):  # m = 0.216: B = 0.177, the tail 0.194
        assert result["p_no_spare"] < bound - 0.01


def test_the_low_end_of_a_range_is_the_same_job_at_rscs_rate_and_slower_recoveries():
    s = _scenario(2048, node_mtbf_low_h=gm.rsc_node_mtbf_hours(8), recovery_range=3.0, replacement_s=600.0)
    low = s.low_end()
    # RSC-1: 6.50 failures per 1,000 node-days -> 1,000 x 24 / 6.5 = 3,692.3 h per node of 8 GPUs.
    assert low.node_mtbf_h == pytest.approx(3692.3, abs=0.1) and gm.rsc_gpu_mtbf_hours() == pytest.approx(
        29538.5, abs=0.1
    )
    assert low.recovery_s == {k: 3 * v for k, v in s.recovery_s.items()} and low.replacement_s == 1800.0
    assert (low.interval_s, low.stall_s, low.write_s, low.nodes) == (s.interval_s, s.stall_s, s.write_s, s.nodes)
    assert (
        sim.simulate(low, "in-job", runs=20, seed=2)["goodput"] < sim.simulate(s, "in-job", runs=20, seed=2)["goodput"]
    )
    # Nothing to widen: the low end is the scenario itself.
    assert _scenario(64).low_end() == _scenario(64)


def _simulate_cli(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "simulate",
            "--nodes",
            "512",
            "--runs",
            "5",
            "--out",
            str(out),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


def test_every_simulated_figure_has_its_range_and_its_inputs_sources(tmp_path):
    proc, data = _simulate_cli(tmp_path)
    for r in data["rows"]:
        assert r["goodput_low"] < r["goodput"] and r["goodput_mid"] == pytest.approx(
            (r["goodput_low"] + r["goodput"]) / 2
        )
        assert f"{r['goodput_low']:.4f}-{r['goodput']:.4f} {r['goodput_mid']:>7.4f}" in proc.stdout
    inputs = data["inputs"]
    assert "Llama 3" in inputs["failure rate"] and "RSC-1" in inputs["failure rate"]
    assert "in_job assumed (120 s)" in inputs["recovery times"] and "the low end 3x" in inputs["recovery times"]
    assert inputs["failure classes"].startswith("assumed") and "write assumed" in inputs["checkpoint stall and write"]
    assert "judge a target at the middle" in proc.stdout and "  recovery times: " in proc.stdout
    # Measured recovery times are named as such; a rate the user gives is theirs, and with
    # --recovery-range 1 nothing is widened: the range closes on the figure.
    bench = REPO / "docs" / "benchmarks" / "recovery.json"
    _, measured = _simulate_cli(
        tmp_path,
        "--recovery-from-bench",
        str(bench),
        "--node-mtbf-hours",
        "4000",
        "--recovery-range",
        "1",
        "--ckpt-write-s",
        "30",
    )
    assert f"in_job measured ({bench})" in measured["inputs"]["recovery times"]
    _, given = _simulate_cli(tmp_path, "--recovery-s", "in_job=90")
    assert "in_job given, job assumed (600 s)" in given["inputs"]["recovery times"]
    assert (
        measured["inputs"]["failure rate"].startswith("given")
        and "write given" in measured["inputs"]["checkpoint stall and write"]
    )
    assert all(r["goodput_low"] == r["goodput"] for r in measured["rows"])
    bad = subprocess.run(
        [sys.executable, "-m", "resilient_fsdp.cli", "simulate", "--nodes", "8", "--recovery-range", "0.5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        bad.returncode == 2 and "--recovery-range 0.5: give 1 or more" in bad.stderr and "Traceback" not in bad.stderr
    )


def test_simulate_command_adds_the_spare_strategies(tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "simulate",
            "--nodes",
            "512,2048",
            "--runs",
            "3",
            "--memory-stall-s",
            "0.5",
            "--spares",
            "auto",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["nodes"], r["strategy"]) for r in rows} == {
        (n, k) for n in (512, 2048) for k in (*sim.STRATEGIES, sim.MEMORY_STRATEGY, *sim.SPARE_STRATEGIES)
    }
    spares = {r["nodes"]: r["spares"] for r in rows if r["strategy"] == "in-job+spares"}
    assert spares == {512: 1, 2048: 2}  # the advisor's recommendation per size
    assert all(r["replacement_s"] == 600 for r in rows if "spares" in r)
    assert "in-job+memory+spares" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "resilient_fsdp.cli", "simulate", "--nodes", "8", "--spares", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "--spares" in bad.stderr


def test_the_docs_spare_rows_are_the_simulations():
    text = (REPO / "docs" / "goodput.md").read_text()
    summary = (REPO / "docs" / "benchmarks.md").read_text()
    for n in (512, 2048):
        rows = json.loads((REPO / "docs" / "benchmarks" / f"simulate-spares-{n}.json").read_text())["rows"]
        for r in rows:
            if r["strategy"] in sim.SPARE_STRATEGIES:
                line = next(
                    ln for ln in text.splitlines() if ln.startswith(f"| {n} |") and f"| {r['strategy']} |" in ln
                )
                assert f"{r['goodput']:.4f}" in line and f"| {r['spares']} |" in line, line
                assert f"| {r['goodput_low']:.4f}-{r['goodput']:.4f} | {r['goodput_mid']:.4f} |" in line, line
    top = json.loads((REPO / "docs" / "benchmarks" / "simulate-spares-2048.json").read_text())["rows"]
    best = next(r for r in top if r["strategy"] == "in-job+memory+spares")
    row = next(ln for ln in summary.splitlines() if ln.startswith("| [simulated goodput, 70b at 2,048 nodes]"))
    assert f"middle of the range **{best['goodput_mid']:.3f}**" in row
    assert f"low end {best['goodput_low']:.3f}" in row and f"high end {best['goodput']:.3f}" in row
    verdict = row.rsplit("|", 2)[-2]
    assert verdict.strip().startswith("met" if best["goodput_mid"] >= 0.97 else "missed"), verdict


# ---- the run report -------------------------------------------------------------------------


@pytest.mark.extended
def test_report_of_a_real_run_with_faults(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_local(
        run_dir,
        nodes=2,
        nproc=2,
        overrides=[
            "train.steps=16",
            "checkpoint.interval_steps=4",
            "resilience.launcher.workers_stop_timeout_s=2",
            "resilience.hang_detection.workload_check_interval_s=0.5",
            "resilience.hang_detection.learn_timeouts=false",
        ],
        extra=["--inject=sigkill@9:rank=3"],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    png, parts_json = tmp_path / "report.png", tmp_path / "parts.json"
    rep = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "report",
            "--run-dir",
            str(run_dir),
            "--out",
            str(png),
            "--json",
            str(parts_json),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rep.returncode == 0, rep.stderr
    summary = read_summary(run_dir)
    parts = json.loads(parts_json.read_text())
    assert parts["goodput"] == pytest.approx(summary["goodput"])
    assert f"goodput {summary['goodput']:.4f}" in rep.stdout
    assert sum(
        parts[k] for k in ("productive_s", "checkpoint_stalls_s", "lost_work_s", "recovery_s", "other_s")
    ) == pytest.approx(parts["wall_s"])
    assert parts["recovery_s"] == pytest.approx(summary["recoveries"][0]["recovery_s"])
    assert parts["lost_work_s"] > 0  # the work since step 8's checkpoint was trained again
    assert "sigkill@9:rank=3" in rep.stdout and "in_job" in rep.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_report_names_what_is_missing(tmp_path):
    rep = subprocess.run(
        [sys.executable, "-m", "resilient_fsdp.cli", "report", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rep.returncode == 2 and "--run-dir" in rep.stderr and "summary.json not found" in rep.stderr


def test_the_local_measurements_docs_goodput_quotes_are_the_benchmarks_results(tmp_path):
    """goodput.md quotes this machine's figures next to its at-scale assumptions: each must be
    the one the benchmark files hold, and the simulation it describes must give its range."""
    text = (REPO / "docs" / "goodput.md").read_text()
    recovery = json.loads((REPO / "docs" / "benchmarks" / "recovery.json").read_text())
    checkpoint = json.loads((REPO / "docs" / "benchmarks" / "checkpoint.json").read_text())
    for row, layer in (
        ("recovery: in-process", "in_process"),
        ("recovery: in-job", "in_job"),
        ("recovery: job level", "full_relaunch"),
    ):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {row} |"))
        quoted = float(re.search(r"Measured locally[^:]*: ([\d.]+) s", line)[1])
        assert quoted == round(recovery[layer]["recovery_s_median"], 2), row
    stall = next(ln for ln in text.splitlines() if ln.startswith("| checkpoint stall delta |"))
    assert f"{checkpoint['async']['stall_s']:.2f} s for a 1.6 GB state" in stall
    low, high = map(float, re.search(r"\((0\.\d+)-(0\.\d+) at 2,048\s+nodes\)", text).groups())
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "simulate",
            "--nodes",
            "2048",
            "--runs",
            "200",
            "--seed",
            "0",
            "--recovery-from-bench",
            str(REPO / "docs" / "benchmarks" / "recovery.json"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    goodputs = [round(r["goodput"], 4) for r in json.loads(out.read_text())["rows"]]
    assert (min(goodputs), max(goodputs)) == (low, high)


def test_stragglers_and_silent_corruption_cost_what_their_published_rates_say_and_detection_wins_it_back():
    """Unmitigated, stragglers take Falcon's published inflation of a job's time and silent
    corruption its share of Llama 3's interruptions, each costing a day of training; found and
    replaced, or caught by replica checks, each costs its detection and an in-job restart."""
    job_mtbf_s = 10 * gm.HOUR
    c = gm.slow_and_silent(
        job_mtbf_s, find_s=100, replace_s=121, check_interval_s=500, check_cost=0.001, rollback_s=620, job_restart_s=600
    )
    assert c.stragglers_unmitigated == pytest.approx(1 - 1 / gm.FALCON_JCT_INFLATION)
    episodes_per_s = c.stragglers_unmitigated / (gm.STRAGGLER_EPISODE_H * gm.HOUR * (1 - 1 / gm.STRAGGLER_SLOWDOWN))
    assert c.stragglers_replaced == pytest.approx(episodes_per_s * (100 * (1 - 1 / gm.STRAGGLER_SLOWDOWN) + 121))
    sdc_rate = gm.LLAMA3_SDC_SHARE / job_mtbf_s
    assert c.sdc_unchecked == pytest.approx(sdc_rate * (gm.SDC_UNNOTICED_H * gm.HOUR + 600))
    assert c.sdc_checked == pytest.approx(0.001 + sdc_rate * (250 + 620))
    assert c.stragglers_replaced < c.stragglers_unmitigated and c.sdc_checked < c.sdc_unchecked
    # A job that fails more often meets more corruption; the checks' own cost does not grow with it.
    busy = gm.slow_and_silent(job_mtbf_s / 10, 100, 121, 500, 0.001, 620, 600)
    assert busy.sdc_unchecked == pytest.approx(10 * c.sdc_unchecked)


def test_simulate_and_advise_show_the_slow_and_silent_classes_with_their_sources(tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "simulate",
            "--nodes",
            "8,2048",
            "--runs",
            "2",
            "--step-s",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    slow = {r["nodes"]: r for r in json.loads(out.read_text())["slow_and_silent"]}
    assert slow[2048]["sdc_unchecked"] > slow[8]["sdc_unchecked"]  # more nodes, more corruption met
    assert "2048 nodes: stragglers 25.37% ->" in proc.stdout
    assert (
        "published: Falcon (Wu et al., 2024)" in proc.stdout
        and "found after 150 s (assumed (default 150.0))" in proc.stdout
        and "steps of 4 s" in proc.stdout
    )
    assert "published: Llama 3 (Meta, 2024): 1.4%" in proc.stdout
    parser, advice = argparse.ArgumentParser(), io.StringIO()
    adv.add_parser(parser.add_subparsers())
    args = parser.parse_args(["advise", "--nodes", "128", "--instance", "p5.48xlarge", "--preset", "70b"])
    assert adv.main(args, out=advice) == 0
    text = advice.getvalue()
    assert "stragglers" in text and "with resilience.stragglers.action=replace and a standby pod" in text
    assert "with resilience.sdc.interval_steps=100 (needs HSDP: --shard-group-size)" in text
    bad = subprocess.run(
        [sys.executable, "-m", "resilient_fsdp.cli", "simulate", "--straggler-find-s", "-5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--straggler-find-s 0 or more" in bad.stderr and "Traceback" not in bad.stderr
