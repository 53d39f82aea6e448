"""Training data: text tokenized once into a token file, and that file where the ranks read it.

- ``token_files``: the prepared directory's format (``tokens.bin`` and its metadata
  ``tokens.json``), found from ``data.path`` and checked against the model's vocabulary;
- ``remote_copy``: an ``s3://`` ``data.path`` copied once to the shared volume, verified,
  reused by every restart and later job;
- ``sources``: documents from local files or an ``s3://`` prefix (JSONL, plain text, Parquet);
- ``tokenizer``: a ``tokenizer.json`` or a local Hugging Face tokenizer directory, its hash and
  its document separator;
- ``prepare``: ``resilient-fsdp data prepare``: documents through the tokenizer into a
  prepared directory, written beside its final name and renamed;
- ``commands``: the ``data`` command's arguments.

The pod side is ``token_files`` and ``remote_copy``; the rest runs on a workstation (the
``data`` extra: ``tokenizers``, ``pyarrow``).
"""
