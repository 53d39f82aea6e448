"""``resilient-fsdp data prepare``: documents through a real tokenizer into the prepared directory
the trainer reads, from every input format; nothing half-written ever looks whole."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from resilient_fsdp.checkpoint.integrity import file_crc32c
from resilient_fsdp.config import ConfigError
from resilient_fsdp.data import token_files
from resilient_fsdp.data.prepare import prepare
from resilient_fsdp.train.data import TokenFile
from tests.data.corpus import documents, train_tokenizer, write_jsonl
from tests.support import REPO


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = documents(60)
    return docs, write_jsonl(root / "text.jsonl", docs), train_tokenizer(root / "tokenizer.json", docs)


def expected_tokens(tokenizer_path, docs) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    return [t for d in docs for t in [bos] + tok.encode(d, add_special_tokens=False).ids + [eos]]


def test_prepare_writes_each_document_between_separators_with_its_metadata(corpus, tmp_path):
    docs, text, tokenizer = corpus
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "data",
            "prepare",
            "--input",
            str(text),
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"prepared {len(docs)} documents" in out.stderr
    meta = token_files.read_meta(tmp_path / "data" / token_files.META)
    tokens = np.fromfile(tmp_path / "data" / token_files.TOKENS, dtype=meta.dtype)
    assert tokens.tolist() == expected_tokens(tokenizer, docs)
    assert meta.dtype == "uint16" and meta.num_documents == len(docs) and meta.num_tokens == len(tokens)
    assert meta.crc32c == file_crc32c(tmp_path / "data" / token_files.TOKENS)
    assert meta.eos_id == 2 and meta.bos_id == 1 and meta.vocab_size == 300
    assert (tmp_path / "data" / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    # The trainer reads the directory (or its tokens.bin) with the dtype it records, in windows of
    # seq_len + 1, and finds the tokenizer beside it either way.
    for named in (tmp_path / "data", tmp_path / "data" / token_files.TOKENS):
        ds = TokenFile(named, "uint32", seq_len=16, vocab_size=300)
        assert ds[1].tolist() == tokens[16:33].tolist() and ds.directory == tmp_path / "data"


def test_jsonl_gzip_text_and_parquet_give_the_same_tokens(corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs, text, tokenizer = corpus
    (tmp_path / "gz").mkdir()
    with gzip.open(tmp_path / "gz" / "text.jsonl.gz", "wt") as f:
        f.write(text.read_text())
    pq.write_table(pa.table({"body": docs}), tmp_path / "text.parquet", row_group_size=7)
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(d)
    prepare([str(tmp_path / "gz")], str(tokenizer), tmp_path / "a", progress=False)
    prepare([str(tmp_path / "text.parquet")], str(tokenizer), tmp_path / "b", text_field="body", progress=False)
    prepare([str(tmp_path / "txt")], str(tokenizer), tmp_path / "c", progress=False)
    tokens = [(tmp_path / d / "tokens.bin").read_bytes() for d in "abc"]
    assert tokens[0] == tokens[1] == tokens[2]
    assert np.frombuffer(tokens[0], dtype=np.uint16).tolist() == expected_tokens(tokenizer, docs)


def test_an_s3_prefix_is_read_over_http(corpus, tmp_path, s3):
    docs, text, tokenizer = corpus
    s3.client.upload_file(str(text), s3.bucket, "raw/part-0.jsonl")
    s3.client.put_object(Bucket=s3.bucket, Key="raw/notes.md", Body=b"not an input")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "data",
            "prepare",
            "--input",
            s3.uri("raw"),
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(tmp_path / "data"),
            "--endpoint-url",
            s3.endpoint,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    meta = token_files.read_meta(tmp_path / "data" / token_files.META)
    assert meta.sources == [s3.uri("raw/part-0.jsonl")] and meta.num_documents == len(docs)
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "data",
            "prepare",
            "--input",
            "s3://no-such-bucket-here/raw",
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(tmp_path / "other"),
            "--endpoint-url",
            s3.endpoint,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert missing.returncode == 1 and "error: NoSuchBucket" in missing.stderr
    assert "Traceback" not in missing.stderr and not (tmp_path / "other" / "tokens.json").exists()


def test_a_run_that_fails_midway_leaves_no_token_file_and_the_next_clears_its_scratch(corpus, tmp_path):
    docs, text, tokenizer = corpus
    broken = tmp_path / "broken.jsonl"
    broken.write_text(text.read_text() + '{"title": "no text here"}\n')
    with pytest.raises(
        ConfigError,
        match=r"broken.jsonl:61: no string field 'text' \(it has: title\); pass "
        r"--text-field",
    ):
        prepare([str(broken)], str(tokenizer), tmp_path / "data", progress=False)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == []
    # A killed run leaves its partial file; no reader takes it for data, the next run removes it.
    (tmp_path / "data" / "tokens.bin.partial-deadbeef").write_bytes(b"\0" * 10)
    with pytest.raises(ConfigError, match=r"tokens.bin.partial-deadbeef: a `data prepare` that did not finish"):
        TokenFile(tmp_path / "data", "uint16", 16)
    prepare([str(text)], str(tokenizer), tmp_path / "data", progress=False)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["tokenizer", "tokens.bin", "tokens.json"]


def test_an_s3_destination_is_refused_with_the_upload_to_run(corpus, tmp_path, capsys):
    from resilient_fsdp.cli import main as cli_main

    docs, text, tokenizer = corpus
    code = cli_main(
        ["data", "prepare", "--input", str(text), "--tokenizer", str(tokenizer), "--out", "s3://my-bucket/data/text"]
    )
    assert code == 2
    assert (
        "data prepare writes a local directory; write it there, then upload it (aws s3 cp --recursive DIR "
        "s3://my-bucket/data/text/) and set data.path=s3://my-bucket/data/text"
    ) in capsys.readouterr().err
    assert not (REPO / "s3:").exists()


def test_prepared_data_is_never_overwritten(corpus, tmp_path):
    docs, text, tokenizer = corpus
    prepare([str(text)], str(tokenizer), tmp_path / "data", progress=False)
    before = (tmp_path / "data" / "tokens.bin").read_bytes()
    with pytest.raises(ConfigError, match=r"already holds prepared data \(tokens.json\); name a new directory"):
        prepare([str(text)], str(tokenizer), tmp_path / "data", progress=False)
    assert (tmp_path / "data" / "tokens.bin").read_bytes() == before


def test_the_trainer_refuses_a_vocabulary_its_model_cannot_embed_and_a_cut_file(corpus, tmp_path):
    docs, text, tokenizer = corpus
    prepare([str(text)], str(tokenizer), tmp_path / "data", progress=False)
    with pytest.raises(
        ConfigError,
        match=r"tokenized with a vocabulary of 300 .* larger than model.preset=tiny's "
        r"256: set model.vocab_size=300",
    ):
        TokenFile(tmp_path / "data", "uint16", 16, vocab_size=256, model_name="model.preset=tiny")
    with open(tmp_path / "data" / "tokens.bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(
        ConfigError,
        match=r"has 1000 bytes, its tokens.json says \d+ tokens of uint16 .* the file "
        r"was cut or replaced",
    ):
        TokenFile(tmp_path / "data", "uint16", 16, vocab_size=300)


def test_a_tokenizer_without_a_known_separator_must_be_told_one(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[END]": 2}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    text = write_jsonl(tmp_path / "t.jsonl", ["a b"])
    with pytest.raises(ConfigError, match=r"no end-of-sequence token found .* --eos-token TOKEN"):
        prepare([str(text)], str(tmp_path / "tokenizer.json"), tmp_path / "data", progress=False)
    meta = prepare([str(text)], str(tmp_path / "tokenizer.json"), tmp_path / "data", eos_token="[END]", progress=False)
    assert meta.eos_id == 2 and meta.bos_id is None
    assert json.loads((tmp_path / "data" / "tokens.json").read_text())["num_tokens"] == 3
