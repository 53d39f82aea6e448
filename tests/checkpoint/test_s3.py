"""The S3 tier against moto's standalone server: marker last, byte-exact restore, partial uploads,
retention, the sweep of marker-less prefixes, the bounded backlog during an outage, start-up checks and the operator commands."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from resilient_fsdp.checkpoint import store
from resilient_fsdp.checkpoint.s3 import client as s3_client
from resilient_fsdp.checkpoint.s3 import remote as s3_remote
from resilient_fsdp.checkpoint.s3 import transfer as s3_transfer
from resilient_fsdp.checkpoint.s3 import uploader as s3_uploader
from resilient_fsdp.cli import main as cli_main
from resilient_fsdp.config import ConfigError, S3Config, load_config

MIB = 1024 * 1024


def make_checkpoint(root, step, sizes=(6 * MIB, 100_000, 0), world_size=1):
    """A committed checkpoint of random files, as the trainer's commit leaves it."""
    partial = root / store.partial_name(step, "00c0ffee")
    partial.mkdir(parents=True)
    for i, size in enumerate(sizes):
        (partial / f"__{i}_0.distcp").write_bytes(os.urandom(size))
    return store.commit(partial, {"step": step, "world_size": world_size, "created_unix": time.time()})


def s3_config(s3, prefix, **kw):
    fast = {
        "connect_timeout_s": 1,
        "read_timeout_s": 2,
        "max_attempts": 2,
        "retry_backoff_s": 0.3,
        "retry_backoff_max_s": 1,
        "multipart_threshold_mb": 5,
        "multipart_chunksize_mb": 5,
    }
    return S3Config(uri=s3.uri(prefix), endpoint_url=s3.endpoint, **{**fast, **kw})


class Calls:
    """The S3 operations a client sends, in order, with their keys (botocore's event hooks)."""

    def __init__(self, client):
        self.seen: list[tuple[str, str]] = []
        client.meta.events.register("before-parameter-build.s3", self._record)

    def _record(self, model, params, **_):
        self.seen.append((model.name, params.get("Key", "")))

    def ops(self, *names):
        return [(op, key) for op, key in self.seen if op in names]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("checkpoint.s3.uri=bucket/prefix", "checkpoint.s3.uri='bucket/prefix' must look like s3://bucket/prefix"),
        ("checkpoint.s3.uri=s3://Bad_Bucket/x", "'Bad_Bucket' is not a valid bucket name"),
        (
            "checkpoint.s3.endpoint_url=localhost:9000",
            "checkpoint.s3.endpoint_url='localhost:9000' must look like http",
        ),
        (
            "checkpoint.s3.multipart_chunksize_mb=1",
            "checkpoint.s3.multipart_chunksize_mb: Input should be greater than or equal to 5",
        ),
        ("checkpoint.s3.keep_lst=2", "did you mean 'checkpoint.s3.keep_last'"),
        (
            "checkpoint.s3.retry_backoff_s=500",
            "checkpoint.s3.retry_backoff_s=500.0 must not exceed checkpoint.s3.retry_backoff_max_s",
        ),
    ],
)
def test_bad_s3_settings_name_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["checkpoint.s3.uri=s3://bucket/prefix", override])
    assert expected in str(info.value)


def test_upload_sends_the_marker_last_and_a_restore_is_byte_exact(s3, tmp_path):
    cfg = s3_config(s3, "run/ckpts")
    loc = s3_client.parse_s3_uri(cfg.uri)
    ckpt = make_checkpoint(tmp_path / "local", 40)
    client = s3_client.make_client(cfg)
    calls = Calls(client)
    result = s3_transfer.upload_checkpoint(client, cfg, loc, ckpt)
    assert result == {"step": 40, "bytes": 6 * MIB + 100_000, "skipped_files": 0, "status": "uploaded"}
    writes = calls.ops("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload")
    assert writes[-1] == ("PutObject", "run/ckpts/step_00000040/COMPLETE")  # nothing after the marker
    assert ("CreateMultipartUpload", "run/ckpts/step_00000040/__0_0.distcp") in writes  # 6 MiB > 5 MiB threshold
    assert s3.keys("run/") == ["run/ckpts/step_00000040/COMPLETE"] + [
        f"run/ckpts/step_00000040/__{i}_0.distcp" for i in range(3)
    ]
    # Uploading the same commit again sends no data.
    calls.seen.clear()
    assert s3_transfer.upload_checkpoint(client, cfg, loc, ckpt)["status"] == "already-there"
    assert not calls.ops("PutObject", "UploadPart")

    found = s3_remote.newest_complete(client, loc)
    restored = s3_transfer.download_checkpoint(client, cfg, loc, *found, tmp_path / "empty")
    assert restored.path == tmp_path / "empty" / "step_00000040"
    assert [p.name for p in (tmp_path / "empty").iterdir()] == ["step_00000040"]  # no partial left behind
    for f in ckpt.glob("*.distcp"):
        assert (restored.path / f.name).read_bytes() == f.read_bytes()
    local, remote = store.read_manifest(ckpt), store.read_manifest(restored.path)
    assert (
        s3_remote.checkpoint_id(local) == s3_remote.checkpoint_id(remote) and remote["files"]["__1_0.distcp"] == 100_000
    )


