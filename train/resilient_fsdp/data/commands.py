"""``resilient-fsdp data prepare``: the command's arguments (the work is :mod:`.prepare`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data",
        help="prepare training data: text through a tokenizer into a token file",
        description="Prepare training data for data.source=tokens.",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    a = actions.add_parser(
        "prepare",
        help="tokenize JSONL, text or Parquet files (local or s3://) into a directory data.path takes",
        description="Tokenize documents into DIR/tokens.bin with DIR/tokens.json (dtype, counts, tokenizer hash, "
        "checksum) and DIR/tokenizer/; train with data.source=tokens data.path=DIR (docs/data.md).",
    )
    a.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help="files, directories or s3://bucket/prefix: .jsonl/.json (one object per line), .txt (one "
        "document per file), .parquet; .gz for JSON lines and text",
    )
    a.add_argument("--tokenizer", required=True, help="a tokenizer.json, or a local Hugging Face tokenizer directory")
    a.add_argument("--out", required=True, help="the directory to write (data.path); refused if it holds data")
    a.add_argument(
        "--text-field", default="text", help="the JSON field or Parquet column holding the text (default: text)"
    )
    a.add_argument("--eos-token", help="the token appended after each document (default: the tokenizer's)")
    a.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// inputs")
    a.add_argument("--region", help="AWS region of s3:// inputs")
    a.set_defaults(command="data", run=run)


def run(args: argparse.Namespace) -> int:
    from ..config import ConfigError, S3Config
    from .prepare import prepare

    def client():
        from ..checkpoint.s3.client import make_client

        return make_client(S3Config(endpoint_url=args.endpoint_url, region=args.region))

    if args.out.startswith("s3://"):
        raise ConfigError(
            f"--out {args.out}: data prepare writes a local directory; write it there, then upload it "
            f"(aws s3 cp --recursive DIR {args.out.rstrip('/')}/) and set data.path={args.out}"
        )
    try:
        prepare(
            args.input,
            args.tokenizer,
            Path(args.out),
            text_field=args.text_field,
            eos_token=args.eos_token,
            client_factory=client,
        )
    except ConfigError:
        raise
    except Exception as exc:  # S3 and file errors: one line naming what failed (S3's error code)
        from ..checkpoint.s3.client import describe_error

        print(f"error: {describe_error(exc)}", file=sys.stderr)
        return 1
    return 0
