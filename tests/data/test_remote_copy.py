"""An ``s3://`` ``data.path`` (a real S3 API over HTTP on loopback): rank 0 copies it once,
verified, while the other ranks wait; later starts reuse the copy; a damaged object is refused and
data prepared again replaces the copy without deleting the old one."""

from __future__ import annotations

import threading

import pytest

from resilient_fsdp.config import ConfigError, S3Config
from resilient_fsdp.data import remote_copy, token_files
from resilient_fsdp.data.prepare import prepare
from tests.data.corpus import documents, train_tokenizer, write_jsonl
from tests.support import read_summary, run_trainer


def upload(s3, directory, prefix):
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        s3.client.upload_file(str(f), s3.bucket, f"{prefix}/{f.relative_to(directory)}")


@pytest.fixture
def prepared(tmp_path):
    docs = documents(40)
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", docs)
    prepare([str(write_jsonl(tmp_path / "a.jsonl", docs))], str(tokenizer), tmp_path / "a", progress=False)
    prepare([str(write_jsonl(tmp_path / "b.jsonl", docs[::-1]))], str(tokenizer), tmp_path / "b", progress=False)
    return tmp_path / "a", tmp_path / "b"


def test_rank_zero_copies_once_the_others_wait_and_later_starts_reuse_it(prepared, tmp_path, s3):
    first, _ = prepared
    upload(s3, first, "data/text")
    settings, cache = S3Config(endpoint_url=s3.endpoint), tmp_path / "cache"
    said, waited = [], {}
    waiter = threading.Thread(
        target=lambda: waited.setdefault(
            "path", remote_copy.local_copy(s3.uri("data/text"), cache, settings, rank=1, say=said.append, poll_s=0.05)
        )
    )
    waiter.start()
    copied = remote_copy.local_copy(s3.uri("data/text"), cache, settings, rank=0, say=said.append)
    waiter.join(timeout=30)
    assert waited["path"] == copied == cache / s3.bucket / "data/text"
    for name in ("tokens.bin", "tokens.json", "tokenizer/tokenizer.json"):
        assert (copied / name).read_bytes() == (first / name).read_bytes()
    assert any("checksum verified" in m for m in said), said
    # A later start finds the copy: the bucket's tokens.bin is not read again.
    s3.client.delete_object(Bucket=s3.bucket, Key="data/text/tokens.bin")
    assert remote_copy.local_copy(s3.uri("data/text"), cache, settings, rank=0, say=said.append) == copied


def test_a_damaged_object_is_refused_and_leaves_nothing(prepared, tmp_path, s3):
    first, second = prepared
    upload(s3, first, "data/text")
    s3.client.upload_file(str(second / "tokens.bin"), s3.bucket, "data/text/tokens.bin")  # another file, same size
    with pytest.raises(ConfigError, match=r"tokens.bin has CRC32C [0-9a-f]{8}, its tokens.json says [0-9a-f]{8}"):
        remote_copy.local_copy(
            s3.uri("data/text"), tmp_path / "cache", S3Config(endpoint_url=s3.endpoint), 0, say=print
        )
    assert [p.name for p in (tmp_path / "cache" / s3.bucket / "data").iterdir()] == []


def test_data_prepared_again_replaces_the_copy_and_keeps_the_old_one_aside(prepared, tmp_path, s3):
    first, second = prepared
    settings, cache = S3Config(endpoint_url=s3.endpoint), tmp_path / "cache"
    upload(s3, first, "data/text")
    copied = remote_copy.local_copy(s3.uri("data/text"), cache, settings, 0, say=print)
    upload(s3, second, "data/text")
    assert remote_copy.local_copy(s3.uri("data/text"), cache, settings, 0, say=print) == copied
    assert (copied / "tokens.bin").read_bytes() == (second / "tokens.bin").read_bytes()
    (aside,) = copied.parent.glob("text.replaced-*")
    assert (aside / "tokens.bin").read_bytes() == (first / "tokens.bin").read_bytes()


def test_a_prefix_without_prepared_data_names_the_upload(tmp_path, s3):
    with pytest.raises(
        ConfigError,
        match=r"no tokens.json there \(NoSuchKey\); upload the directory .* aws s3 cp "
        r"--recursive DIR s3://.*/nothing/",
    ):
        remote_copy.local_copy(s3.uri("nothing"), tmp_path, S3Config(endpoint_url=s3.endpoint), 0, say=print)
    with pytest.raises(
        ConfigError,
        match=r"data.path='s3://no-such-bucket-here/x': no tokens.json there "
        r"\(NoSuchBucket\)",
    ):
        remote_copy.local_copy("s3://no-such-bucket-here/x", tmp_path, S3Config(endpoint_url=s3.endpoint), 0, say=print)


def test_a_job_trains_on_an_s3_data_path(prepared, tmp_path, s3):
    first, _ = prepared
    upload(s3, first, "data/text")
    run_dir = tmp_path / "run"
    out = run_trainer(
        run_dir,
        [
            f"checkpoint.s3.endpoint_url={s3.endpoint}",
            "data.source=tokens",
            f"data.path={s3.uri('data/text')}",
            "model.vocab_size=300",
            "train.steps=3",
        ],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert read_summary(run_dir)["final_step"] == 3
    assert (run_dir / "data" / s3.bucket / "data/text" / token_files.META).is_file()
    assert (run_dir / "model" / "tokenizer" / "tokenizer.json").read_bytes() == (
        first / "tokenizer" / "tokenizer.json"
    ).read_bytes()


def test_a_cache_directory_the_pods_user_cannot_create_names_the_key(prepared, s3, request):
    """As the chart's UID 10001 under a root-owned directory (a new FSx file system's root)."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    first, _ = prepared
    upload(s3, first, "data/text")
    root = Path(tempfile.mkdtemp(prefix="resilient-fsdp-fsx-"))  # pytest's tmp_path is root-only (0700)
    root.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    code = (
        "from resilient_fsdp.config import S3Config\n"
        "from resilient_fsdp.data import remote_copy\n"
        f"remote_copy.local_copy({s3.uri('data/text')!r}, __import__('pathlib').Path({str(root / 'cache')!r}), "
        f"S3Config(endpoint_url={s3.endpoint!r}), 0, say=print)\n"
    )
    out = subprocess.run(
        ["setpriv", "--reuid=10001", "--regid=10001", "--clear-groups", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env=dict(os.environ),
    )
    assert out.returncode != 0
    assert f"data.cache_dir: cannot create {root / 'cache' / s3.bucket / 'data'} as uid 10001" in out.stderr
    assert "leave data.cache_dir unset" in out.stderr
