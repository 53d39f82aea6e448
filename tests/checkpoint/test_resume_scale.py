"""What one resume reads, counted in one process (world size 1, gloo) and modelled for 1,024 ranks:
each checkpoint byte verified once per process, DCP's ``.metadata`` read once per load whatever
the world size, and the end-of-job parameter hash in bounded host blocks. No subprocesses."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.profiler import ProfilerActivity, profile

from resilient_fsdp.bench import resume_cost
from resilient_fsdp.checkpoint import integrity, resume, store
from resilient_fsdp.checkpoint.group import RankGroup
from resilient_fsdp.config import CheckpointConfig
from resilient_fsdp.train import metrics


@pytest.fixture
def group() -> RankGroup:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return RankGroup(0, 1, torch.device("cpu"))


@pytest.fixture
def crc_reads(monkeypatch) -> list:
    """The bytes of every file verification reads (integrity.file_crc32c still does the reading)."""
    read: list[int] = []
    real = integrity.file_crc32c

    def counted(path: Path) -> str:
        read.append(Path(path).stat().st_size)
        return real(path)

    monkeypatch.setattr(integrity, "file_crc32c", counted)
    monkeypatch.setattr(integrity, "verified_here", integrity.VerifiedHere())  # this test's own process memory
    return read


def synthetic_checkpoint(path: Path, sizes: dict[str, int], created: float) -> store.CheckpointInfo:
    path.mkdir(parents=True, exist_ok=True)
    checksums = {}
    for name, size in sizes.items():
        (path / name).write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
        checksums[name] = {"crc32c": integrity.file_crc32c(path / name), "bytes": size}
    manifest = {
        "step": 4,
        "created_unix": created,
        "job": "job-a",
        "world_size": 1,
        "mode": "async",
        "checksums": checksums,
    }
    return store.CheckpointInfo(4, path, manifest)


def test_a_checkpoint_is_read_to_verify_it_once_per_process_and_a_corrupted_one_still_fails(
    tmp_path, group, crc_reads, monkeypatch
):
    cfg = CheckpointConfig(verify="load")
    sizes = {"__0_0.distcp": 300_000, "__0_1.distcp": 200_000, ".metadata": 5_000}
    ckpt = synthetic_checkpoint(tmp_path / "step_00000004", sizes, created=1000.0)
    crc_reads.clear()  # writing it checksummed each file
    assert resume._verify(group, cfg, ckpt) is None
    assert sum(crc_reads) == sum(sizes.values())
    crc_reads.clear()
    assert resume._verify(group, cfg, ckpt) is None  # a later attempt of this process (an in-process restart)
    assert crc_reads == []
    # The same path holding another checkpoint (rewritten: another created_unix) is verified again.
    again = store.CheckpointInfo(4, ckpt.path, {**ckpt.manifest, "created_unix": 2000.0})
    crc_reads.clear()
    assert resume._verify(group, cfg, again) is None and sum(crc_reads) == sum(sizes.values())
    # A fresh process remembers nothing: a byte changed since is caught, the file named.
    monkeypatch.setattr(integrity, "verified_here", integrity.VerifiedHere())
    data = bytearray((ckpt.path / "__0_0.distcp").read_bytes())
    data[1234] ^= 0x01
    (ckpt.path / "__0_0.distcp").write_bytes(bytes(data))
    error = resume._verify(group, cfg, ckpt)
    assert error is not None and "__0_0.distcp: crc32c" in error


def test_a_checkpoint_the_s3_restore_checked_is_not_verified_again(tmp_path, group, crc_reads):
    ckpt = synthetic_checkpoint(tmp_path / "step_00000004", {"__0_0.distcp": 10_000}, created=1000.0)
    crc_reads.clear()
    # What restore_collectively records once every rank's download passed its checksums; the
    # manifest the load sees is the committed COMPLETE, the same identity.
    integrity.verified_here.remember(ckpt.path, dict(ckpt.manifest))
    assert resume._verify(group, CheckpointConfig(verify="load"), ckpt) is None
    assert crc_reads == []


@pytest.fixture
def metadata_opens(monkeypatch) -> list:
    """The ``.metadata`` files DCP's file system opens (torch's create_stream still opens them)."""
    opened: list[str] = []
    real = FileSystem.create_stream

    def counted(self, path, mode):
        if Path(path).name == ".metadata":
            opened.append(str(path))
        return real(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", counted)
    return opened


def test_the_dcp_metadata_is_read_once_per_load_whatever_the_world_size(tmp_path, group, metadata_opens, monkeypatch):
    saved = {"w": torch.randn(16, 8), "b": torch.randn(8)}
    dcp.save(saved, checkpoint_id=str(tmp_path))
    metadata_opens.clear()
    sent = []
    broadcast = resume.RankGroup.broadcast
    monkeypatch.setattr(resume.RankGroup, "broadcast", lambda self, obj: sent.append(obj) or broadcast(self, obj))
    # The coordinator: reads the file once, broadcasts its bytes (not the object, which it would
    # unpickle and pickle again alone), and loads with what it unpickled.
    reader, error = resume.shared_metadata_reader(group, tmp_path)
    assert error is None
    assert sent == [{"bytes": (tmp_path / ".metadata").read_bytes()}]
    target = {"w": torch.zeros(16, 8), "b": torch.zeros(8)}
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["w"], saved["w"]) and torch.equal(target["b"], saved["b"])
    coordinator = len(metadata_opens)
    # Any other rank: handed the broadcast bytes, unpickled there.
    metadata_opens.clear()
    shared = pickle.loads(pickle.loads(pickle.dumps(sent[0]))["bytes"])
    other = {"w": torch.zeros(16, 8), "b": torch.zeros(8)}
    dcp.load(other, storage_reader=resume.SharedMetadataReader(tmp_path, shared))
    assert torch.equal(other["w"], saved["w"])
    non_coordinator = len(metadata_opens)
    # torch's own reader, for comparison: every rank opens the file in dcp.load.
    metadata_opens.clear()
    dcp.load({"w": torch.zeros(16, 8), "b": torch.zeros(8)}, checkpoint_id=str(tmp_path))
    default = len(metadata_opens)
    assert (coordinator, non_coordinator, default) == (1, 0, 1)
    for world in (1, 8, 1024):
        assert coordinator + (world - 1) * non_coordinator == 1
        assert world * default == world
    # A metadata file rank 0 cannot read is the same error on every rank (the older checkpoint is tried).
    (tmp_path / ".metadata").write_bytes(b"not a pickle")
    reader, error = resume.shared_metadata_reader(group, tmp_path)
    assert reader is None and "cannot read its DCP metadata: UnpicklingError" in error
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    reader, error = resume.shared_metadata_reader(group, tmp_path)
    assert reader is None and "a dict, not DCP's Metadata" in error
    (tmp_path / ".metadata").unlink()
    reader, error = resume.shared_metadata_reader(group, tmp_path)
    assert reader is None and "cannot read its DCP metadata: FileNotFoundError" in error


def test_the_resume_cost_model_at_1024_ranks_reads_each_byte_once_to_verify_and_the_metadata_once():
    cost = resume_cost.model(world=1024, checkpoint_bytes=840e9, files_per_rank=1, metadata_bytes=320e6)
    fresh, again, restored = cost["fresh_process"], cost["in_process_restart"], cost["after_s3_restore"]
    assert fresh["verify_bytes"] == pytest.approx(840e9 + 320e6) and fresh["load_metadata_reads"] == 1
    assert again["verify_bytes"] == 0 and restored["verify_bytes"] == 0
    assert restored["download_check_bytes"] == pytest.approx(840e9 + 320e6)
    # Balanced by bytes: rank 0 (the largest file first) verifies about its fair part, no more than
    # that plus one file.
    assert (840e9 + 320e6) / 1024 - 820e6 <= cost["verify_bytes_rank0"] <= (840e9 + 320e6) / 1024 + 820e6
    assert cost["metadata_bytes_read"] == 320e6 and cost["metadata_bytes_read_torch_default"] == 1024 * 320e6


class TwoLayers(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.norm = nn.Parameter(torch.arange(8, dtype=torch.float32))


def documented_digest(model: nn.Module) -> str:
    """params_sha256's definition, as its docstring states it, for an unsharded model."""
    header = hashlib.sha256(b"resilient-fsdp params_sha256 v2\n")
    total = 0
    for name, p in model.named_parameters():
        header.update(f"{name}|{p.dtype}|{tuple(p.shape)}\n".encode())
        t = p.detach().contiguous()
        if t.dim() >= 2:
            for i in range(t.shape[0]):
                leaf = f"{name}|{i}|".encode() + t[i].contiguous().view(torch.uint8).numpy().tobytes()
                total += int.from_bytes(hashlib.sha256(leaf).digest(), "big")
        else:
            leaf = f"{name}|*|".encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes()
            total += int.from_bytes(hashlib.sha256(leaf).digest(), "big")
    return hashlib.sha256(header.digest() + (total % (1 << 256)).to_bytes(32, "big")).hexdigest()


