"""The S3 tier: durable copies of committed checkpoints under ``checkpoint.s3.uri``, laid out
as ``checkpoint.dir`` is, and restore from them. A prefix without its ``COMPLETE`` marker (uploaded
last) is never taken for a checkpoint, so an upload cut off anywhere leaves nothing a restore loads.

- ``client``: the URI, the boto3 client and transfer settings, errors, the start-up check;
- ``remote``: what is under the prefix, and retention there;
- ``transfer``: moving one checkpoint up or down (a download commits through :mod:`..store`);
- ``uploader``: each rank's background uploads;
- ``restore``: the restore at start, split across every rank.
"""
