"""Two jobs on one object-store root (S3 through tensorstore's own driver, against a moto server on loopback).

The lock object is created with a real conditional write (tensorstore sends ``If-None-Match: *``; moto answers
412 when it exists): of eight saves creating it at once one wins, and a second save into a target another
save holds is refused naming the target and the holder. The lock is a lease: its holder refreshes it, so a
live save keeps its target against other saves however long it runs, and a crashed save's lock (its process
killed with SIGKILL) is taken over with a warning at once (its process on this host is gone; a lock that
stops being refreshed once its lease ran out); a save whose lock was taken over
never commits."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.errors import CheckpointExistsError, StorageError
from arraycheckpoint.storage import lease, locks, storage_for
from arraycheckpoint.storage.base import LOCK_KEY

pytest.importorskip("moto")


@pytest.fixture(autouse=True)
def short_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(locks.HEARTBEAT_ENV, "0.2")
    monkeypatch.setenv(locks.LEASE_ENV, "4")  # 0.8 s


@pytest.fixture
def root(s3_server) -> str:
    return f"s3://{s3_server.bucket}/lease-{uuid.uuid4().hex[:8]}"


def _claim(url: str, token: str):
    storage, final = storage_for(url)
    storage.check_target(final, overwrite=False)
    storage.acquire(final, token)
    return storage, final


def test_of_eight_concurrent_creates_one_wins(root: str) -> None:
    final = f"{root}/step_1"
    results: list[tuple[bool, str]] = []
    start = threading.Barrier(8)

    def create(i: int) -> None:
        storage, _ = storage_for(final)
        start.wait()
        results.append((storage._create_lock(final, lease.body(f"racer{i}")), f"racer{i}"))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [name for won, name in results if won]
    assert len(winners) == 1, results
    storage, _ = storage_for(final)
    assert storage._lock_token(final) == winners[0]


def test_a_second_save_into_a_held_target_is_refused_naming_it_and_the_holder(root: str, s3_server) -> None:
    url = f"{root}/step_1"
    storage, final = _claim(url, "joba-0")
    try:
        time.sleep(1.6)  # two leases: the holder refreshed it all along
        with pytest.raises(CheckpointExistsError) as info:
            _claim(url, "jobb-0")
        assert final in str(info.value) and "save joba-0 pid" in str(info.value), info.value
        with pytest.raises(CheckpointExistsError, match="in progress"):
            acp.save(url, {"w": np.arange(3)})
        prefix = final[len(f"s3://{s3_server.bucket}/") :]
        assert f"{prefix}/{LOCK_KEY}" in s3_server.keys(prefix)
        assert storage._lock_token(final) == "joba-0"
    finally:
        storage.release(final, "joba-0")
    acp.save(url, {"w": np.arange(3)})  # released: the next save goes ahead


HOLD = """
import sys
from arraycheckpoint.storage import storage_for
storage, final = storage_for(sys.argv[1])
storage.check_target(final, False)
storage.acquire(final, "crashed-0")
storage.write(final, "w/zarr.json", b"{}")  # a save in flight writes in place
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_killed_saves_lease_is_taken_over_and_a_stale_holder_never_commits(
    root: str, caplog, monkeypatch
) -> None:
    url = f"{root}/step_1"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointExistsError, match="save crashed-0 pid"):
            acp.save(url, {"w": np.arange(3)})  # alive: refreshed
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        with caplog.at_level(logging.WARNING, logger="arraycheckpoint"):  # at once: its process on this host
            acp.save(url, {"w": np.arange(3)})  # is gone (elsewhere: once its lease ran out, below)
        assert "taking over" in caplog.text and "save crashed-0 pid" in caplog.text
        assert "on this host is gone" in caplog.text
        back = {"w": np.zeros(3, dtype=np.int64)}
        acp.load(url, back)
        assert np.array_equal(back["w"], np.arange(3))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)

    # a holder that stopped refreshing (stopped, not dead): taken over; its own commit is then refused
    url2 = f"{root}/step_2"
    stale, final2 = _claim(url2, "stale-0")
    lease.drop(stale, final2, "stale-0")  # its heartbeat stops (a SIGSTOP of its process)
    time.sleep(1.2)
    acp.save(url2, {"w": np.arange(4)})
    with pytest.raises(StorageError, match="refused"):
        stale.commit(final2, final2, False)
    back = {"w": np.zeros(4, dtype=np.int64)}
    acp.load(url2, back)
    assert np.array_equal(back["w"], np.arange(4))
