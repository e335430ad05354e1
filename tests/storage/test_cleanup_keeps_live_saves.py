"""A second job's manager starting (``cleanup=True``, the default) on an object-store root that a running job
saves to keeps that job's save in flight (its lock is a live lease), objects and all, and removes only what
crashed saves left: a lock whose lease ran out, with its step, one whose process on this host is gone
(though its lease is fresh), and a step without a lock. The live save then
commits. Real S3 server (moto on loopback), the live save in another process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from arraycheckpoint.manager import CheckpointManager
from arraycheckpoint.storage import lease, storage_for
from arraycheckpoint.storage.base import LOCK_KEY

pytest.importorskip("moto")

LIVE = """
import sys
from arraycheckpoint.storage import storage_for
storage, final = storage_for(sys.argv[1])
storage.check_target(final, False)
storage.acquire(final, "live-0")
storage.write(final, "w/zarr.json", b"{}")
storage.write(final, "w/c.0", b"rank 0's chunk")
print("writing", flush=True)
sys.stdin.readline()
storage.commit(final, final, False)
storage.release(final, "live-0")
print("committed", flush=True)
"""


DIES = """
import os, sys
from arraycheckpoint.storage import storage_for
storage, final = storage_for(sys.argv[1])
storage.acquire(final, "died-4")
storage.write(final, "w/c.0", b"partial")
os._exit(0)
"""


def test_a_second_managers_cleanup_keeps_a_live_save_and_removes_crashed_ones(s3_server) -> None:
    root = f"s3://{s3_server.bucket}/two-jobs-{uuid.uuid4().hex[:8]}"
    store, _ = storage_for(root)
    step = {n: f"{root}/step_{n:08d}" for n in (1, 2, 3, 4)}
    # step 1: a save that crashed an hour ago (its lease ran out); step 3: one that crashed before its lock
    store.write(step[1], LOCK_KEY, lease.body("crashed-1", time.time() - 3600))
    store.write(step[1], "w/c.0", b"partial")
    store.write(step[3], "w/zarr.json", b"{}")
    # step 4: a save whose process on this host died a moment ago (its lease is fresh): crashed at once
    subprocess.run(
        [sys.executable, "-c", DIES, step[4]], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()}
    )
    assert lease.parse(store.read(step[4], LOCK_KEY))["token"] == "died-4"
    live = subprocess.Popen(
        [sys.executable, "-c", LIVE, step[2]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert live.stdout is not None and live.stdout.readline().strip() == "writing"
        mgr = CheckpointManager(root)  # the second job: cleanup on start
        assert all(step[n] in mgr.removed for n in (1, 3, 4)), mgr.removed
        assert f"{step[1]}/{LOCK_KEY}" in mgr.removed
        assert not any(step[2] in path for path in mgr.removed), mgr.removed
        prefix = root[len(f"s3://{s3_server.bucket}/") :]
        keys = s3_server.keys(prefix)
        assert all("step_00000002" in k for k in keys), keys
        assert store.read(step[2], "w/c.0") == b"rank 0's chunk"
        assert lease.parse(store.read(step[2], LOCK_KEY))["token"] == "live-0"
        out, _ = live.communicate("go\n", timeout=60)
        assert "committed" in out, out
        assert mgr.all_steps() == [2]
        mgr.close()
    finally:
        if live.poll() is None:
            live.kill()
        live.wait(timeout=60)


def test_cleanup_takes_the_step_it_removes_so_a_save_starting_there_is_refused_not_emptied(s3_server) -> None:
    """The removal of an uncommitted step holds the step's lock while it deletes: a save arriving meanwhile
    finds it held (and a live save's step is never removed)."""
    root = f"s3://{s3_server.bucket}/two-jobs-{uuid.uuid4().hex[:8]}"
    store, _ = storage_for(root)
    final = f"{root}/step_00000001"
    store.write(final, "w/c.0", b"partial")
    seen: list[str | None] = []
    delete_key = store.delete_key

    def watching(root_: str, key: str, guard=None) -> None:
        if key != LOCK_KEY:
            seen.append(store._lock_token(final))
        delete_key(root_, key, guard)

    store.delete_key = watching  # type: ignore[method-assign]
    assert store.remove_uncommitted(final)
    assert seen and all(t is not None and t.startswith("cleanup-") for t in seen), seen
    assert store.list(final) == []
    other, _ = storage_for(final)
    other.check_target(final, overwrite=False)
    other.acquire(final, "live-1")
    try:
        assert not store.remove_uncommitted(final)  # live: kept
        assert lease.parse(store.read(final, LOCK_KEY))["token"] == "live-1"
    finally:
        other.release(final, "live-1")
