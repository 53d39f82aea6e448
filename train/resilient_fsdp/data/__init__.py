"""Training data: text tokenized once into a token file, and that file where the ranks read it.

- ``token_files``: the prepared directory's format, found from ``data.path`` and checked;
- ``remote_copy``: an ``s3://`` ``data.path`` copied once to the shared volume, verified;
- ``sources``: documents from local files or an ``s3://`` prefix (JSONL, text, Parquet);
- ``tokenizer``: a ``tokenizer.json`` or a Hugging Face tokenizer directory, and its hash;
- ``prepare``: ``resilient-fsdp data prepare``: documents through the tokenizer, to disk;
- ``commands``: the ``data`` command's arguments.

The pod side is ``token_files`` and ``remote_copy``; the rest runs on a workstation (the
``data`` extra: ``tokenizers``, ``pyarrow``).
"""
