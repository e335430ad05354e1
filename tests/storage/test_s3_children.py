"""The checkpoint manager's listing of an S3 root: one entry per step, not one per object. tensorstore's
listing has no delimiter, so every ``latest_step()`` walked every object of every step kept (a run keeping
100 steps of 10,000 objects listed a million keys); the S3 backend now lists one level, following pages of
1,000 to the end."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from arraycheckpoint import CheckpointManager, storage
from arraycheckpoint.storage.s3 import S3Storage


def test_children_are_listed_one_level_across_pages(s3_server, s3_prefix, fault_proxy) -> None:
    prefix = s3_prefix.split("/", 3)[3]
    names = [f"note-{i:04d}.txt" for i in range(1001)]  # more than one page of ListObjectsV2
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda n: s3_server.client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{n}", Body=b""),
                names,
            )
        )
    storage.register_scheme("s3", lambda: S3Storage(endpoint=fault_proxy.endpoint))
    try:
        with CheckpointManager(s3_prefix, cleanup=False) as mgr:
            for step in (1, 2):
                mgr.save(step, {"w": np.arange(4.0) + step}).result()
            fault_proxy.requests.clear()
            assert mgr.all_steps() == [1, 2]
            listed = mgr.storage.children(mgr.root)
    finally:
        storage.register_scheme("s3", None)
    assert listed == sorted([*names, "step_00000001", "step_00000002"])
    lists = [path for method, path, _, _ in fault_proxy.requests if method == "GET" and "list-type=2" in path]
    assert lists and all("delimiter=" in path for path in lists), lists