def test_a_cut_off_upload_is_never_restored_and_its_retry_sends_only_what_is_missing(s3, tmp_path):
    cfg = s3_config(s3, "job")
    loc, client = s3_client.parse_s3_uri(cfg.uri), s3_client.make_client(cfg)
    s3_transfer.upload_checkpoint(client, cfg, loc, make_checkpoint(tmp_path / "local", 4))
    step8 = make_checkpoint(tmp_path / "local", 8)
    ident = s3_remote.checkpoint_id(store.read_manifest(step8))
    # What an upload cut off after one file leaves: that file with its checkpoint id, no marker;
    # and a file of another commit of the same step, which must not be kept.
    client.put_object(
        Bucket=s3.bucket,
        Key="job/step_00000008/__1_0.distcp",
        Body=(step8 / "__1_0.distcp").read_bytes(),
        Metadata={s3_remote.ID_METADATA: ident},
    )
    client.put_object(
        Bucket=s3.bucket,
        Key="job/step_00000008/__2_0.distcp",
        Body=b"",
        Metadata={s3_remote.ID_METADATA: "another-commit"},
    )
    said = []
    remote, manifest = s3_remote.newest_complete(client, loc, say=said.append)
    assert remote.step == 4 and said == [
        f"skipping s3://{s3.bucket}/job/step_00000008/: no COMPLETE marker (an upload in progress or cut off)"
    ]
    assert (
        cli_main(
            [
                "checkpoints",
                "pull",
                "--uri",
                cfg.uri,
                "--endpoint-url",
                s3.endpoint,
                "--set",
                f"checkpoint.dir={tmp_path / 'pulled'}",
            ]
        )
        == 0
    )
    assert [p.name for p in (tmp_path / "pulled").iterdir()] == ["step_00000004"]

    calls = Calls(client)
    result = s3_transfer.upload_checkpoint(client, cfg, loc, step8, resume=True)
    assert result["status"] == "uploaded" and result["skipped_files"] == 1
    sent = {key.rsplit("/", 1)[1] for op, key in calls.ops("PutObject", "CreateMultipartUpload")}
    assert sent == {"__0_0.distcp", "__2_0.distcp", "COMPLETE"}
    assert s3_remote.newest_complete(client, loc)[0].step == 8


def test_retention_keeps_the_newest_complete_ones_and_never_touches_incomplete_ones(s3, tmp_path):
    cfg = s3_config(s3, "r")
    loc, client = s3_client.parse_s3_uri(cfg.uri), s3_client.make_client(cfg)
    for step in (2, 4, 6, 8):
        s3_transfer.upload_checkpoint(client, cfg, loc, make_checkpoint(tmp_path, step, sizes=(1000,)))
    client.put_object(Bucket=s3.bucket, Key="r/step_00000001/__0_0.distcp", Body=b"cut off")
    assert s3_remote.apply_remote_retention(client, loc, keep_last=0) == []  # 0 keeps all
    calls = Calls(client)
    assert s3_remote.apply_remote_retention(client, loc, keep_last=2) == [2, 4]
    assert [r.step for r in s3_remote.list_remote(client, loc) if r.complete] == [6, 8]
    assert "r/step_00000001/__0_0.distcp" in s3.keys("r/")
    # Each victim's marker goes before its data: never a marker without its files.
    deletes = [(op, key) for op, key in calls.seen if op.startswith("Delete")]
    assert deletes == [
        ("DeleteObject", "r/step_00000002/COMPLETE"),
        ("DeleteObjects", ""),
        ("DeleteObject", "r/step_00000004/COMPLETE"),
        ("DeleteObjects", ""),
    ]
    # With one complete checkpoint left, no keep_last deletes it.
    for step in (6,):
        client.delete_object(Bucket=s3.bucket, Key=f"r/step_{step:08d}/COMPLETE")
    assert s3_remote.apply_remote_retention(client, loc, keep_last=1) == []
    assert s3_remote.newest_complete(client, loc)[0].step == 8


