"""``s3://`` backend against a real S3-compatible server (moto's server mode on loopback, started here):
the conformance suite, multi-process round trips, zarr-python reading the stored objects, retries."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.errors import StorageError
from arraycheckpoint.format.metadata import COMMIT_MARKER
from arraycheckpoint.storage import configure, storage_for
from arraycheckpoint.storage.s3 import S3Storage
from arraycheckpoint.testing.storage import StorageTests


class TestS3(StorageTests):
    @pytest.fixture
    def base_url(self, s3_prefix: str) -> str:
        return s3_prefix

    @pytest.fixture
    def zarr_store(self, s3_server):
        return s3_server.zarr_store


def test_objects_and_marker_land_in_the_bucket(s3_server, s3_prefix: str) -> None:
    backend, root = storage_for(s3_prefix + "/ck/")
    assert isinstance(backend, S3Storage) and backend.commit_strategy == "marker"
    spec = backend.kvstore_spec(root)
    assert (
        spec["driver"] == "s3"
        and spec["bucket"] == s3_server.bucket
        and spec["endpoint"] == s3_server.endpoint
    )
    assert spec["context"]["s3_request_retries"]["max_retries"] >= 1
    # a small tensor lands in the rank's pack (one object), one above the pack limit in its own directory
    big = torch.ones(1024, 1024)  # 4 MiB: above the 1 MiB target size, its own file
    acp.save(
        root,
        {"model": {"w": torch.ones(4, 4), "big": big}},
        plan_options=acp.PlanOptions(min_chunk_bytes=1 << 20),
    )
    prefix = root[len(f"s3://{s3_server.bucket}/") :] + "/"
    keys = s3_server.keys(prefix)
    assert prefix + COMMIT_MARKER in keys and prefix + "model/big/c.0.0" in keys
    assert prefix + ".acp/packs/0.0.zip" in keys and prefix + "model/w/c.0.0" not in keys
    assert prefix + ".acp-lock" not in keys
    target = {"model": {"w": torch.zeros(4, 4), "big": torch.zeros(1024, 1024)}}
    acp.load(root, target)
    assert torch.equal(target["model"]["w"], torch.ones(4, 4)) and torch.equal(target["model"]["big"], big)


def _save_two_ranks(rank: int, world: int, endpoint: str, url: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)
    full = torch.randn(37, 19, generator=g)
    emb = torch.randn(8, 5, generator=g).to(torch.bfloat16)
    state = {
        "model": {
            "w": distribute_tensor(full, mesh, [Shard(0)]),
            "emb": distribute_tensor(emb, mesh, [Shard(1)]),
        }
    }
    small_chunks = acp.PlanOptions(min_chunk_bytes=256, max_chunk_bytes=1024, inner_chunk_bytes=256)
    fut = acp.save_async(url, state, step=3, plan_options=small_chunks)
    fut.staged.result()
    fut.result()


def test_two_rank_save_then_single_process_load(s3_server, s3_prefix: str) -> None:
    url = s3_prefix + "/dist"
    run_distributed(_save_two_ranks, world=2, args=(s3_server.endpoint, url))
    g = torch.Generator().manual_seed(11)
    full = torch.randn(37, 19, generator=g)
    emb = torch.randn(8, 5, generator=g).to(torch.bfloat16)
    target = {"model": {"w": torch.zeros(37, 19), "emb": torch.zeros(8, 5, dtype=torch.bfloat16)}}
    acp.load(url, target)
    assert torch.equal(target["model"]["w"], full)
    assert torch.equal(target["model"]["emb"], emb)
    meta = acp.read_metadata(url)
    assert meta.world_size == 2 and set(meta.tensors["model/w"].writers) == {0, 1}  # both ranks wrote to S3
    import numpy as np
    import zarr

    from arraycheckpoint.zarr import checkpoint_store

    _, root = storage_for(url)
    if meta.tensors["model/w"].pack is None:
        arr = zarr.open_array(s3_server.zarr_store(root), path="model/w", mode="r")
    else:  # format 6: its chunks in both ranks' packs, read with ranged GETs through the checkpoint store
        arr = zarr.open_group(checkpoint_store(s3_server.zarr_store(root)), mode="r")["model/w"]
    assert np.array_equal(arr[...], full.numpy())


def test_options_instead_of_environment(s3_server, s3_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    configure("s3", endpoint=s3_server.endpoint, region="us-east-1", access_key_id="k", secret_access_key="s")
    try:
        backend, root = storage_for(s3_prefix + "/opts")
        assert backend.credentials["type"] == "profile"
        assert oct(os.stat(backend.credentials["credentials_file"]).st_mode & 0o777) == "0o600"
        acp.save(root, {"model": {"w": torch.arange(6.0)}})
        target = {"model": {"w": torch.zeros(6)}}
        acp.load(root, target)
        assert torch.equal(target["model"]["w"], torch.arange(6.0))
    finally:
        configure("s3", endpoint=None, region=None, access_key_id=None, secret_access_key=None)


def test_throttling_is_retried_and_logged(s3_server, fault_proxy, s3_prefix: str, caplog) -> None:
    configure("s3", endpoint=fault_proxy.endpoint, max_retries=1, initial_delay="1ms", max_delay="2ms")
    try:
        backend, root = storage_for(s3_prefix + "/retry")
        backend.retry_policy = type(backend.retry_policy)(max_attempts=6, initial_delay=0.01, max_delay=0.05)
        fault_proxy.fail_next = 4  # more than tensorstore's own retries: our layer must retry too
        with caplog.at_level(logging.WARNING, logger="arraycheckpoint"):
            backend.write(root, "meta.json", b"{}")
        assert fault_proxy.failed == 4
        assert backend.read(root, "meta.json") == b"{}"
        assert any("retrying" in r.getMessage() and "meta.json" in r.getMessage() for r in caplog.records)
        # A whole save through the throttling proxy (tensorstore's own retries take the data writes).
        configure("s3", max_retries=8)
        fault_proxy.fail_next = 3
        acp.save(s3_prefix + "/retry-save", {"model": {"w": torch.full((3, 3), 2.5)}})
        target = {"model": {"w": torch.zeros(3, 3)}}
        acp.load(s3_prefix + "/retry-save", target)
        assert torch.equal(target["model"]["w"], torch.full((3, 3), 2.5))
    finally:
        configure("s3", endpoint=None, max_retries=None, initial_delay=None, max_delay=None)


def test_permanent_errors_fail_fast_with_path_and_operation(s3_server, fault_proxy, s3_prefix: str) -> None:
    configure("s3", endpoint=fault_proxy.endpoint, max_retries=2, initial_delay="1ms", max_delay="2ms")
    try:
        fault_proxy.status = 403
        fault_proxy.body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
        fault_proxy.fail_next = 100
        backend, root = storage_for(s3_prefix + "/denied")
        with pytest.raises(StorageError, match=r"storage write of .*/denied/x\.json failed \(permanent"):
            backend.write(root, "x.json", b"1")
        assert fault_proxy.failed <= 3, "a permanent error was retried"
    finally:
        configure("s3", endpoint=None, max_retries=None, initial_delay=None, max_delay=None)
    backend, root = storage_for("s3://no-such-bucket-acp/x")
    with pytest.raises(StorageError, match=r"storage write of s3://no-such-bucket-acp/x/y failed"):
        backend.write(root, "y", b"1")


def test_manager_on_s3(s3_server, s3_prefix: str) -> None:
    from arraycheckpoint.manager import CheckpointManager

    def state(step: int) -> dict:
        return {"model": {"w": torch.full((4, 5), float(step)), "s": torch.tensor([step])}}

    with CheckpointManager(s3_prefix + "/run", keep_last=2) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, state(step)).result()
        assert mgr.all_steps() == [200, 300]
        target = {"model": {"w": torch.zeros(4, 5), "s": torch.tensor([0])}}
        mgr.restore(state=target)
        assert torch.equal(target["model"]["w"], state(300)["model"]["w"])
        # a crashed in-place save: objects but no marker, and its lock
        mgr.storage.write(mgr.step_path(400), "model/w/c/0/0", b"partial")
        mgr.storage.write(mgr.step_path(400), ".acp-lock", b'{"token": "dead"}')
        mgr.storage.write(mgr.step_path(300), ".acp-lock", b'{"token": "dead"}')  # crash after commit
    prefix = s3_prefix[len(f"s3://{s3_server.bucket}/") :] + "/run/"
    assert any("step_00000400" in k for k in s3_server.keys(prefix))
    mgr = CheckpointManager(s3_prefix + "/run", keep_last=2)
    assert mgr.all_steps() == [200, 300]
    keys = s3_server.keys(prefix)
    assert not any("step_00000400" in k or "step_00000100" in k or k.endswith(".acp-lock") for k in keys), (
        keys
    )
    mgr.save(400, state(400)).result()  # the step is free again
    assert mgr.all_steps() == [300, 400]
    mgr.close()
