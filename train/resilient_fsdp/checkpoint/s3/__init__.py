"""The S3 tier: durable copies of committed checkpoints, and restore from them.

Layout under ``checkpoint.s3.uri`` (``s3://bucket/prefix``) mirrors ``checkpoint.dir``::

    prefix/step_00000040/<data files>   one object per local file, same relative names
    prefix/step_00000040/COMPLETE       uploaded last: the local manifest plus the file list

Upload: after a checkpoint commits on shared storage, rank 0 alone hands it to an
:class:`.uploader.Uploader`, whose thread sends the data files with boto3's managed transfer
(multipart, parallel requests, botocore retries) and then the ``COMPLETE`` marker. A prefix without a marker
is never taken for a checkpoint, so an upload cut off anywhere leaves nothing a restore would
load. Retention under the prefix runs only after a newer checkpoint is complete there and deletes
each victim's marker before its data, so a concurrent reader never sees a marker without its files.

Restore: :func:`.transfer.download_checkpoint` writes into ``step_N.incomplete-<id>`` and commits
through :mod:`..store` (marker, fsync, atomic rename), exactly like a freshly written checkpoint.

boto3 is imported inside functions: ``resilient-fsdp config`` and the trainer without an S3 tier
never pay for it.

Modules: ``client`` (the URI, the boto3 client and transfer settings, errors, the start-up
check), ``remote`` (what is under the prefix, and retention there), ``transfer`` (moving one
checkpoint up or down), ``uploader`` (each rank's background uploads), ``restore`` (the restore at
start, split across every rank).
"""