def test_marker_less_prefixes_older_than_the_newest_marked_one_are_swept(s3, tmp_path):
    cfg = s3_config(s3, "torn", keep_last=1)
    loc, client = s3_client.parse_s3_uri(cfg.uri), s3_client.make_client(cfg)
    s3_transfer.upload_checkpoint(client, cfg, loc, make_checkpoint(tmp_path / "a", 2, sizes=(1000,)))
    # Torn uploads: data objects without a marker, older than the next marked checkpoint; and one
    # newer than it, which may be an upload in progress.
    for step in (1, 3, 4, 5, 6, 7):
        client.put_object(Bucket=s3.bucket, Key=f"torn/step_{step:08d}/__0_0.distcp", Body=b"cut off")
    client.put_object(Bucket=s3.bucket, Key="torn/step_00000099/__0_0.distcp", Body=b"in progress")
    assert s3_remote.sweep_torn_remote(client, loc) == [(1, 7)]  # only those older than step 2
    uploader = s3_uploader.Uploader(cfg)
    try:
        uploader.submit(8, make_checkpoint(tmp_path / "b", 8, sizes=(1000,)))
        assert uploader.drain(60)
        uploader.submit(9, make_checkpoint(tmp_path / "c", 9, sizes=(1000,)))
        assert uploader.drain(60)
    finally:
        uploader.close()
    events = [record for record, _ in uploader.take_events()]
    swept = [e["step"] for e in events if e["event"] == "s3_swept"]
    # At most SWEEP_CAP prefixes after each upload; the rest after the next one.
    assert swept == [3, 4, 5, 6, 7] and s3_remote.SWEEP_CAP == 4
    remote = s3_remote.list_remote(client, loc)
    assert [(r.step, r.complete) for r in remote] == [(9, True), (99, False)]  # retention still keeps 1
    assert [e["deleted"] for e in events if e["event"] == "s3_retention"] == [[2], [8]]


