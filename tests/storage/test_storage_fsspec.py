"""fsspec backend: the conformance suite over fsspec's local file system (``local://``) and over fsspec's
in-memory file system registered under a protocol of its own (``acpfsmem://``, distinct from our
``memory://``, which is tensorstore's)."""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from arraycheckpoint.storage import storage_for
from arraycheckpoint.storage.fsspec_store import FsspecStorage
from arraycheckpoint.testing.storage import StorageTests


class AcpFsMemory(MemoryFileSystem):
    """fsspec's MemoryFileSystem under another protocol name (its store is fsspec's process-wide dict)."""

    protocol = "acpfsmem"


fsspec.register_implementation("acpfsmem", AcpFsMemory, clobber=True)


def _zarr_fsspec_store(fs, path: str):
    import zarr
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

    return zarr.storage.FsspecStore(fs=AsyncFileSystemWrapper(fs), path=path, read_only=True)


class TestFsspecLocal(StorageTests):
    @pytest.fixture
    def base_url(self, tmp_path: Path) -> str:
        return f"local://{tmp_path}/ckpts"

    @pytest.fixture
    def zarr_store(self):
        return lambda root: _zarr_fsspec_store(fsspec.filesystem("local"), root[len("local://") :])


class TestFsspecMemory(StorageTests):
    @pytest.fixture
    def base_url(self) -> str:
        return f"acpfsmem://conformance-{uuid.uuid4().hex[:8]}"

    @pytest.fixture
    def zarr_store(self):
        return lambda root: _zarr_fsspec_store(AcpFsMemory(), root[len("acpfsmem://") :])


def test_dispatch_and_buffers_are_freed(tmp_path: Path) -> None:
    import gc

    import tensorstore as ts
    import torch

    import arraycheckpoint as acp
    from arraycheckpoint.runtime.tscontext import context

    backend, root = storage_for(f"local://{tmp_path}/x")
    assert isinstance(backend, FsspecStorage) and backend.commit_strategy == "marker"
    state = {"model": {"w": torch.arange(1000, dtype=torch.float32).reshape(10, 100)}}
    acp.save(root, state)
    target = {"model": {"w": torch.zeros(10, 100)}}
    acp.load(root, target)
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    gc.collect()
    memory = ts.KvStore.open({"driver": "memory", "path": "acp-fsspec/"}, context=context()).result()
    assert memory.list().result() == [], "upload/download buffers were not released"
    # the small tensor is a member of rank 0's pack, stored under the key its own directory would have
    import zipfile

    with zipfile.ZipFile(tmp_path / "x" / ".acp" / "packs" / "0.0.zip") as pack:
        assert {"model/w/zarr.json", "model/w/c.0.0"} <= set(pack.namelist())
    assert not (tmp_path / "x" / "model" / "w").exists()


def test_unknown_protocol_is_a_clear_error() -> None:
    from arraycheckpoint.errors import StorageError

    with pytest.raises(StorageError, match="no storage backend for nosuchproto://"):
        storage_for("nosuchproto://bucket/x")


def _two_rank_fsspec_save(rank: int, world: int, url: str) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import arraycheckpoint as acp

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(60 * 7, dtype=torch.float64).reshape(60, 7)
    small_chunks = acp.PlanOptions(min_chunk_bytes=512, max_chunk_bytes=2048, inner_chunk_bytes=512)
    acp.save(url, {"model": {"w": distribute_tensor(full, mesh, [Shard(0)])}}, plan_options=small_chunks)


def test_two_ranks_upload_their_own_chunks(tmp_path: Path) -> None:
    import torch
    from dist import run_distributed

    import arraycheckpoint as acp

    url = f"local://{tmp_path}/dist"
    run_distributed(_two_rank_fsspec_save, world=2, args=(url,))
    target = {"model": {"w": torch.zeros(60, 7, dtype=torch.float64)}}
    acp.load(url, target)
    assert torch.equal(target["model"]["w"], torch.arange(60 * 7, dtype=torch.float64).reshape(60, 7))
    meta = acp.read_metadata(url)
    assert meta.world_size == 2 and set(meta.tensors["model/w"].writers) == {0, 1}


def test_an_overwrite_and_an_aborted_save_on_fsspec_leave_one_committed_checkpoint(monkeypatch) -> None:
    """``overwrite=True`` clears the old checkpoint and a failed save's abort deletes what it wrote, through
    the fsspec backend's own ``delete_key`` (it lacked the lease guard's argument: every overwrite failed
    after clearing the old commit marker, leaving nothing committed)."""
    import numpy as np

    import arraycheckpoint as acp
    from arraycheckpoint.storage.fsspec_store import FsspecStorage

    url = f"acpfsmem://overwrite-{uuid.uuid4().hex[:8]}/ck"
    acp.save(url, {"w": np.arange(10.0)})
    acp.save(url, {"w": np.arange(10.0) + 1}, overwrite=True)
    out = {"w": np.zeros(10)}
    acp.load(url, out)
    assert np.array_equal(out["w"], np.arange(10.0) + 1)

    def refused(self, *args, **kwargs):
        raise OSError("injected: the commit marker could not be written")

    fresh = f"acpfsmem://aborted-{uuid.uuid4().hex[:8]}/ck"
    monkeypatch.setattr(FsspecStorage, "commit", refused)
    with pytest.raises(Exception, match="injected"):
        acp.save(fresh, {"w": np.arange(10.0)})
    monkeypatch.undo()
    storage, root = storage_for(fresh)
    assert storage.list(root) == []  # the abort deleted everything the failed save wrote
