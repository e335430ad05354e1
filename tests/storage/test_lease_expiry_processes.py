"""A save's ranks stop writing before its lease can be taken over, with real processes against a real S3
server (moto on loopback) and short heartbeats (0.3 s, a lease of 5 intervals: 1.5 s; safe for 1.2 s).

Rank 0 (a process holding the lease) writes in place, and so does rank 1 (another process, following the
lease with the grant rank 0 gave it, as the save's write agreement carries it). Rank 0 is stopped (SIGSTOP:
a frozen VM, a long pause); its refreshes stop. Rank 1 stops writing on its own once the lease is too old,
before this process can take the target over; the taker's object is never overwritten. Rank 0, continued,
stops at its next check (its last refresh is older than the safe part by its monotonic clock, or its lease
thread found the lock taken over), and its commit is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from arraycheckpoint.errors import CheckpointExistsError
from arraycheckpoint.storage import locks, storage_for

pytest.importorskip("moto")

ENV = {locks.HEARTBEAT_ENV: "0.3", locks.LEASE_ENV: "5"}

RANK0 = """
import json, sys, time
from arraycheckpoint.storage import storage_for
storage, final = storage_for(sys.argv[1])
storage.check_target(final, False)
storage.acquire(final, "job-0")
print(json.dumps(storage.lease_grant(final)), flush=True)
try:
    while True:
        storage.check_lease(final)
        storage.write(final, "v/c.0", b"rank 0 of job-0")
        time.sleep(0.02)
except Exception as e:
    print("stopped:", e, flush=True)
try:
    storage.commit(final, final, False)
    print("committed", flush=True)
except Exception as e:
    print("refused:", e, flush=True)
"""

RANK1 = """
import json, sys, time
from arraycheckpoint.storage import storage_for
storage, final = storage_for(sys.argv[1])
storage.follow_lease(final, final, "job-0", json.loads(sys.argv[2]), 1, 2)
writes = 0
try:
    while True:
        storage.check_lease(final)
        storage.write(final, "w/c.0", b"rank 1 of job-0")
        writes += 1
        time.sleep(0.02)
except Exception as e:
    print(f"stopped after {writes} writes:", e, flush=True)
"""


def _start(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **ENV, "PYTHONPATH": os.getcwd()},
    )


def test_ranks_stop_writing_before_a_stopped_holders_lease_can_be_taken_over(s3_server) -> None:
    url = f"s3://{s3_server.bucket}/expiry-{uuid.uuid4().hex[:8]}/step_1"
    rank0 = _start(RANK0, url)
    rank1 = None
    try:
        assert rank0.stdout is not None
        grant = rank0.stdout.readline().strip()
        assert len(json.loads(grant)) == 3, grant
        rank1 = _start(RANK1, url, grant)
        time.sleep(2.0)  # both write for longer than a lease: the holder refreshes it, rank 1 trusts it
        assert rank1.poll() is None, "rank 1 stopped while rank 0 refreshed the lease"
        rank0.send_signal(signal.SIGSTOP)
        os.environ.update(ENV)
        try:
            storage, final = storage_for(url)
            deadline = time.monotonic() + 60
            while True:
                try:
                    storage.check_target(final, overwrite=False)
                    storage.acquire(final, "taker-1")  # takes the stale lease over, clears job-0's objects
                    break
                except CheckpointExistsError:
                    assert time.monotonic() < deadline, "the stopped holder's lease never ran out"
                    time.sleep(0.05)
            storage.write(final, "w/c.0", b"the taker's")
            out1, _ = rank1.communicate(timeout=60)  # it had stopped already
            assert "stopped after" in out1 and "last refreshed" in out1, out1
            assert int(out1.split("stopped after ")[1].split()[0]) > 0  # it wrote before
            rank0.send_signal(signal.SIGCONT)
            out0, _ = rank0.communicate(timeout=60)
            assert (
                "stopped:" in out0 and "refused:" in out0 and "committed" not in out0.replace("commit of", "")
            ), out0
            assert "last refreshed" in out0 or "taken over" in out0, out0
            assert storage.read(final, "w/c.0") == b"the taker's"  # never overwritten by rank 1
            assert storage._lock_token(final) == "taker-1"
            storage.release(final, "taker-1")
        finally:
            for key in ENV:
                os.environ.pop(key, None)
    finally:
        for proc in (rank0, rank1):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=60)