def test_during_an_outage_the_backlog_stays_bounded_and_held_checkpoints_survive_local_retention(s3, tmp_path):
    cfg = s3_config(s3, "outage", max_pending=2, keep_last=0)
    root = tmp_path / "ckpts"
    s3.pause()
    uploader = s3_uploader.Uploader(cfg)
    try:
        for step in (1, 2, 3, 4, 5):
            uploader.submit(step, make_checkpoint(root, step, sizes=(200_000,)))
        time.sleep(0.5)
        # Step 1 is in flight (hanging), 2 and 3 were dropped for 4 and 5.
        assert uploader.pending() == [1, 4, 5] and uploader.summary()["superseded"] == [2, 3]
        deleted = store.apply_retention(root, keep_last=1, held=uploader.holds)
        assert sorted(p.name for p in deleted) == ["step_00000002", "step_00000003"]
        assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000004", "step_00000005"]
        deadline = time.monotonic() + 30
        while uploader.summary()["failed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        # Step 1's attempt failed; back in the queue it is the oldest, so 4 and 5 supersede it.
        assert uploader.pending() == [4, 5] and uploader.summary()["superseded"] == [2, 3, 1]
        s3.resume()
        assert uploader.drain(60)
        status = uploader.summary()
    finally:
        s3.resume()
        uploader.close()
    assert status["uploaded"] == [4, 5] and status["pending"] == [] and status["failed"] >= 1
    assert "timeout" in status["last_error"].lower()
    events = [record["event"] for record, _ in uploader.take_events()]
    assert events.count("s3_superseded") == 3 and "s3_error" in events and events.count("s3_upload") == 2
    assert [r.step for r in s3_remote.list_remote(s3.client, s3_client.parse_s3_uri(cfg.uri)) if r.complete] == [4, 5]
    assert not uploader.holds(root / "step_00000001")  # released: local retention may take it now


def test_a_rank_that_cannot_upload_is_named_and_holds_at_most_max_awaiting_checkpoints(s3, tmp_path):
    # Two ranks: rank 1's S3 endpoint refuses connections, so its receipts never come.
    cfg = s3_config(s3, "lagging", max_awaiting=2, max_pending=8, keep_last=0)
    root = tmp_path / "ckpts"
    ckpts = {step: make_checkpoint(root, step, sizes=(200_000, 100_000), world_size=2) for step in (1, 2, 3, 4)}
    rank0 = s3_uploader.Uploader(cfg, rank=0, world_size=2)
    rank1 = s3_uploader.Uploader(dataclasses.replace(cfg, endpoint_url="http://127.0.0.1:9"), rank=1, world_size=2)
    try:
        for step, path in ckpts.items():
            rank0.submit(step, path)
            rank1.submit(step, path)
        deadline = time.monotonic() + 60
        while rank0.summary()["released"] != [1, 2] and time.monotonic() < deadline:
            time.sleep(0.2)
        lagging = rank0.summary()
        assert lagging["released"] == [1, 2] and lagging["pending"] == [3, 4], lagging
        # Rank 0 goes by the missing receipts; rank 1 counts a failure once its retries are spent.
        while rank1.summary()["failed"] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert lagging["lagging_ranks"] == [1] and rank1.summary()["failed"] >= 1
        assert not rank0.holds(ckpts[1]) and not rank0.holds(ckpts[2]) and rank0.holds(ckpts[4])
        deleted = store.apply_retention(root, keep_last=1, held=rank0.holds)
        assert sorted(p.name for p in deleted) == ["step_00000001", "step_00000002"]
        events = rank0.take_events()
        released = [(r, m) for r, m in events if r["event"] == "s3_released"]
        assert [r["step"] for r, _ in released] == [1, 2] and all(r["waiting_for"] == [1] for r, _ in released)
        assert "rank(s) 1 did not upload" in released[0][1] and "checkpoint.s3.max_awaiting=2" in released[0][1]
        assert [r["ranks"] for r, _ in events if r["event"] == "s3_lagging"] == [[1]]
        loc = s3_client.parse_s3_uri(cfg.uri)
        assert not [r.step for r in s3_remote.list_remote(s3.client, loc) if r.complete]  # nothing restorable
        # Rank 1 back (its process restarted with a working endpoint): the newest is marked.
        rank1.close()
        rank1 = s3_uploader.Uploader(cfg, rank=1, world_size=2)
        rank1.submit(4, ckpts[4])
        assert rank0.drain(60)
        status = rank0.summary()
    finally:
        rank0.close()
        rank1.close()
    assert status["uploaded"] == [4] and status["lagging_ranks"] == [] and status["pending"] == []
    assert [r.step for r in s3_remote.list_remote(s3.client, loc) if r.complete] == [4]
    assert [r["ranks"] for r, _ in rank0.take_events() if r["event"] == "s3_lagging"] == [[]]


def test_start_up_check_names_a_missing_bucket_and_missing_credentials(s3, monkeypatch):
    missing = S3Config(uri="s3://no-such-bucket-here/x", endpoint_url=s3.endpoint, max_attempts=1)
    assert "bucket 'no-such-bucket-here' does not exist" in s3_client.check_access(missing)
    assert s3_client.check_access(S3Config(uri=s3.uri("x"), endpoint_url=s3.endpoint)) is None
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert "found no credentials in its default chain" in s3_client.check_access(missing)


def test_operator_commands_list_push_and_pull(s3, tmp_path, capsys):
    local = tmp_path / "ckpts"
    for step in (3, 6):
        make_checkpoint(local, step, sizes=(300_000,))
    base = ["--uri", s3.uri("ops"), "--endpoint-url", s3.endpoint]
    assert cli_main(["checkpoints", "push", "--run-dir", str(local), *base]) == 0
    assert "pushed step 6" in capsys.readouterr().out
    assert cli_main(["checkpoints", "push", "--run-dir", str(local), *base]) == 0
    assert "already complete" in capsys.readouterr().out
    s3.client.put_object(Bucket=s3.bucket, Key="ops/step_00000009/__0_0.distcp", Body=b"partial")
    assert cli_main(["checkpoints", "list", "--run-dir", str(local), *base, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    rows = {r["step"]: r for r in listing["checkpoints"]}
    assert sorted(rows) == [3, 6, 9]
    assert listing["local_aside"] == {"superseded": [], "abandoned": [], "suspect": [], "deleting": []}
    assert "s3" not in rows[3] and rows[6]["s3"]["complete"] and not rows[9]["s3"]["complete"]
    assert "local" not in rows[9]
    assert cli_main(["checkpoints", "list", "--run-dir", str(local), *base]) == 0
    assert "INCOMPLETE" in capsys.readouterr().out
    assert cli_main(["checkpoints", "pull", "--set", f"checkpoint.dir={tmp_path / 'new'}", *base]) == 0
    assert "pulled step 6" in capsys.readouterr().out
    assert (tmp_path / "new" / "step_00000006" / "__0_0.distcp").read_bytes() == (
        local / "step_00000006" / "__0_0.distcp"
    ).read_bytes()
    assert cli_main(["checkpoints", "pull", "--step", "5", "--set", f"checkpoint.dir={tmp_path / 'new'}", *base]) == 1
    assert "no complete step 5" in capsys.readouterr().err
    # Without an S3 URI, the local checkpoints alone (push and pull still need one).
    assert cli_main(["checkpoints", "list", "--run-dir", str(local)]) == 0
    listed = capsys.readouterr().out
    assert "S3:" not in listed and [ln.split()[0] for ln in listed.splitlines()[2:]] == ["3", "6"]
    assert cli_main(["checkpoints", "push", "--run-dir", str(local)]) == 2
    assert "checkpoint.s3.uri is not set" in capsys.readouterr().err


def make_checksummed_checkpoint(root, step, sizes=(6 * MIB, 300_000)):
    """A committed checkpoint whose manifest holds checksums recorded while writing, as a job's does."""
    from resilient_fsdp.checkpoint import integrity

    partial = root / store.partial_name(step, "0000c0de")
    partial.mkdir(parents=True)
    recorder = integrity.Recorder()
    for i, size in enumerate(sizes):
        with integrity.HashingStream(open(partial / f"__{i}_0.distcp", "wb"), f"__{i}_0.distcp", recorder) as f:
            f.write(os.urandom(size))
    sums = {n: {**e, "writer": 0} for n, e in recorder.take().items()}
    return store.commit(partial, {"step": step, "world_size": 1, "created_unix": time.time(), "checksums": sums})


def test_uploads_ask_s3_for_checksums_and_a_download_is_resumed_and_verified(s3, tmp_path):
    cfg = s3_config(s3, "sum")
    loc, client = s3_client.parse_s3_uri(cfg.uri), s3_client.make_client(cfg)
    ckpt = make_checksummed_checkpoint(tmp_path / "local", 5)
    sent = []
    client.meta.events.register(
        "before-parameter-build.s3",
        lambda model, params, **_: sent.append((model.name, params.get("ChecksumAlgorithm"))),
    )
    s3_transfer.upload_checkpoint(client, cfg, loc, ckpt)
    assert {alg for op, alg in sent if op in ("CreateMultipartUpload", "PutObject") and alg} == {"CRC32"}
    remote, manifest = s3_remote.newest_complete(client, loc)
    # A download cut off after one file: the next one keeps it and fetches only the other.
    ident = s3_remote.checkpoint_id(manifest)
    partial, _ = s3_transfer.prepare_download(tmp_path / "dest", 5, ident, "uri")
    s3_transfer.download_files(client, cfg, loc, manifest, ["__1_0.distcp"], partial, verify=True)
    assert s3_transfer.prepare_download(tmp_path / "dest", 5, ident, "uri") == (partial, 1)
    calls = Calls(client)
    info = s3_transfer.download_checkpoint(client, cfg, loc, remote, manifest, tmp_path / "dest")
    fetched = {key.rsplit("/", 1)[1] for op, key in calls.ops("GetObject", "HeadObject")}
    assert fetched == {"__0_0.distcp"}
    assert (info.path / "__1_0.distcp").read_bytes() == (ckpt / "__1_0.distcp").read_bytes()
    # An object changed in S3 after it was uploaded (same size): the download names it and fails.
    body = bytearray((ckpt / "__1_0.distcp").read_bytes())
    body[1000] ^= 0x01
    client.put_object(
        Bucket=s3.bucket,
        Key="sum/step_00000005/__1_0.distcp",
        Body=bytes(body),
        Metadata={s3_remote.ID_METADATA: ident},
    )
    with pytest.raises(RuntimeError, match=r"step_00000005/__1_0.distcp: crc32c .*same size"):
        s3_transfer.download_checkpoint(client, cfg, loc, remote, manifest, tmp_path / "other")