def test_the_parameter_hash_follows_its_definition_in_host_blocks_of_bounded_size(group, monkeypatch):
    weight = torch.randn(64, 48).t()  # not contiguous: its rows are copied to the host to be hashed
    model = TwoLayers(weight)
    expected = documented_digest(model)
    assert metrics.params_sha256(model) == expected
    monkeypatch.setattr(metrics, "HASH_BLOCK_BYTES", 1024)  # 5 rows of 192 bytes a block
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert metrics.params_sha256(model) == expected  # the block size is no part of the digest
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    assert 0 < largest <= 1024, largest
    monkeypatch.setattr(metrics, "HASH_BLOCK_BYTES", 100)  # a row larger than a block: hashed in slices
    assert metrics.params_sha256(model) == expected
    with torch.no_grad():
        model.weight[47, 63] = torch.nextafter(model.weight[47, 63], torch.tensor(1e9))
    assert metrics.params_sha256(model) != expected


def test_hash_throughput_is_measured_per_rank():
    measured = resume_cost.hash_throughput(megabytes=8)
    assert measured["bytes"] == 8 * 2**20 and measured["gb_per_s"] > 0


def test_the_commits_index_holds_every_place_of_the_metadata_and_a_resume_reads_it_not_the_metadata(
    tmp_path, group, metadata_opens, monkeypatch
):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from resilient_fsdp.checkpoint import metadata_index

    saved = {"w": torch.randn(16, 8), "b": torch.randn(8), "step": 7, "note": {"text": "x"}}
    dcp.save(saved, checkpoint_id=str(tmp_path))
    full = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    index = metadata_index.encode(full, dict(full.storage_data))
    (tmp_path / metadata_index.INDEX_FILE).write_bytes(index)
    decoded = metadata_index.decode(index)
    # Every place of DCP's own metadata, byte items (no offsets) included, and nothing else.
    assert len(decoded.storage_data) == len(full.storage_data) == 4
    assert set(decoded.storage_data) == set(full.storage_data)
    for key, info in full.storage_data.items():
        assert decoded.storage_data[key] == info, key
    with pytest.raises(KeyError):
        decoded.storage_data[MetadataIndex("w", torch.Size([8, 0]))]
    assert decoded.state_dict_metadata == full.state_dict_metadata and decoded.planner_data == full.planner_data
    # A resume reads the index, broadcasts its bytes and never opens .metadata.
    metadata_opens.clear()
    sent = []
    broadcast = resume.RankGroup.broadcast
    monkeypatch.setattr(resume.RankGroup, "broadcast", lambda self, obj: sent.append(obj) or broadcast(self, obj))
    reader, error = resume.shared_metadata_reader(group, tmp_path)
    assert error is None and sent == [{"index": index}]
    target = {"w": torch.zeros(16, 8), "b": torch.zeros(8), "step": 0, "note": {"text": ""}}
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["w"], saved["w"]) and torch.equal(target["b"], saved["b"])
    assert (target["step"], target["note"]) == (7, {"text": "x"})
    assert metadata_opens == []
    # An index that does not decode is named; a storage the index cannot hold gives no index.
    (tmp_path / metadata_index.INDEX_FILE).write_bytes(b"not a pickle")
    reader, error = resume.shared_metadata_reader(group, tmp_path)
    assert reader is None and f"cannot read its {metadata_index.INDEX_FILE}: UnpicklingError" in error
    transformed = {k: _StorageInfo(v.relative_path, v.offset, v.length, ["zstd"]) for k, v in full.storage_data.items()}
    assert metadata_index.encode(full, transformed) is None
