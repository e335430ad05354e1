"""A checkpoint root on an fsspec object store (``s3a://`` through s3fs, on a moto server) that another job
writes to. s3fs caches listings for the life of the process: a manager (an evaluator watching for new steps,
or a second manager in one process) never saw a step committed by another job, and kept listing one another
job had deleted. Every listing and existence check of the fsspec backend now asks the store."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from arraycheckpoint import CheckpointManager, storage

pytest.importorskip("s3fs", reason="s3fs is not installed (the 'dev' extra lists it)")


@pytest.fixture
def s3a_root(s3_server, s3_prefix) -> Iterator[str]:
    storage.configure("s3a", endpoint_url=s3_server.endpoint)
    try:
        yield s3_prefix.replace("s3://", "s3a://", 1)
    finally:
        storage.configure("s3a", endpoint_url=None)


def _other_job_copies_step(s3_server, prefix: str, src: int, dst: int) -> None:
    """Another job's step ``dst``: the objects of step ``src`` copied by a client of its own, marker last."""
    keys = s3_server.keys(f"{prefix}/step_{src:08d}/")
    for key in sorted(keys, key=lambda k: k.endswith("/.acp/committed")):
        source = {"Bucket": s3_server.bucket, "Key": key}
        s3_server.client.copy_object(
            Bucket=s3_server.bucket, Key=key.replace(f"{src:08d}", f"{dst:08d}"), CopySource=source
        )


def test_a_manager_sees_steps_other_jobs_commit_and_delete(s3_server, s3a_root: str) -> None:
    prefix = s3a_root.split("/", 3)[3]
    w = np.arange(12, dtype=np.float32)
    with CheckpointManager(s3a_root) as mgr:
        mgr.save(1, {"w": w}).result()
        assert mgr.latest_step() == 1
        _other_job_copies_step(s3_server, prefix, 1, 2)
        assert mgr.latest_step() == 2  # was 1: the cached listing of the root
        assert mgr.all_steps() == [1, 2]
        for key in s3_server.keys(f"{prefix}/step_00000001/"):  # another job's retention
            s3_server.client.delete_object(Bucket=s3_server.bucket, Key=key)
        assert mgr.all_steps() == [2]  # was [1, 2]
        out = {"w": np.zeros(12, np.float32)}
        mgr.restore(state=out)
        assert np.array_equal(out["w"], w)
